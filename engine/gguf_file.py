"""GGUF files: checking one before transformers reads it, so that a wrong file gets a sentence, not a traceback;
and writing a Llama-family model as one that llama.cpp decodes (`write_llama`).

A GGUF is a header (magic, version, counts, key-value metadata, one record per tensor: name, shape, type,
offset) and then the tensors' data. `gguf_problem` walks the header itself, byte by byte, so a damaged or
cut file is reported at the offset where it stops making sense; then every tensor's type must be one that
the loader dequantizes (gguf-py's, which transformers calls) and every tensor's data must lie inside the file.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
# value type id -> struct format of one item (8: string, 9: array, read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_STRING = 1 << 30          # a key, a name or a token longer than this is a damaged length
MAX_COUNT = 1 << 32           # more entries or array items than this is a damaged count


class GGUFDamage(ValueError):
    """The header stops making sense at `offset`."""

    def __init__(self, offset: int, what: str) -> None:
        super().__init__(f"at byte offset {offset:,}: {what}")
        self.offset = offset


@dataclass(frozen=True, slots=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int               # from the start of the data section


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    metadata: dict[str, object]    # arrays are kept as their length only
    tensors: list[TensorRecord]
    data_start: int                # byte offset of the data section


class _Cursor:
    def __init__(self, data: memoryview) -> None:
        self.data, self.at = data, 0

    def take(self, n: int, what: str) -> bytes:
        if self.at + n > len(self.data):
            left = len(self.data) - self.at
            raise GGUFDamage(self.at, f"{what} needs {n:,} bytes, the file ends {left:,} bytes later")
        out = bytes(self.data[self.at:self.at + n])
        self.at += n
        return out

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        start = self.at
        n = self.unpack("<Q", f"the length of {what}")
        if n > MAX_STRING:
            raise GGUFDamage(start, f"{what} claims {n:,} bytes")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFDamage(start, f"{what} is not UTF-8 text") from None

    def value(self, type_id: int, what: str):
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id], what)
        if type_id == _STRING:
            return self.string(what)
        if type_id == _ARRAY:
            start = self.at
            item_type = self.unpack("<I", f"the item type of {what}")
            count = self.unpack("<Q", f"the length of {what}")
            if count > MAX_COUNT or item_type not in (*_SCALARS, _STRING):
                raise GGUFDamage(start, f"{what} claims {count:,} items of value type {item_type}")
            if item_type in _SCALARS:
                self.take(count * struct.calcsize(_SCALARS[item_type]), what)
            else:
                for i in range(count):
                    self.string(f"item {i} of {what}")
            return count
        raise GGUFDamage(self.at - 4, f"{what} has value type {type_id}, which no GGUF defines")


def read_header(path: Path) -> Header:
    """The header of the GGUF at `path`; GGUFDamage (with the offset) where it is not one or is cut short."""
    with open(path, "rb") as f:
        if path.stat().st_size < 4:
            raise GGUFDamage(0, f"the file has {path.stat().st_size} bytes; a GGUF starts with {MAGIC!r}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            c = _Cursor(memoryview(mapped))
            try:
                return _header(c)
            finally:
                c.data.release()


def _header(c: _Cursor) -> Header:
    magic = c.take(4, "the magic bytes")
    if magic != MAGIC:
        raise GGUFDamage(0, f"the file starts with {magic!r}; a GGUF starts with {MAGIC!r}")
    version = c.unpack("<I", "the version")
    if version not in (2, 3):
        raise GGUFDamage(4, f"GGUF version {version}; this loader reads versions 2 and 3")
    n_tensors = c.unpack("<Q", "the tensor count")
    n_kv = c.unpack("<Q", "the metadata count")
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
        raise GGUFDamage(8, f"the header claims {n_tensors:,} tensors and {n_kv:,} metadata entries")
    metadata: dict[str, object] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        type_id = c.unpack("<I", f"the value type of {key!r}")
        metadata[key] = c.value(type_id, f"the value of {key!r}")
    tensors = []
    for i in range(n_tensors):
        name = c.string(f"the name of tensor {i}")
        start = c.at
        dims = c.unpack("<I", f"the dimension count of {name!r}")
        if not 1 <= dims <= 8:
            raise GGUFDamage(start, f"tensor {name!r} claims {dims} dimensions")
        shape = tuple(c.unpack("<Q", f"a dimension of {name!r}") for _ in range(dims))
        type_id = c.unpack("<I", f"the type of {name!r}")
        tensors.append(TensorRecord(name, shape, type_id, c.unpack("<Q", f"the data offset of {name!r}")))
    align = metadata.get("general.alignment", 32)
    align = align if isinstance(align, int) and align > 0 else 32
    return Header(version, metadata, tensors, -(-c.at // align) * align)


def readable_types() -> dict[int, str]:
    """Tensor type id -> name, for the types the loader dequantizes (gguf-py's quantizations and plain floats
    and integers)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    plain = {T.F32, T.F16, T.F64, T.I8, T.I16, T.I32, T.I64}
    return {int(t): t.name for t in T if t in plain or t in getattr(quants, "_type_traits", {})}


def type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType as T

    try:
        return T(type_id).name
    except ValueError:
        return f"type id {type_id}"


def gguf_problem(path: Path) -> str | None:
    """Why the GGUF at `path` cannot be loaded, as a sentence naming the offset or the type; None when its
    header is whole, its tensors' types are readable and their data lies inside the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        size = path.stat().st_size
        header = read_header(path)
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    except GGUFDamage as exc:
        return f"{path.name} is not a readable GGUF ({exc})"
    readable = readable_types()
    for t in header.tensors:
        if t.type_id not in readable:
            known = type_name(t.type_id)
            why = "no GGUF defines it" if known.startswith("type id") else "the loader cannot dequantize it"
            return (f"{path.name} stores tensor {t.name!r} as {known}: {why} (it reads "
                    f"{', '.join(sorted(set(readable.values())))})")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
        count = 1
        for d in t.shape:
            count *= d
        end = header.data_start + t.offset + count // block * block_bytes
        if end > size:
            return (f"{path.name} is cut short: tensor {t.name!r} ends at byte offset {end:,}, the file has "
                    f"{size:,} bytes")
    return None


# -- writing -------------------------------------------------------------------------------------------------
class NotWritable(ValueError):
    """A model `write_llama` cannot express as a llama.cpp "llama" GGUF."""


def write_llama(model, tokenizer, out: Path, name: str) -> Path:
    """Write a Llama-family transformers model (fp32, untied or tied head) with a byte-level BPE tokenizer as an
    F32 GGUF of llama.cpp's "llama" architecture, so that llama.cpp decodes exactly these weights. The file is
    written beside `out` and renamed into place when whole.

    Two layouts differ from transformers': llama.cpp rotates each head's query and key dimensions in adjacent
    pairs (0 with 1, 2 with 3, ...) where transformers pairs dimension i with i + head_dim / 2, so the rows of
    every query and key matrix are reordered to match (the dot products of queries with keys are unchanged);
    and a tied LM head is left out, as llama.cpp then reads the embedding matrix instead."""
    import json

    import numpy as np
    from gguf import GGUFWriter, LlamaFileType, TokenType

    config = model.config
    if getattr(config, "model_type", None) != "llama":
        raise NotWritable(f"model type {getattr(config, 'model_type', None)!r}: only llama models are written")
    rope = getattr(getattr(model.model, "rotary_emb", None), "rope_type", "default")
    if rope != "default" or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise NotWritable("rotary scaling or biases: only plain Llama layers are written")
    spec = json.loads(tokenizer.backend_tokenizer.to_str()) if hasattr(tokenizer, "backend_tokenizer") else {}
    bpe, pre = spec.get("model", {}), spec.get("pre_tokenizer") or {}
    if bpe.get("type") != "BPE" or pre.get("type") != "ByteLevel":
        raise NotWritable("only byte-level BPE tokenizers (GPT-2's kind) are written")
    vocab = dict(bpe["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    size = int(model.get_output_embeddings().weight.shape[0])
    by_id = {i: t for t, i in vocab.items()}
    if sorted(by_id) != list(range(len(by_id))) or len(by_id) > size:
        raise NotWritable(f"the tokenizer's ids are not 0..{len(by_id) - 1} within the head's {size} rows")
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    kinds = [TokenType.CONTROL if i in special else TokenType.NORMAL if i in by_id else TokenType.UNUSED
             for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    out = Path(out)
    part = out.with_name(out.name + ".part")
    writer = GGUFWriter(str(part), "llama")
    writer.add_name(name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(kv_heads))
    writer.add_key_length(int(head_dim))
    writer.add_value_length(int(head_dim))
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(size)
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([int(k) for k in kinds])
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        value = getattr(config, key, None)
        if isinstance(value, int):
            add(value)
    writer.add_add_bos_token(False)

    def tensor(gguf_name: str, weight) -> None:
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight.detach().float().cpu().numpy()))

    def paired(weight, n: int):   # each head's rows i and i + head_dim / 2 next to each other
        return weight.reshape(n, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)

    inner = model.model
    tensor("token_embd.weight", inner.embed_tokens.weight)
    for i, layer in enumerate(inner.layers):
        a, m = layer.self_attn, layer.mlp
        tensor(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        tensor(f"blk.{i}.attn_q.weight", paired(a.q_proj.weight, heads))
        tensor(f"blk.{i}.attn_k.weight", paired(a.k_proj.weight, kv_heads))
        tensor(f"blk.{i}.attn_v.weight", a.v_proj.weight)
        tensor(f"blk.{i}.attn_output.weight", a.o_proj.weight)
        tensor(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        tensor(f"blk.{i}.ffn_gate.weight", m.gate_proj.weight)
        tensor(f"blk.{i}.ffn_up.weight", m.up_proj.weight)
        tensor(f"blk.{i}.ffn_down.weight", m.down_proj.weight)
    tensor("output_norm.weight", inner.norm.weight)
    if model.get_output_embeddings().weight.data_ptr() != inner.embed_tokens.weight.data_ptr():
        tensor("output.weight", model.get_output_embeddings().weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    part.rename(out)
    return out


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))

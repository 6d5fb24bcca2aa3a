"""Checking a GGUF file before transformers reads it, so that a wrong file gets a sentence, not a traceback.

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

"""The built-in pair's corpus: the Python standard library's own sources, found through sysconfig."""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HELDOUT_DIRS = frozenset({"test", "tests", "idle_test"})
SKIP_DIRS = frozenset({"site-packages", "__pycache__"})
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: Path
    text: str


def stdlib_root() -> Path:
    """Where this interpreter's standard library lives; present wherever Python is."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative: Path) -> bool:
    return bool(set(relative.parts[:-1]) & HELDOUT_DIRS)


def list_sources(split: str, root: Path | None = None) -> list[SourceFile]:
    """Return the stdlib's .py files of one split, sorted by path.

    split: "train" (everything outside test folders) or "heldout" (test/, tests/, idle_test/).
    Files that are not valid UTF-8 (a few deliberate test fixtures) are skipped.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts) & SKIP_DIRS or is_heldout(rel) != (split == "heldout"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(SourceFile(path, text))
    return out


def train_tokenizer(files: list[SourceFile], vocab_size: int):
    """Byte-level BPE over the sources; decoding reproduces any text exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer)
    return tok


def encode_stream(tokenizer, files: list[SourceFile], eos_id: int) -> torch.Tensor:
    """One long int32 stream: file, EOS, file, EOS, ... (tokenizer: a `tokenizers.Tokenizer`)."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch([f.text for f in files], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)

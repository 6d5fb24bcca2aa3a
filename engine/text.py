"""Token texts that read right: a stream decoded as a whole and mapped back onto its tokens.

A byte-level vocabulary (GPT-2 style BPE: SmolLM2's, the built-in pair's) splits multi-byte characters
(é, CJK, emoji) across tokens, so decoding tokens one at a time shows replacement characters where the
text is fine. Here each token's raw bytes go through one incremental UTF-8 decoder: a token shows the
characters it completes, and a token whose bytes end inside a character is marked partial (its
character appears with the token that completes it).
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from functools import lru_cache

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class TokenText:
    """What one token shows: the characters it completes, and the bytes it carries over when partial."""

    text: str
    partial: bool         # its last bytes start a character that a later token completes
    raw: bytes            # the token's own bytes

    @property
    def pending(self) -> str:
        """Hex of the bytes a partial token leaves for a later one, e.g. "e6 97"; "" when it completes its text."""
        if not self.partial:
            return ""
        tail = self.raw[len(self.raw) - _unfinished(self.raw):]
        return " ".join(f"{b:02x}" for b in tail)


def _unfinished(raw: bytes) -> int:
    """How many trailing bytes of `raw` belong to a UTF-8 character that is not finished."""
    for n in range(1, min(4, len(raw)) + 1):
        lead = raw[-n]
        if lead & 0xC0 != 0x80:      # a lead byte: does the character it starts fit in n bytes?
            need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
            return n if need > n else 0
    return min(4, len(raw))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode table: byte-level BPE writes each byte as one character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


class StreamDecoder:
    """Decodes a token stream incrementally; `copy()` forks it, e.g. to read drafts that may be rejected."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._bytes = is_byte_level(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def copy(self) -> "StreamDecoder":
        other = StreamDecoder.__new__(StreamDecoder)
        other.tokenizer, other._bytes, other._special = self.tokenizer, self._bytes, self._special
        other._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        other._utf8.setstate(self._utf8.getstate())
        return other

    def raw(self, token: int) -> bytes | None:
        """The token's bytes, or None when the vocabulary is not byte-level (or the token is special)."""
        if not self._bytes or token in self._special:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token)
        table = _byte_decoder()
        if piece is None or any(ch not in table for ch in piece):
            return None
        return bytes(table[ch] for ch in piece)

    def feed(self, token: int) -> TokenText:
        raw = self.raw(token)
        if raw is None:  # a special token or a vocabulary without byte pieces: its own decoding
            pending = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            return TokenText(pending + self.tokenizer.decode([token]), False, b"")
        text = self._utf8.decode(raw)
        return TokenText(text, bool(self._utf8.getstate()[0]), raw)

    def feed_all(self, tokens: list[int]) -> list[TokenText]:
        return [self.feed(t) for t in tokens]


def token_texts(tokenizer: PreTrainedTokenizerBase, tokens: list[int], context: list[int] = ()) -> list[TokenText]:
    """The texts of `tokens` read after `context` (whose unfinished bytes they may complete)."""
    decoder = StreamDecoder(tokenizer)
    decoder.feed_all(list(context))
    return decoder.feed_all(tokens)

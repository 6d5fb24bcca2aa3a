"""The n-gram drafter (prompt lookup): copy what followed the latest earlier match of the context's end."""
from __future__ import annotations

import torch

from engine.config import DrafterKind
from engine.drafters.base import DraftCache, Proposal


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from ngram_max down
    to ngram_min) and propose what followed it. q_draft is one-hot, so accept-probability is p(x).
    Costs no model forward."""

    kind = DrafterKind.NGRAM
    needs_features = False

    def __init__(self, ngram_max: int, ngram_min: int, target_vocab: int, target_device: torch.device) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.target_vocab, self.target_device = target_vocab, target_device
        self._followers: dict[tuple[int, ...], int] = {}   # n-gram -> the token after its latest occurrence
        self._indexed = 0                                  # committed tokens the index has read

    def prefill(self, prompt: list[int], features: torch.Tensor | None = None) -> None:
        self._followers, self._indexed = {}, 0

    def index(self, committed: list[int]) -> None:
        """Bring the follower index up to date with the committed tokens (they only grow in a run)."""
        if len(committed) < self._indexed:
            self._followers, self._indexed = {}, 0
        for i in range(max(self._indexed, 1), len(committed)):
            for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                self._followers[tuple(committed[i - n:i])] = committed[i]
        self._indexed = len(committed)

    def follower(self, tail: list[int], min_n: int) -> int | None:
        """The token that followed the latest earlier occurrence of the longest suffix of `tail` (at
        least min_n tokens) in the indexed tokens; what `match` would copy first, found in O(1)."""
        for n in range(min(self.ngram_max, len(tail)), max(min_n, self.ngram_min) - 1, -1):
            token = self._followers.get(tuple(tail[-n:]))
            if token is not None:
                return token
        return None

    def lookup(self, committed: list[int], k: int) -> list[int]:
        return self.match(committed, k)[1]

    def match(self, committed: list[int], k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens): the longest suffix of n tokens (ngram_max..ngram_min) that occurred
        before, and what followed its latest earlier occurrence; (0, []) when none did."""
        n_tokens = len(committed)
        for n in range(min(self.ngram_max, n_tokens - 1), self.ngram_min - 1, -1):
            pattern = committed[-n:]
            for start in range(n_tokens - n - 1, -1, -1):
                if committed[start : start + n] == pattern:
                    return n, committed[start + n : start + n + k]
        return 0, []

    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal:
        return self.proposal(self.lookup(committed, k))

    def proposal(self, tokens: list[int]) -> Proposal:
        tokens = [t for t in tokens if t < self.target_vocab]
        q = torch.zeros(len(tokens), self.target_vocab, device=self.target_device)
        if tokens:
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Proposal(tokens, q, 0, self.kind)

    def commit(self, committed: list[int], features: torch.Tensor | None = None) -> None:
        pass

    def caches(self) -> list[DraftCache]:
        return []

    def drain_forward_ms(self) -> list[float]:
        return []

    def close(self) -> None:
        pass

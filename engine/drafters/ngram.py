"""The n-gram drafter (prompt lookup): copy what followed the latest earlier match of the context's end."""
from __future__ import annotations

import torch

from engine.config import DrafterKind
from engine.drafters.base import DraftCache, DraftSteps, Proposal, no_steps


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from ngram_max down
    to ngram_min) and propose what followed it. q_draft is one-hot, so accept-probability is p(x).
    Costs no model forward."""

    kind = DrafterKind.NGRAM
    needs_features = False
    feature_layers = ()

    def __init__(self, ngram_max: int, ngram_min: int, target_vocab: int, target_device: torch.device) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.target_vocab, self.target_device = target_vocab, target_device
        self._tokens: list[int] = []                   # the tokens indexed so far
        self._after: dict[tuple[int, ...], int] = {}   # n-gram -> position of the token after its latest occurrence

    def prefill(self, prompt: list[int], features: torch.Tensor | None = None) -> None:
        self._tokens, self._after = [], {}

    def index(self, committed: list[int]) -> None:
        """Bring the index up to date with `committed`: in a run it only grows, so each token is read
        once; any other sequence starts the index again."""
        seen = len(self._tokens)
        if committed[:seen] != self._tokens:
            self._tokens, self._after, seen = [], {}, 0
        self._tokens.extend(committed[seen:])
        for i in range(max(seen, 1), len(committed)):
            for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                self._after[tuple(committed[i - n:i])] = i

    def _find(self, tail: list[int], min_n: int) -> tuple[int, int]:
        """(n, position): the longest suffix of `tail`, n tokens (ngram_max..min_n), that occurred in the
        indexed tokens, and where the token after its latest occurrence sits; (0, 0) when none did."""
        for n in range(min(self.ngram_max, len(tail)), max(min_n, self.ngram_min) - 1, -1):
            at = self._after.get(tuple(tail[-n:]))
            if at is not None:
                return n, at
        return 0, 0

    def follower(self, tail: list[int], min_n: int) -> int | None:
        """The token that followed the latest occurrence of `tail`'s longest suffix (at least min_n
        tokens) in the indexed tokens: `tail` may run past them (a tree node's path)."""
        n, at = self._find(tail, min_n)
        return self._tokens[at] if n else None

    def match(self, committed: list[int], k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens): the longest suffix of n tokens (ngram_max..ngram_min) that occurred
        before, and what followed its latest earlier occurrence; (0, []) when none did."""
        self.index(committed)
        n, at = self._find(committed, self.ngram_min)
        return (n, self._tokens[at:at + k]) if n else (0, [])

    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal:
        return self.proposal(self.match(committed, k)[1])

    def propose_steps(self, committed: list[int], k: int, limit: int | None = None) -> DraftSteps:
        return no_steps(self.propose(committed, k, limit))

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

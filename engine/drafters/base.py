"""The drafter interface: a proposal of K tokens with the q_draft rows they were drawn from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.config import DrafterKind
from engine.kv_cache import PagedCache

if TYPE_CHECKING:
    from engine.tree import DraftTree


@dataclass(frozen=True, slots=True)
class Proposal:
    """A round's drafts: the ids, the distributions they were drawn from, and who proposed them."""

    tokens: list[int]        # up to k drafted ids (an n-gram drafter may find fewer, even none)
    q_draft: torch.Tensor    # [len(tokens), V_target] float32 on the target's device
    forwards: int            # draft-model forwards spent
    source: DrafterKind      # the drafter that proposed them (a hybrid's copy is NGRAM)


class Drafter(Protocol):
    """What the speculative loop asks of a drafter. Between rounds a drafter's own state (a cache, its
    features) describes the committed tokens but the last, like the target's cache.

    `features` are the target's post-norm features of the rows of the forward that just ran (the
    prompt's, at prefill; the verify forward's, at commit: row 0 is the previous last token, row i the
    i-th draft), passed only to drafters whose `needs_features` is True; a drafter with
    `feature_layers` is given the residual stream entering those layers instead, side by side."""

    kind: DrafterKind
    needs_features: bool   # whether prefill and commit must be given the target's features
    feature_layers: tuple[int, ...]   # () = the post-norm features; else the layers whose inputs it reads

    def prefill(self, prompt: list[int], features: torch.Tensor | None) -> None: ...
    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal: ...
    def commit(self, committed: list[int], features: torch.Tensor | None) -> None: ...
    def caches(self) -> list[DraftCache]: ...
    def drain_forward_ms(self) -> list[float]: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TreeProposal:
    """A round's draft tree (engine.tree.DraftTree), the draft forwards it took, and who drafted it."""

    tree: "DraftTree"
    forwards: int
    source: DrafterKind


@dataclass(frozen=True, slots=True)
class DraftCache:
    """A paged cache a drafter keeps (shown in the KV view), with the weights that write it."""

    name: str            # "draft", "eagle"
    cache: PagedCache
    device: str
    weight_bytes: int


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

"""The drafter interface: a proposal of K tokens with the q_draft rows they were drawn from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import DrafterKind


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]        # up to k drafted ids (an n-gram drafter may find fewer, even none)
    q_draft: torch.Tensor    # [len(tokens), V_target] float32 on the target's device
    forwards: int            # draft-model forwards spent


class Drafter(Protocol):
    kind: DrafterKind

    def prefill(self, prompt: list[int]) -> None: ...
    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal: ...
    def commit(self, committed: list[int]) -> None: ...
    def close(self) -> None: ...


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

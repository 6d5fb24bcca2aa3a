"""The hybrid drafter: prompt lookup when the context repeats, a model drafter (the draft model, or the
EAGLE head) otherwise; in a tree, both at once."""
from __future__ import annotations

import torch

from engine.config import DrafterKind, TreeSpec
from engine.drafters.base import DraftCache, Drafter, DraftSteps, Proposal, TreeProposal, drive, no_steps
from engine.drafters.ngram import NgramDrafter
from engine.tree import DraftTree, Weigh


class HybridDrafter:
    """Prompt lookup when the context repeats, the draft model otherwise.

    If the last `min_n` or more committed tokens occurred earlier, the round copies what followed
    them (up to 2K tokens: a copy costs no draft forward, so a longer guess is cheap); otherwise
    the draft model proposes K. Repetitive stretches (loops, repeated identifiers, boilerplate)
    then cost no drafting, and the model covers the rest. The model's cache catches up on the
    tokens it skipped at its next proposal, in one forward.
    """

    def __init__(self, model: Drafter, ngram: NgramDrafter, min_n: int, kind: DrafterKind = DrafterKind.HYBRID) -> None:
        self.model, self.ngram, self.min_n, self.kind = model, ngram, min_n, kind
        self.needs_features, self.feature_layers = model.needs_features, model.feature_layers

    def prefill(self, prompt: list[int], features: torch.Tensor | None = None) -> None:
        self.ngram.prefill(prompt)
        self.model.prefill(prompt, features)

    def propose(self, committed: list[int], k: int, limit: int | None = None) -> Proposal:
        """`limit`: the most tokens this round may draft (the engine's remaining budget and K bound)."""
        return drive(self.propose_steps(committed, k, limit))

    def propose_steps(self, committed: list[int], k: int, limit: int | None = None) -> DraftSteps:
        """A copy when the context repeats (no forward), else the model's steps."""
        n, copied = self.ngram.match(committed, min(2 * k, limit if limit is not None else 2 * k))
        if n >= self.min_n and copied:
            return (yield from no_steps(self.ngram.proposal(copied)))
        return (yield from self.model.propose_steps(committed, k))

    def propose_tree(self, committed: list[int], spec: TreeSpec, weigh: Weigh | None = None) -> TreeProposal:
        """The model's tree with prompt lookup merged in (engine.tree.grow): a node whose context (the
        committed tokens, then its path) ends in min_n or more tokens that occurred before gets what
        followed them as its first child."""
        self.ngram.index(committed)
        width = self.ngram.ngram_max

        def copy_at(tree: DraftTree, node: int) -> int | None:
            tail = committed[-width:] + [tree.tokens[i] for i in tree.path_to(node)[-width:]]
            return self.ngram.follower(tail[-width:], self.min_n)
        return self.model.propose_tree(committed, spec, weigh, copy_at)

    def commit(self, committed: list[int], features: torch.Tensor | None = None) -> None:
        self.model.commit(committed, features)

    def caches(self) -> list[DraftCache]:
        return self.model.caches()

    def drain_forward_ms(self) -> list[float]:
        return self.model.drain_forward_ms()

    def close(self) -> None:
        self.model.close()

"""The drafter interface, and what a round verifies: a chain of K drafts (`Proposal`), a tree of them
(`TreeProposal`), or nothing (`NO_DRAFT`).

The three share one interface, so the round (engine.speculative) never asks which it holds:
- `feed(last, past)`: the verify forward's ids and, for a tree, its positions and attention mask;
- `verify(logits, config, generator)`: the processed target rows and the verdict (the accept rule lives
  in engine.verify for chains and engine.tree for trees);
- `kept_rows(verdict)`: the fed rows (`fed_rows` of them) whose K/V and features survive (None: a prefix,
  as in a chain);
- `next_k(config, k, verdict, confidence)`: the next round's K, after the round taught what it learns.
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config import DrafterKind, SpecConfig
from engine.kv_cache import PagedCache
from engine.records import Outcome
from engine.sampling import draw_uniform, greedy_ids, logits_to_probs, one_hot_rows, sample_from
from engine.tree import Confidence, DraftTree, attention_mask, verify_tree
from engine.verify import Verdict, verify, verify_greedy


@dataclass(frozen=True, slots=True)
class Proposal:
    """A round's drafts: the ids, the distributions they were drawn from, and who proposed them."""

    tokens: list[int]        # up to k drafted ids (an n-gram drafter may find fewer, even none)
    q_draft: torch.Tensor    # [len(tokens), V_target] float32 on the target's device
    forwards: int            # draft-model forwards spent
    source: DrafterKind      # the drafter that proposed them (a hybrid's copy is NGRAM)
    tree = None              # a chain (a TreeProposal's is its DraftTree)

    @property
    def drafted(self) -> list[int]:
        return self.tokens

    def q_row(self, row: int) -> torch.Tensor | None:
        """The draft distribution that p row `row`'s tests were against: a correction there came from the
        residual of p and this."""
        return self.q_draft[row]

    @property
    def fed_rows(self) -> int:
        return len(self.tokens) + 1

    def feed(self, last: int, past: int) -> tuple[list[int], dict]:
        """[last, d1..dK]: K+1 rows at consecutive positions, causal; row K is the bonus row."""
        return [last, *self.tokens], {}

    def verify(self, logits: torch.Tensor, config: SpecConfig,
               generator: torch.Generator) -> tuple[torch.Tensor, Verdict]:
        """Greedy rounds verify from the argmaxes (`verify_greedy`, the same result as `verify` on one-hot
        rows, without the [K+1, V] work)."""
        if config.sampling.greedy:
            ids = greedy_ids(logits)
            return one_hot_rows(ids, logits.shape[1]), verify_greedy(self.tokens, ids.tolist(), logits.shape[1],
                                                                     generator)
        p_rows = logits_to_probs(logits, config.sampling)
        return p_rows, verify(self.q_draft, p_rows, self.tokens, generator, validate=False)

    def kept_rows(self, verdict: Verdict) -> list[int] | None:
        return None   # the accepted drafts are a prefix of the fed rows: a rollback keeps them

    def next_k(self, config: SpecConfig, k: int, verdict: Verdict, confidence: Confidence | None) -> int:
        """The schedule's next K (the heuristic one grows after a fully accepted round)."""
        return config.next_k(k, verdict.accepted_count == len(self.tokens))


@dataclass(frozen=True, slots=True)
class NoDraft:
    """A round that drafted nothing (the prefill, target-only, no n-gram match): one row, one token."""

    tokens: tuple[int, ...] = ()
    forwards: int = 0
    fed_rows: int = 1

    def feed(self, last: int, past: int) -> tuple[list[int], dict]:
        return [last], {}

    def verify(self, logits: torch.Tensor, config: SpecConfig,
               generator: torch.Generator) -> tuple[torch.Tensor, Verdict]:
        """The token comes from the last (bonus) row alone. Consumes one uniform, as verify does for its
        final sample."""
        greedy = config.sampling.greedy
        ids = greedy_ids(logits) if greedy else None
        p_rows = one_hot_rows(ids, logits.shape[1]) if greedy else logits_to_probs(logits, config.sampling)
        u = draw_uniform(1, generator, p_rows.device)
        token = int(ids[-1]) if greedy else int(sample_from(p_rows[-1:], u)[0])
        return p_rows, Verdict(path=[], tokens=[token], tested=[], final_token=token, final_outcome=Outcome.BONUS,
                               final_row=0, final_u=float(u[0]), residual=None)

    def kept_rows(self, verdict: Verdict) -> list[int] | None:
        return None

    def next_k(self, config: SpecConfig, k: int, verdict: Verdict, confidence: Confidence | None) -> int:
        return k


NO_DRAFT = NoDraft()


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
    def propose_steps(self, committed: list[int], k: int, limit: int | None = None) -> "DraftSteps": ...
    def commit(self, committed: list[int], features: torch.Tensor | None) -> None: ...
    def caches(self) -> list[DraftCache]: ...
    def drain_forward_ms(self) -> list[float]: ...
    def close(self) -> None: ...


class DraftStep(Protocol):
    """One draft forward a drafter's `propose_steps` asks for; `run()` runs it alone. A batch groups the steps
    of one kind and model and runs them as one forward (engine.batch.run_steps)."""

    def run(self): ...


# A chain's drafting as steps: yields DraftSteps, is sent each one's result, returns the Proposal.
DraftSteps = Generator[DraftStep, Any, Proposal]


def drive(steps: DraftSteps) -> Proposal:
    """Run a drafter's steps one at a time, each alone: what a single sequence does."""
    try:
        step = next(steps)
        while True:
            step = steps.send(step.run())
    except StopIteration as done:
        return done.value


def no_steps(proposal: Proposal) -> DraftSteps:
    """Steps that need no forward: the proposal at once (prompt lookup's copy)."""
    return proposal
    yield  # unreachable: makes this a generator


@dataclass(frozen=True, slots=True)
class TreeProposal:
    """A round's draft tree (engine.tree.DraftTree), the draft forwards it took, and who drafted it."""

    tree: DraftTree
    forwards: int
    source: DrafterKind

    @property
    def drafted(self) -> list[int]:
        return self.tree.tokens[1:]

    def q_row(self, row: int) -> torch.Tensor | None:
        """Node `row`'s children were drawn from this (None: a node the draft never expanded)."""
        return self.tree.q_rows.get(row)

    @property
    def fed_rows(self) -> int:
        return len(self.tree.tokens)

    def feed(self, last: int, past: int) -> tuple[list[int], dict]:
        """One row per node, the root (`last`, at position `past`) first: a node at depth d sits at past + d
        and attends to the committed text and its own ancestors."""
        tree = self.tree
        return tree.tokens, {"positions": [past + d for d in tree.depths], "attn_mask": attention_mask(tree, past)}

    def verify(self, logits: torch.Tensor, config: SpecConfig,
               generator: torch.Generator) -> tuple[torch.Tensor, Verdict]:
        greedy = config.sampling.greedy
        p_rows = one_hot_rows(greedy_ids(logits), logits.shape[1]) if greedy else \
            logits_to_probs(logits, config.sampling)
        return p_rows, verify_tree(self.tree, p_rows, generator, greedy)

    def kept_rows(self, verdict: Verdict) -> list[int] | None:
        return [0, *verdict.path]   # the root and the accepted path, moved next to each other

    def next_k(self, config: SpecConfig, k: int, verdict: Verdict, confidence: Confidence | None) -> int:
        """A tree's size is its spec's; what the round teaches is how much its children's q was worth."""
        if confidence is not None:
            confidence.observe(self.tree, verdict)
        return k


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

"""Typed records that flow from the engine to traces and renderers: the outcome labels, one record per
round, one per run.

Every label the UI shows (accepted, rejected, unchecked, corrected, bonus, pending) is an `Outcome`;
every mode and drafter a `Mode` or `DrafterKind`. Renderers compare these values, never strings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.config import DrafterKind, Mode


class Outcome(str, Enum):
    """The one home of the per-token labels shared by engine, traces and UI."""

    ACCEPTED = "accepted"      # a draft that passed u < min(1, p/q)
    REJECTED = "rejected"      # the draft that failed it (at most one per round)
    UNCHECKED = "unchecked"    # a draft after the rejection: never verified, neither accepted nor rejected
    CORRECTED = "corrected"    # the final token drawn from the residual max(0, p - q) at the rejection
    BONUS = "bonus"            # the final token drawn from row K after every draft was accepted
    PENDING = "pending"        # drafted, verification not yet revealed (a UI state, never recorded)

    @property
    def verified(self) -> bool:
        """Whether the accept test ran at this draft position."""
        return self in (Outcome.ACCEPTED, Outcome.REJECTED)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One token's probability under the target and the draft at one position (for the p/q bars)."""

    token: int
    text: str
    p_target: float
    q_draft: float
    residual: float | None = None  # normalised max(0, p - q), only at a rejection
    pending: str = ""              # hex of the bytes it leaves unfinished (see engine.text)


@dataclass(frozen=True, slots=True)
class PositionRecord:
    """A drafted token and what verification made of it. p_target, alpha and u are None when UNCHECKED."""

    index: int
    token: int
    text: str
    q_draft: float
    p_target: float | None
    alpha: float | None
    u: float | None
    outcome: Outcome
    candidates: list[Candidate] = field(default_factory=list)
    pending: str = ""   # hex of the bytes of a character this token starts and a later one completes

    @property
    def verified(self) -> bool:
        return self.outcome.verified


@dataclass(frozen=True, slots=True)
class FinalRecord:
    """The token every round ends with: a correction drawn from the residual, or the bonus from row K."""

    token: int
    text: str
    outcome: Outcome  # CORRECTED or BONUS
    row: int          # the p_target row it was drawn from
    u: float
    p_target: float
    candidates: list[Candidate] = field(default_factory=list)
    pending: str = ""


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One drafted node of a tree round and what verification made of it."""

    index: int                 # 1..N (0 is the root, the last committed token)
    parent: int
    depth: int
    token: int
    text: str
    score: float               # its path's estimated chance of acceptance (cumulative q, or calibrated)
    q_draft: float             # q of its token in the row it was drawn from (renormalised without earlier
                               # siblings; 1 for a copy)
    p_target: float | None     # the target's (residual-updated) p of its token when tested; None if never tested
    alpha: float | None
    u: float | None
    outcome: Outcome           # ACCEPTED (on the path), REJECTED (tested), UNCHECKED (never reached)
    candidates: list[Candidate] = field(default_factory=list)   # p and q at its parent, for the bars
    pending: str = ""
    copied: bool = False       # proposed by prompt lookup (a hybrid drafter's tree), not the model


@dataclass(frozen=True, slots=True)
class TreeRecord:
    """A tree round: its shape, every node, and the accepted path."""

    shape: str                 # TreeSpec.label(): "4-2-2-1" or "N16d4"
    nodes: list[TreeNode]
    path: list[int]            # accepted node indices, root's child first
    final_parent: int          # the node the final token hangs under (0: the root)

    @property
    def depths_verified(self) -> int:
        """Depths whose children were tested: the path, plus the depth where it stopped (unless a leaf)."""
        leaf = not any(n.parent == self.final_parent for n in self.nodes)
        return len(self.path) + (0 if leaf else 1)


@dataclass(frozen=True, slots=True)
class KVState:
    """One model's paged cache after a round, and what the round did to it."""

    model: str                 # "target", "draft" or "eagle": whose cache
    device: str
    dtype: str
    block_size: int
    num_blocks: int
    block_table: list[int]
    length: int                # cached tokens after the round
    prompt_len: int            # the first prompt_len cached tokens are the prompt
    written: list[int]         # physical slots written this round (kept or rolled back)
    rolled_back: list[int]     # physical slots rolled back this round
    blocks_allocated: list[int]
    blocks_freed: list[int]
    pool_bytes: int
    moved: list[int] = field(default_factory=list)   # slots that received a kept tree node's K/V this round


@dataclass(frozen=True, slots=True)
class RoundTimings:
    """Where one round's time went, ms, from the engine's own clock.

    target_forward_ms is the round's one target forward alone (the prefill in round 0, the verify
    forward after), and draft_forward_ms each draft-model forward: c and r are read from these.
    """

    prefill_ms: float
    draft_ms: float
    verify_ms: float
    commit_ms: float   # v1's commit forward, or v2's rollbacks
    other_ms: float    # sampling, records, Python overhead
    total_ms: float
    target_forward_ms: float = 0.0
    draft_forward_ms: list[float] = field(default_factory=list)
    commit_forward_ms: float = 0.0     # v1's second target forward (0 in v2 and target-only rounds)


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """Everything needed to redraw one round without the models."""

    index: int
    mode: Mode
    drafter: DrafterKind | None  # the configured drafter; None for target-only runs
    proposer: DrafterKind | None  # who proposed this round's drafts (a hybrid copies or asks its model); None: no drafts
    k: int                       # tokens drafted this round (0 for target-only steps and the prefill)
    positions: list[PositionRecord]
    final: FinalRecord
    emitted: list[int]           # accepted drafts + the final token (cut at EOS / max_new_tokens)
    emitted_text: str
    accepted: int
    kv: list[KVState]
    timings: RoundTimings
    target_forwards: int
    draft_forwards: int
    tokens_total: int            # generated tokens after this round
    elapsed_s: float             # time spent decoding so far (prefill included, idle time between steps not)
    finished: bool
    tree: TreeRecord | None = None   # a tree round: k counts its nodes, positions is empty

    @property
    def verified(self) -> int:
        """Positions whose accept test ran: accepted + 1 at a rejection, K after a full accept. A tree
        round counts depths: the accepted path, plus the depth where it stopped."""
        if self.tree is not None:
            return self.tree.depths_verified
        return sum(p.verified for p in self.positions)

    @property
    def depth(self) -> int:
        """The most positions the round could verify: K for a chain, the deepest node for a tree."""
        if self.tree is not None:
            return max((n.depth for n in self.tree.nodes), default=0)
        return self.k

    def checks(self) -> list[bool]:
        """The accept results in order, position by position (a tree: depth by depth): accepted ones,
        then a False where the round stopped at a rejection."""
        if self.tree is not None:
            return [True] * len(self.tree.path) + [False] * (self.tree.depths_verified - len(self.tree.path))
        return [p.outcome is Outcome.ACCEPTED for p in self.positions if p.verified]

    @property
    def is_prefill(self) -> bool:
        """Round 0 runs the prompt's forward; its timings are not a decode step's."""
        return self.index == 0


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Run-level metrics computed from the rounds (exact token counts, measured times).

    Two acceptance measures, each under its own name: draft_acceptance_rate = accepted / drafted (what
    vLLM and the seed system report), and alpha = accepted / verified positions, the per-position
    acceptance probability that Leviathan et al.'s E(alpha, K) is defined on.
    """

    mode: Mode
    drafter: DrafterKind | None
    rounds: int
    tokens: int
    drafted: int
    verified: int
    accepted: int
    draft_acceptance_rate: float
    alpha: float
    mean_accepted_length: float
    per_position_acceptance: list[float]
    target_forwards: int
    draft_forwards: int
    target_forwards_per_token: float
    ttft_ms: float
    tpot_ms: float
    tokens_per_s: float
    elapsed_s: float
    weight_bytes: dict[str, int]   # per device
    kv_bytes: dict[str, int]       # per device

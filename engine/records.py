"""Typed records that flow from the engine to traces and renderers: one per round, one per run."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.verify import Outcome


@dataclass(frozen=True, slots=True)
class Candidate:
    """One token's probability under the target and the draft at one position (for the p/q bars)."""

    token: int
    text: str
    p_target: float
    q_draft: float
    residual: float | None = None  # normalised max(0, p - q), only at a rejection


@dataclass(frozen=True, slots=True)
class PositionRecord:
    """A drafted token and what verification made of it. Unchecked drafts follow a rejection."""

    index: int
    token: int
    text: str
    q_draft: float
    p_target: float | None
    alpha: float | None
    u: float | None
    outcome: Outcome
    checked: bool
    candidates: list[Candidate] = field(default_factory=list)


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


@dataclass(frozen=True, slots=True)
class KVState:
    """One model's paged cache after a round, and what the round did to it."""

    model: str                 # "target" or "draft"
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


@dataclass(frozen=True, slots=True)
class RoundTimings:
    prefill_ms: float
    draft_ms: float
    verify_ms: float
    commit_ms: float   # v1's commit forward, or v2's rollbacks
    other_ms: float    # sampling, records, Python overhead
    total_ms: float


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """Everything needed to redraw one round without the models."""

    index: int
    mode: str
    drafter: str
    k: int                       # tokens drafted this round (0 for target-only steps)
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


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Run-level metrics computed from the rounds (exact token counts, measured times)."""

    mode: str
    drafter: str
    rounds: int
    tokens: int
    drafted: int
    accepted: int
    acceptance_rate: float
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


def summarize(rounds: list[RoundRecord], weight_bytes: dict[str, int], kv_bytes: dict[str, int]) -> RunSummary:
    from engine import metrics

    if not rounds:
        raise ValueError("no rounds to summarise")
    tokens = rounds[-1].tokens_total
    drafted = sum(r.k for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    elapsed = rounds[-1].elapsed_s
    ttft = rounds[0].elapsed_s * 1000
    k_max = max((r.k for r in rounds), default=0)
    checks = [[p.outcome is Outcome.ACCEPTED for p in r.positions if p.checked] for r in rounds if r.k]
    return RunSummary(
        mode=rounds[0].mode, drafter=rounds[0].drafter, rounds=len(rounds), tokens=tokens,
        drafted=drafted, accepted=accepted,
        acceptance_rate=metrics.acceptance_rate(accepted, drafted),
        mean_accepted_length=metrics.mean_accepted_length([len(r.emitted) for r in rounds]),
        per_position_acceptance=metrics.per_position_acceptance(checks, k_max) if k_max else [],
        target_forwards=sum(r.target_forwards for r in rounds),
        draft_forwards=sum(r.draft_forwards for r in rounds),
        target_forwards_per_token=sum(r.target_forwards for r in rounds) / max(tokens, 1),
        ttft_ms=ttft,
        tpot_ms=(elapsed * 1000 - ttft) / (tokens - 1) if tokens > 1 else 0.0,
        tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
        elapsed_s=elapsed, weight_bytes=weight_bytes, kv_bytes=kv_bytes)

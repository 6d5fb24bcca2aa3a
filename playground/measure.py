"""Measurements read off a run's records: acceptance, the draft/target cost ratio c, speed-ups.

Nothing here is estimated from a model of the hardware: c comes from this run's own draft and
target timings, and the baseline's times are the target-only run actually decoded beside it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from engine import metrics
from engine.config import DrafterKind
from engine.records import RoundRecord
from engine.verify import Outcome
from playground.view import RunView


@dataclass(frozen=True, slots=True)
class CostRatio:
    """c = (one draft forward) / (one target decode step), both measured in this run."""

    c: float
    draft_forward_ms: float | None   # None for the n-gram drafter: it runs no forwards
    target_step_ms: float


def drafted_rounds(rounds: tuple[RoundRecord, ...] | list[RoundRecord]) -> list[RoundRecord]:
    return [r for r in rounds if r.k > 0]


def acceptance(rounds: tuple[RoundRecord, ...] | list[RoundRecord]) -> float | None:
    """Accepted / drafted over the rounds; None when nothing was drafted."""
    drafted = sum(r.k for r in rounds)
    return metrics.acceptance_rate(sum(r.accepted for r in rounds), drafted) if drafted else None


def per_position(rounds: tuple[RoundRecord, ...] | list[RoundRecord]) -> list[float]:
    """Acceptance rate at draft positions 1..K_max (NaN where no round checked that position)."""
    drafted = drafted_rounds(rounds)
    if not drafted:
        return []
    checks = [[p.outcome is Outcome.ACCEPTED for p in r.positions if p.checked] for r in drafted]
    return metrics.per_position_acceptance(checks, max(r.k for r in drafted))


def cost_ratio(view: RunView) -> CostRatio | None:
    """c from this run: the median round's ms per draft forward over the median ms of one baseline
    decode step (medians, so a first call's warm-up does not dominate a short run). None until
    both streams have timed at least one step."""
    steps = [b.timings.verify_ms for b in view.baseline if b.index > 0]  # round 0's forward is the prefill
    if not steps:
        return None
    target_ms = statistics.median(steps)
    if target_ms <= 0:
        return None
    per_forward = [r.timings.draft_ms / r.draft_forwards for r in view.rounds if r.draft_forwards]
    if view.info.config.drafter is DrafterKind.NGRAM or not per_forward:
        return CostRatio(0.0, None, target_ms) if drafted_rounds(view.rounds) else None
    draft_ms = statistics.median(per_forward)
    return CostRatio(draft_ms / target_ms, draft_ms, target_ms)


def mean_k(rounds: tuple[RoundRecord, ...] | list[RoundRecord]) -> int | None:
    drafted = drafted_rounds(rounds)
    return max(1, round(sum(r.k for r in drafted) / len(drafted))) if drafted else None


def predicted_speedup(view: RunView) -> float | None:
    """Leviathan et al.'s E[tokens per round] / (cK + 1) with the measured α, c and mean K."""
    alpha, ratio, k = acceptance(view.rounds), cost_ratio(view), mean_k(view.rounds)
    if alpha is None or ratio is None or k is None:
        return None
    return metrics.predicted_speedup(alpha, k, ratio.c)


def tokens_per_s(rounds: tuple[RoundRecord, ...] | list[RoundRecord]) -> float | None:
    """Generated tokens over decode time (prefill included) after the last of `rounds`."""
    if not rounds or rounds[-1].elapsed_s <= 0:
        return None
    return rounds[-1].tokens_total / rounds[-1].elapsed_s


def measured_speedup(view: RunView) -> float | None:
    """Speculative over target-only throughput, the baseline measured up to the speculative run's
    token count (a time ratio at equal tokens; a sampled baseline may stop early at its own EOS)."""
    spec, base = tokens_per_s(view.rounds), tokens_per_s(view.baseline)
    return None if spec is None or base is None or base <= 0 else spec / base


def speedup_series(view: RunView) -> tuple[list[int], list[float | None], list[float | None]]:
    """(round numbers, measured, predicted) after each round, from the records up to that round."""
    xs, measured, predicted = [], [], []
    for n in range(1, len(view.rounds) + 1):
        sub = view.upto(n)
        xs.append(n)
        measured.append(measured_speedup(sub))
        predicted.append(predicted_speedup(sub))
    return xs, measured, predicted


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)

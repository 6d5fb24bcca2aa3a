"""Metrics: the standard speculative-decoding measures and the Leviathan et al. speed-up model.

Pure functions on plain numbers. Notation: alpha is the per-token acceptance rate (assumed
i.i.d. across positions), K the number of drafted tokens per round, c the cost of one draft
forward relative to one target forward, r the cost of the target's verify forward over K+1
positions relative to one ordinary target decode step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def acceptance_rate(accepted: int, drafted: int) -> float:
    """Fraction of drafted tokens the target accepted; 0.0 when nothing was drafted."""
    if drafted < 0 or accepted < 0 or accepted > drafted:
        raise ValueError(f"need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
    return accepted / drafted if drafted else 0.0


def mean_accepted_length(tokens_per_round: Sequence[int]) -> float:
    """Mean tokens emitted per round, counting the correction or bonus (so >= 1 for real rounds).

    This is the "tau" / mean accepted length of the literature; 0.0 for no rounds.
    """
    if any(n < 0 for n in tokens_per_round):
        raise ValueError(f"tokens per round must be >= 0, got {list(tokens_per_round)}")
    return sum(tokens_per_round) / len(tokens_per_round) if tokens_per_round else 0.0


def per_position_acceptance(rounds: Sequence[Sequence[bool]], k_max: int) -> list[float]:
    """Acceptance rate at each draft position 0..k_max-1.

    rounds: per round, the accept results of the positions that were checked, in order (a round
    stops at its first rejection, so a False can only be last). Position i's rate counts only
    rounds that checked position i: a position never reached after an earlier rejection is
    neither an accept nor a reject there. A position no round checked gets NaN (unknown), not 0.
    """
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    for n, checks in enumerate(rounds):
        if len(checks) > k_max:
            raise ValueError(f"round {n} checked {len(checks)} positions, more than k_max={k_max}")
        if not all(checks[:-1]):
            raise ValueError(f"round {n} checks positions after a rejection: {list(checks)}")
    rates = []
    for i in range(k_max):
        outcomes = [bool(checks[i]) for checks in rounds if len(checks) > i]
        rates.append(sum(outcomes) / len(outcomes) if outcomes else math.nan)
    return rates


def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[tokens per round] = (1 - alpha^(K+1)) / (1 - alpha); K+1 in the limit alpha -> 1.

    Position i (0-based) is reached with probability alpha^i and every round emits one final
    token, so E = sum_{i=0..K} alpha^i. Summing the series directly equals the closed form and
    stays exact at alpha = 1 and numerically stable near it.
    """
    _check_alpha_k(alpha, k)
    return math.fsum(alpha**i for i in range(k + 1))


def predicted_speedup(alpha: float, k: int, c: float, r: float = 1.0) -> float:
    """Walltime speed-up over target-only decoding: E / (c*K + r) (Leviathan et al. 2023).

    One round costs K draft forwards (c each) plus one verify forward (r) and yields E tokens;
    plain decoding pays 1 per token.
    """
    _check_alpha_k(alpha, k)
    if not (math.isfinite(c) and c >= 0):
        raise ValueError(f"c (draft/target cost ratio) must be finite and >= 0, got {c}")
    if not (math.isfinite(r) and r > 0):
        raise ValueError(f"r (verify cost relative to one target forward) must be finite and > 0, got {r}")
    return expected_tokens_per_round(alpha, k) / (c * k + r)


def best_k(alpha: float, c: float, r_of_k: Callable[[int], float] | float = 1.0, k_max: int = 16) -> int:
    """The K in 1..k_max with the highest predicted speed-up (the smallest K on ties).

    r_of_k: the verify cost, constant or as a function of K (verifying more positions can cost
    more once the target leaves the memory-bound regime).
    """
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an int >= 1, got {k_max!r}")
    r_at = r_of_k if callable(r_of_k) else (lambda _k: r_of_k)
    speedups = [predicted_speedup(alpha, k, c, r_at(k)) for k in range(1, k_max + 1)]
    return 1 + speedups.index(max(speedups))

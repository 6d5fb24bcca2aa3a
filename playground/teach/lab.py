"""The Losslessness lab's experiment: re-verify a real round N times with fresh draws, under the correct
rule or a deliberately wrong one, and test the emitted tokens against p_target.

The round's full-vocabulary rows come from playground.teach.lesson.round_rows (its forwards re-run on
fresh caches); the Monte-Carlo is playground.teach.losslessness's, the chi-square test engine.stats'.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.stats import FitResult, goodness_of_fit
from playground.teach.lesson import RoundRows, RuleOutput, best_window, rule_output, window
from playground.teach.losslessness import MIN_SAMPLES, Rule, simulate

ALPHA_LEVEL = 1e-3     # each index's test rejects "counts ~ p_target" below this p-value
DEFAULT_TRIALS = 10_000
MAX_TRIALS = 1_000_000
TOP_TOKENS = 8         # per source: the most likely tokens under p_target, the rule and the sample


@dataclass(frozen=True, slots=True)
class LabResult:
    """N re-verifications of drafts start..start+length-1 of one round under one rule."""

    round: int
    rule: Rule
    trials: int
    seed: int
    start: int
    length: int
    counts: Tensor           # [length+1, V] long: emitted token counts per output index
    p_target: Tensor         # [length+1, V]: the distribution each index must follow
    limit: RuleOutput        # what this rule converges to (exactly), per index
    fits: tuple[FitResult, ...]

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.fits)

    def worst_index(self) -> int:
        """The tested index with the smallest p-value (the one to plot)."""
        return min(self.fits, key=lambda f: (f.p_value, f.index)).index if self.fits else 0


def run_lab(rows: RoundRows, rule: Rule | str, trials: int, seed: int,
            start: int | None = None, length: int | None = None) -> LabResult:
    """Simulate `trials` rounds on the fixed rows (playground.teach.losslessness.simulate) and test every
    output index with at least MIN_SAMPLES tokens against p_target. start/length None: the window
    where the wrong rules show most (playground.teach.lesson.best_window)."""
    if not 1 <= trials <= MAX_TRIALS:
        raise ValueError(f"N must be between 1 and {MAX_TRIALS:,}, got {trials}")
    if start is None or length is None:
        start, length = best_window(rows)
    q, p = window(rows, start, length)
    rule = Rule(rule)
    counts = simulate(q, p, rule, trials, torch.Generator().manual_seed(seed))
    fits = tuple(goodness_of_fit(counts[i], p[i], alpha_level=ALPHA_LEVEL, index=i)
                 for i in range(counts.shape[0]) if int(counts[i].sum()) >= MIN_SAMPLES)
    return LabResult(rows.round, rule, trials, seed, start, length, counts, p.double(), rule_output(q, p, rule), fits)


def top_tokens(result: LabResult, index: int) -> list[int]:
    p, limit = result.p_target[index], result.limit.dist[index]
    n = result.counts[index].double()
    empirical = n / n.sum().clamp(min=1)
    ids: list[int] = []
    for row in (p, limit, empirical):
        ids += [t for t in torch.topk(row, min(TOP_TOKENS, row.numel())).indices.tolist() if t not in ids]
    return sorted(ids, key=lambda t: -float(p[t]))


def token_texts(result: LabResult, decode: Callable[[int], str]) -> dict[int, str]:
    """Texts of every token any index's plot shows (so replotting needs no tokenizer)."""
    ids = {t for i in range(result.counts.shape[0]) for t in top_tokens(result, i)}
    return {t: decode(t) for t in sorted(ids)}

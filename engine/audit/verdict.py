"""What an audit's samples say: chi-square tests of the first m tokens (the joint of tokens 1..d for each d)
against the exact distribution or against a reference server's samples, the cells that differ most, and the
smallest deviation the sample could have shown (90% power at the test's level)."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.audit.exact import ExactJoint
from engine.stats import MIN_EXPECTED, FitResult, detectable_noncentrality, goodness_of_fit, homogeneity

POWER = 0.9
Key = tuple[int, ...] | str     # a completion's token ids, or its text where the server gave no ids


@dataclass(frozen=True, slots=True)
class Cell:
    """One outcome: how often the server produced it, and how often it should have (the exact probability
    times N, or the reference's count scaled to N)."""

    label: str
    observed: int
    expected: float
    basis: float | None = None   # the count the test expected, where it is not `expected` (two samples: pooled)

    @property
    def deviation(self) -> float:
        """(observed - basis) / sqrt(max(basis, MIN_EXPECTED)): the chi-square's residual, floored where the test
        pools rare outcomes (one sighting of a rare one is no news); inf for an outcome the model never samples."""
        basis = self.expected if self.basis is None else self.basis
        if basis <= 0:
            return math.inf if self.observed else 0.0
        return (self.observed - basis) / math.sqrt(max(basis, MIN_EXPECTED))


@dataclass(frozen=True, slots=True)
class DepthTest:
    depth: int        # tokens 1..depth tested jointly
    fit: FitResult


@dataclass(frozen=True, slots=True)
class Power:
    """The deviation N samples detect with 90% probability at the test's level: Cohen's w, and as probability
    moved between the two likeliest outcomes (percentage points)."""

    dof: int
    noncentrality: float
    w: float
    moved_pp: float


@dataclass(frozen=True, slots=True)
class Analysis:
    against: str                    # "exact" or "reference"
    n: int                          # completions tested (the server's)
    reference_n: int                # the reference's (0 against the exact distribution)
    level: float                    # the verdict's significance level, shared by the depths (Bonferroni)
    tests: tuple[DepthTest, ...]
    cells: tuple[Cell, ...]         # every outcome seen or expected, likeliest first
    outside: int                    # completions the exact distribution gives probability 0
    power: Power | None

    @property
    def p_value(self) -> float:
        """The smallest depth's p-value, Bonferroni-adjusted for the depths tested."""
        return min(1.0, min(t.fit.p_value for t in self.tests) * len(self.tests))

    @property
    def passed(self) -> bool:
        return self.p_value >= self.level

    def most_different(self, count: int = 5) -> list[Cell]:
        return sorted(self.cells, key=lambda c: -abs(c.deviation))[:count]


TAIL = "(the rest: each less likely than the enumeration's floor)"


def against_exact(keys: Sequence[Key], joint: ExactJoint, label: Callable[[tuple[int, ...]], str],
                  level: float = 1e-3) -> Analysis:
    """The server's completions (token ids, or texts) against the exact distribution. With ids, each depth
    d = 1..m is tested on the first d tokens: the enumerated prefixes, one tail cell, and, as cells of
    probability 0, any prefix the model never samples with these settings (computed for each such sequence
    seen). Texts are matched to the enumerated sequences that decode to them, and only the whole m tokens are
    tested (a text matching none falls in the tail)."""
    n = len(keys)
    if n == 0:
        raise ValueError("no completions to test")
    by_text = any(isinstance(k, str) for k in keys)
    depths = [joint.m] if by_text else list(range(1, joint.m + 1))
    unexplained = sorted({k for k in keys if not by_text and k not in joint.levels[-1]})
    own = joint.probability(unexplained) if unexplained else {}
    tests, cells, outside = [], [], 0
    for depth in depths:
        law = _text_law(joint, label) if by_text else dict(joint.levels[depth - 1])
        tail = max(0.0, 1.0 - sum(law.values()))
        impossible = set()
        seen: Counter = Counter()
        for k in keys:
            key = k if by_text else k[:depth]
            if key not in law:
                zero = not by_text and own[k][min(depth, len(k)) - 1] == 0.0
                if zero:
                    impossible.add(key)
                key = key if zero else TAIL
            seen[key] += 1
        known = list(law) + [TAIL]
        law[TAIL] = tail
        strange = sorted(impossible, key=str)
        counts = torch.tensor([seen.get(k, 0) for k in known] + [seen[k] for k in strange], dtype=torch.float64)
        probs = torch.tensor([law[k] for k in known] + [0.0] * len(strange), dtype=torch.float64)
        tests.append(DepthTest(depth, goodness_of_fit(counts, probs, alpha_level=level, index=depth)))
        if depth == depths[-1]:
            outside = sum(seen[k] for k in strange)
            named = (lambda k: k if isinstance(k, str) else label(k))
            cells = [Cell(named(k), seen.get(k, 0), law[k] * n) for k in known if law[k] > 0 or seen.get(k, 0)]
            cells += [Cell(named(k), seen[k], 0.0) for k in strange]
    cells.sort(key=lambda c: -max(c.expected, c.observed))
    final = tests[-1].fit
    top_two = [c.expected / n for c in cells if c.label != TAIL][:2]
    return Analysis("exact", n, 0, level, tuple(tests), tuple(cells), outside,
                    _power(final.dof, level / len(tests), n, top_two))


def against_reference(keys: Sequence[Key], reference: Sequence[Key], label: Callable[[Key], str],
                      level: float = 1e-3) -> Analysis:
    """The server's completions against a reference's (the same model without speculation): a homogeneity
    test at each depth (the whole texts only, when a side gave no token ids)."""
    if not keys or not reference:
        raise ValueError("both servers need completions to compare")
    by_text = any(isinstance(k, str) for k in list(keys) + list(reference))
    if by_text:
        keys = [k if isinstance(k, str) else label(k) for k in keys]
        reference = [k if isinstance(k, str) else label(k) for k in reference]
    m = 1 if by_text else max(len(k) for k in list(keys) + list(reference))
    depths = [m] if by_text else list(range(1, m + 1))
    n, n_ref = len(keys), len(reference)
    tests, cells = [], []
    for depth in depths:
        seen = Counter(k if by_text else k[:depth] for k in keys)
        ref = Counter(k if by_text else k[:depth] for k in reference)
        outcomes = sorted(set(seen) | set(ref), key=lambda k: -(seen.get(k, 0) + ref.get(k, 0)))
        a = torch.tensor([seen.get(k, 0) for k in outcomes], dtype=torch.float64)
        b = torch.tensor([ref.get(k, 0) for k in outcomes], dtype=torch.float64)
        fit = homogeneity(a, b, alpha_level=level)
        tests.append(DepthTest(depth, FitResult(fit.statistic, fit.dof, fit.p_value, fit.n, level, depth)))
        if depth == depths[-1]:
            cells = [Cell(k if by_text else label(k), seen.get(k, 0), ref.get(k, 0) * n / n_ref,
                          (seen.get(k, 0) + ref.get(k, 0)) * n / (n + n_ref)) for k in outcomes]
    effective = n * n_ref / (n + n_ref)
    shares = [(c.observed + c.expected * n_ref / n) / (n + n_ref) for c in cells[:2]]
    return Analysis("reference", n, n_ref, level, tuple(tests), tuple(cells), 0,
                    _power(tests[-1].fit.dof, level / len(tests), effective, shares))


def _text_law(joint: ExactJoint, label: Callable[[tuple[int, ...]], str]) -> dict[str, float]:
    law: dict[str, float] = {}
    for seq, p in joint.levels[-1].items():
        text = label(seq)
        law[text] = law.get(text, 0.0) + p
    return law


def _power(dof: int, level: float, n: float, top_two: list[float]) -> Power | None:
    if dof < 1 or n <= 0:
        return None
    lam = detectable_noncentrality(dof, level, POWER)
    w = math.sqrt(lam / n)
    moved = math.sqrt(lam / (n * sum(1 / p for p in top_two))) * 100 if len(top_two) == 2 and min(top_two) > 0 \
        else math.nan
    return Power(dof, lam, w, moved)

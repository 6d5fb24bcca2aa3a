"""Goodness-of-fit statistics: Pearson's chi-square of observed counts against a distribution (one sample) or
of two samples against each other (homogeneity), cells with small expected counts pooled, and the power a
sample size gives. The losslessness lab, the engine's own losslessness tests and the audit of a server
(engine.audit) all test with these."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Cells whose expected count is below this are pooled (the chi-square approximation needs it).
MIN_EXPECTED = 5.0


@dataclass(frozen=True, slots=True)
class FitResult:
    """Pearson chi-square of observed counts against a distribution.

    statistic: sum over used cells of (observed - expected)^2 / expected (inf if a token with
        zero probability was observed). dof: used cells - 1. p_value: P(chi2_dof >= statistic).
    n: observations. index: the output index tested (None outside check_rule).
    passed: p_value >= alpha_level, i.e. the test did not reject "counts ~ distribution".
    """

    statistic: float
    dof: int
    p_value: float
    n: int
    alpha_level: float = 1e-3
    index: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha_level < 1.0:
            raise ValueError(f"alpha_level must be in (0, 1), got {self.alpha_level}")
        if self.dof < 0 or self.n < 0:
            raise ValueError(f"dof and n must be >= 0, got dof={self.dof}, n={self.n}")

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha_level


def goodness_of_fit(
    counts_row: Tensor, p_row: Tensor, *, alpha_level: float = 1e-3, index: int | None = None
) -> FitResult:
    """Pearson chi-square test of counts_row (Tensor[V]) against the distribution p_row (Tensor[V]).

    Cells: a token with p = 0 that was observed makes the statistic inf and p_value 0 (an
    impossible event happened); tokens with p = 0 and no observations are dropped. Cells whose
    expected count n*p is below MIN_EXPECTED are pooled into one bin; if that bin is still
    below MIN_EXPECTED it is merged into the smallest remaining cell. dof = used cells - 1; with
    a single cell (e.g. a one-hot greedy row) dof = 0, the statistic is 0 and p_value 1: the
    support check above is then the whole test. p_value = Q(dof/2, statistic/2), the upper
    regularised gamma function (chi-square survival function).
    """
    observed = counts_row.double().cpu()
    p = p_row.double().cpu()
    n = int(observed.sum().item())
    if observed.shape != p.shape or observed.dim() != 1:
        raise ValueError(
            f"counts_row and p_row must be 1-D of the same size, got {tuple(observed.shape)} and {tuple(p.shape)}"
        )
    if n == 0 or not float(p.sum()) > 0:
        raise ValueError(f"need observations and a distribution with mass, got n={n}, sum(p)={float(p.sum())}")
    if bool(((p == 0) & (observed > 0)).any()):
        return FitResult(math.inf, 0, 0.0, n, alpha_level, index)
    expected = n * p / p.sum()
    obs_cells, exp_cells = _pool_cells(observed[p > 0], expected[p > 0])
    dof = len(exp_cells) - 1
    if dof == 0:
        return FitResult(0.0, 0, 1.0, n, alpha_level, index)
    statistic = float((((obs_cells - exp_cells) ** 2) / exp_cells).sum())
    p_value = chi_square_survival(statistic, dof)
    return FitResult(statistic, dof, p_value, n, alpha_level, index)


def chi_square_survival(statistic: float, dof: int) -> float:
    """P(chi2_dof >= statistic) = Q(dof/2, statistic/2), the upper regularised gamma function."""
    half = torch.tensor([dof / 2, statistic / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def _pool_cells(observed: Tensor, expected: Tensor) -> tuple[Tensor, Tensor]:
    """Pool cells with expected < MIN_EXPECTED into one bin (merged into the smallest cell if
    that bin is itself too small). Returns (observed, expected) per used cell."""
    small = expected < MIN_EXPECTED
    obs, exp = observed[~small], expected[~small]
    if not bool(small.any()):
        return obs, exp
    pooled_obs, pooled_exp = observed[small].sum().view(1), expected[small].sum().view(1)
    if float(pooled_exp) >= MIN_EXPECTED or exp.numel() == 0:
        return torch.cat([obs, pooled_obs]), torch.cat([exp, pooled_exp])
    smallest = int(torch.argmin(exp))
    obs, exp = obs.clone(), exp.clone()
    obs[smallest] += pooled_obs[0]
    exp[smallest] += pooled_exp[0]
    return obs, exp


def homogeneity(first: Tensor, second: Tensor, *, alpha_level: float = 1e-3) -> FitResult:
    """Pearson chi-square test that two samples' counts over the same cells (Tensor[C] each) come from one
    distribution. Expected counts are the pooled proportions times each sample's size; cells whose smaller
    expected count is below MIN_EXPECTED are pooled into one (merged into the smallest cell when still
    too small). dof = used cells - 1; `n` is the two samples' total."""
    a, b = first.double().cpu(), second.double().cpu()
    if a.shape != b.shape or a.dim() != 1:
        raise ValueError(f"the two samples' counts must be 1-D of one size, got {tuple(a.shape)} and {tuple(b.shape)}")
    n_a, n_b = float(a.sum()), float(b.sum())
    if n_a == 0 or n_b == 0:
        raise ValueError(f"both samples need observations, got {n_a:.0f} and {n_b:.0f}")
    seen = (a + b) > 0
    a, b = a[seen], b[seen]
    share = (a + b) / (n_a + n_b)
    small = torch.minimum(share * n_a, share * n_b) < MIN_EXPECTED
    if bool(small.any()):
        a = torch.cat([a[~small], a[small].sum().view(1)])
        b = torch.cat([b[~small], b[small].sum().view(1)])
        share = (a + b) / (n_a + n_b)
        if float(torch.minimum(share[-1] * n_a, share[-1] * n_b)) < MIN_EXPECTED and a.numel() > 2:
            smallest = int(torch.argmin(share[:-1]))
            a[smallest] += a[-1]
            b[smallest] += b[-1]
            a, b, share = a[:-1], b[:-1], (a[:-1] + b[:-1]) / (n_a + n_b)
    dof = a.numel() - 1
    total = int(n_a + n_b)
    if dof == 0:
        return FitResult(0.0, 0, 1.0, total, alpha_level)
    e_a, e_b = share * n_a, share * n_b
    statistic = float(((a - e_a) ** 2 / e_a).sum() + ((b - e_b) ** 2 / e_b).sum())
    return FitResult(statistic, dof, chi_square_survival(statistic, dof), total, alpha_level)


def chi_square_quantile(level: float, dof: int) -> float:
    """The x with P(chi2_dof >= x) = level (bisection on the survival function)."""
    lo, hi = 0.0, float(dof) + 10.0
    while chi_square_survival(hi, dof) > level:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi_square_survival(mid, dof) > level else (lo, mid)
    return (lo + hi) / 2


def noncentral_survival(x: float, dof: int, noncentrality: float) -> float:
    """P(X >= x) for X ~ noncentral chi-square(dof, noncentrality): a Poisson(noncentrality / 2) mixture of
    central chi-squares with dof + 2j degrees of freedom."""
    half = noncentrality / 2
    top = int(half + 12 * math.sqrt(half) + 60)
    j = torch.arange(top + 1, dtype=torch.float64)
    log_weights = -half + j * math.log(half) - torch.lgamma(j + 1) if half > 0 else torch.where(j == 0, 0.0, -math.inf)
    tails = torch.special.gammaincc((dof + 2 * j) / 2, torch.full_like(j, x / 2))
    return float((torch.exp(log_weights) * tails).sum())


def detectable_noncentrality(dof: int, alpha_level: float, power: float = 0.9) -> float:
    """The noncentrality a chi-square test with `dof` degrees of freedom at `alpha_level` detects with
    probability `power`. A sample of n detects a deviation whose Cohen's w = sqrt(sum (p1 - p0)^2 / p0)
    reaches sqrt(this / n)."""
    if dof < 1:
        raise ValueError(f"a test needs at least one degree of freedom, got {dof}")
    critical = chi_square_quantile(alpha_level, dof)
    lo, hi = 0.0, 10.0
    while noncentral_survival(critical, dof, hi) < power:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if noncentral_survival(critical, dof, mid) < power else (lo, mid)
    return (lo + hi) / 2

"""Losslessness checks: Monte-Carlo of speculative rounds under correct and deliberately wrong rules,
and the goodness-of-fit test that tells them apart.

Key property. With synthetic rows that do not depend on the prefix (row i of q_draft and
p_target is the same whatever tokens came before), the correct rule emits, at output index i
and among the rounds that emitted at least i+1 tokens, a token distributed exactly as
p_target[i]. Reaching index i only requires accepting positions 0..i-1, which is independent of
what happens at i, and at i the token is either an accepted draft (mass min(p, q)) or a
correction from the residual (mass max(0, p - q)), summing to p; at i = K it is the bonus from
p_target[K]. Each wrong rule breaks this at some index, which a chi-square test detects.
"""
from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor

from engine.sampling import draw_uniform, sample_many
from engine.stats import FitResult, goodness_of_fit
from engine.verify import acceptance_probability

# Fewer samples than this at an output index and check_rule does not test that index.
MIN_SAMPLES = 50


class Rule(str, Enum):
    """The correct verification rule and three classic mistakes."""

    CORRECT = "correct"
    DISCARD_ON_REJECT = "discard on reject"
    BONUS_FROM_ROW_K_MINUS_1 = "bonus from row K-1"
    CORRECTION_FROM_P = "correction from p instead of the residual"


def no_residual_update(p: Tensor, q_i: Tensor) -> Tensor:
    """The classic tree mistake, for `engine.tree.verify_tree(after_rejection=...)`: every sibling is tested
    against the same p, with no residual update after a rejection. It over-produces the tokens the draft
    proposes; the losslessness test shows it."""
    return p


def simulate(q_draft: Tensor, p_target: Tensor, rule: Rule, trials: int, generator: torch.Generator | None) -> Tensor:
    """Monte-Carlo of `trials` full rounds, vectorised over trials.

    q_draft: Tensor[K, V]; p_target: Tensor[K+1, V] (probability rows). Each trial samples its K
    draft tokens from the q_draft rows (independently; synthetic rows ignore the prefix), then
    verifies them under `rule`. Returns counts Tensor[K+1, V] long on CPU: counts[i, t] = trials
    whose emitted token at output index i was t.

    Random consumption: trials*K uniforms for drafting, trials*K for accept tests, trials for
    the final token, in that order. With trials = 1 that is exactly "draw the K drafts with
    sample_from, then call verify" on the same generator, so Rule.CORRECT can be checked
    against `verify` draw for draw.
    Wrong rules: DISCARD_ON_REJECT emits nothing at a rejection (only the accepted prefix);
    BONUS_FROM_ROW_K_MINUS_1 samples the bonus from p_target[K-1]; CORRECTION_FROM_P samples
    the correction from p_target[i] instead of the residual.
    """
    k, v = q_draft.shape
    if p_target.shape != (k + 1, v):
        raise ValueError(f"p_target must be [K+1, V] = [{k + 1}, {v}], got {tuple(p_target.shape)}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    rule = Rule(rule)
    q64, p64 = q_draft.double().cpu(), p_target.double().cpu()
    source = generator.device if generator is not None else "cpu"
    u_draft, u_accept, u_final = (draw_uniform(n, generator, source).cpu() for n in (trials * k, trials * k, trials))
    drafts = sample_many(q64, u_draft.view(trials, k).T.contiguous()).T  # [T, K]
    n_accepted = _count_accepted(q64, p64, drafts, u_accept.view(trials, k))
    final = _sample_final(q64, p64, rule, n_accepted, u_final)
    keep_final = n_accepted == k if rule is Rule.DISCARD_ON_REJECT else torch.ones_like(n_accepted, dtype=torch.bool)
    return _count_emitted(drafts, n_accepted, final, keep_final, v)


def _count_accepted(q64: Tensor, p64: Tensor, drafts: Tensor, u_accept: Tensor) -> Tensor:
    """Tensor[T] long: length of each trial's leading run of accepts (accept iff u < min(1, p/q))."""
    rows = torch.arange(drafts.shape[1]).unsqueeze(0)
    alpha = acceptance_probability(p64[rows, drafts], q64[rows, drafts])
    return torch.cumprod((u_accept < alpha).to(torch.int64), dim=1).sum(dim=1)


def _final_rows(q64: Tensor, p64: Tensor, rule: Rule) -> Tensor:
    """Tensor[K+1, V]: row i < K is what a rejection at i samples from, row K the bonus row."""
    k = q64.shape[0]
    corrections = p64[:k] if rule is Rule.CORRECTION_FROM_P else (p64[:k] - q64).clamp(min=0.0)
    bonus = p64[k - 1] if rule is Rule.BONUS_FROM_ROW_K_MINUS_1 else p64[k]
    return torch.cat([corrections, bonus.unsqueeze(0)])


def _sample_final(q64: Tensor, p64: Tensor, rule: Rule, n_accepted: Tensor, u_final: Tensor) -> Tensor:
    """Tensor[T]: each trial's final token, sampled from final row n_accepted with its own uniform."""
    rows = _final_rows(q64, p64, rule)
    masses = rows.sum(dim=-1)
    if bool((masses[n_accepted] <= 0).any()):
        raise ValueError("a trial had to sample from a zero-mass row (a residual with no mass): not distributions")
    # Sample every row with every trial's uniform, then keep the row each trial actually reached.
    candidates = sample_many(rows, u_final.unsqueeze(0).expand(rows.shape[0], -1).contiguous(), check_mass=False)
    return candidates.gather(0, n_accepted.unsqueeze(0)).squeeze(0)


def _count_emitted(drafts: Tensor, n_accepted: Tensor, final: Tensor, keep_final: Tensor, v: int) -> Tensor:
    """counts[K+1, V]: output index j < n shows draft j, index n the final token (if kept)."""
    trials, k = drafts.shape
    index = torch.arange(k + 1).unsqueeze(0)
    n = n_accepted.unsqueeze(1)
    padded = torch.cat([drafts, torch.zeros(trials, 1, dtype=torch.long)], dim=1)
    emitted = torch.where(index < n, padded, -1)
    emitted = torch.where((index == n) & keep_final.unsqueeze(1), final.unsqueeze(1), emitted)
    valid = emitted >= 0
    flat = (index * v + emitted)[valid]
    return torch.bincount(flat, minlength=(k + 1) * v).view(k + 1, v)


def check_rule(
    q_draft: Tensor,
    p_target: Tensor,
    rule: Rule,
    trials: int,
    generator: torch.Generator | None,
    alpha_level: float = 1e-3,
) -> list[FitResult]:
    """Simulate `trials` rounds under `rule` and test each output index i against p_target[i].

    Returns one FitResult per output index with at least MIN_SAMPLES emitted tokens, in index
    order. Each test has level alpha_level, so for the correct rule the chance that some index
    fails by bad luck is at most (K+1) * alpha_level.
    """
    counts = simulate(q_draft, p_target, rule, trials, generator)
    return [
        goodness_of_fit(counts[i], p_target[i], alpha_level=alpha_level, index=i)
        for i in range(counts.shape[0])
        if int(counts[i].sum()) >= MIN_SAMPLES
    ]


def passes(results: list[FitResult]) -> bool:
    """True iff every tested index passed. Raises ValueError if nothing was tested."""
    if not results:
        raise ValueError("no output index had enough samples to test")
    return all(r.passed for r in results)


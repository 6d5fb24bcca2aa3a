"""From timed runs to one result per method: medians, c and r, the prediction, the speed-up."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from engine import metrics
from engine.bench.methods import REFERENCE, UNDRAFTED, Method
from engine.bench.runs import Phases, RunSample
from engine.config import Mode
from engine.metrics import PredictionGap, median


@dataclass(frozen=True, slots=True)
class MethodResult:
    """One method at one K, over all prompts and repeats (the JSON record)."""

    method: str
    label: str
    family: str                  # "engine" or "hf"
    drafter: str                 # "model", "ngram", "hybrid" or "none"
    schedule: str                # "constant", "heuristic" or "none"
    k: int | None                # constant K, or the heuristic's starting K; None for target-only
    mean_k: float                # tokens drafted per round, on average
    prompts: int
    repeats: int
    tokens: int                  # generated tokens over all prompts (one repeat)
    rounds: int
    drafted: int
    verified: int | None         # draft positions verified (engine methods; generate does not say)
    accepted: int
    tokens_per_s: float
    ttft_ms: float
    tpot_ms: float
    draft_acceptance_rate: float  # accepted / drafted
    alpha: float | None          # accepted / verified: Leviathan's per-position acceptance
    position_rates: list[float]  # acceptance at each draft position (engine methods)
    mean_accepted_length: float  # tokens per round, the final (correction/bonus) token included
    target_forwards_per_token: float
    target_forward_ms: float     # the single-token reference forward of this method's implementation
    c: float
    r: float                     # this method's own verify forwards at K (heuristic: the rounded mean K)
    r_calibrated: float          # r(K + 1) from the calibration: what the prediction uses
    speedup: float               # over the fastest target-only baseline, whole runs (the prefill included)
    decode_speedup: float        # the same after the first token (wall - TTFT): what the prediction speaks of
    predicted_speedup: float     # E(alpha, k_i) / (c f_i + r(k_i + 1)) over the rounds; NaN without alpha
    predicted_from_rates: float  # the same from the per-position rates (no i.i.d. assumption)
    efficiency: float            # decode_speedup / predicted_speedup
    gap: PredictionGap | None    # efficiency as factors (drafted engine methods)
    forward_share: float         # the forwards' share of the decode time (engine methods; NaN for generate)
    identical_tokens: bool
    mismatched_prompts: list[int]
    phases_ms_per_token: Phases | None  # engine methods only


def reference_forward_s(samples: Sequence[RunSample]) -> float:
    """Median single-token forward (q == 1, all rows) of a target-only method's runs."""
    return median([t.seconds for s in samples for t in s.decode_forwards[0] if t.q == 1 and t.all_rows])


def cost_ratios(method: Method, samples: Sequence[RunSample], t1: float) -> tuple[float, dict[int, float]]:
    """(c, {k: r at K}) from this method's own forward times, relative to `t1` seconds."""
    draft = [t.seconds for s in samples for t in s.decode_forwards[1]]
    c = median(draft, 0.0) / t1 if method.uses_draft_model or method.uses_eagle else 0.0   # a head's step counts
    by_k: dict[int, list[float]] = {}
    for s in samples:
        for t in s.decode_forwards[0]:
            if t.all_rows:
                by_k.setdefault(t.q - 1, []).append(t.seconds)
    return c, {k: median(v) / t1 for k, v in by_k.items()}


def r_at(r: dict[int, float], k: int) -> float:
    """r at K as the runs measured it, else at the nearest measured K; 1 for a round that drafted nothing."""
    if k == 0 or not r:
        return 1.0
    return r.get(k, r[min(r, key=lambda j: (abs(j - k), j))])


def by_prompt(samples: Sequence[RunSample]) -> dict[int, list[RunSample]]:
    """Samples grouped by prompt index, repeats in run order."""
    out: dict[int, list[RunSample]] = {}
    for s in samples:
        out.setdefault(s.prompt, []).append(s)
    return out


def tokens_per_s(samples: Sequence[RunSample]) -> float:
    """Generated tokens over all prompts / the sum of each prompt's median wall time."""
    groups = by_prompt(samples).values()
    return sum(len(runs[0].tokens) for runs in groups) / sum(median([s.wall_s for s in runs]) for runs in groups)


def decode_tokens_per_s(samples: Sequence[RunSample]) -> float:
    """Tokens after the first over the sum of each prompt's median time after its first token (wall - TTFT):
    the decode rate Leviathan's formula speaks of, with the prefill left out."""
    groups = by_prompt(samples).values()
    decode = sum(median([s.wall_s - s.ttft_s for s in runs]) for runs in groups)
    return sum(len(runs[0].tokens) - 1 for runs in groups) / decode if decode > 0 else math.nan


def phases_per_token(samples: Sequence[RunSample]) -> Phases:
    """Engine phase times summed over the samples, per generated token."""
    tokens = sum(len(s.tokens) for s in samples)
    total = Phases(*(sum(getattr(s.phases, f.name) for s in samples) for f in fields(Phases)))
    return total.scaled(1 / max(tokens, 1))


@dataclass(frozen=True, slots=True)
class Prediction:
    iid: float
    rates: float
    alpha: float | None
    position_rates: list[float]
    tokens_factor: float = math.nan    # PredictionGap.tokens
    verify_factor: float = math.nan    # PredictionGap.verify


def predict_runs(method: Method, first: Sequence[RunSample], c: float, r_of_n: Callable[[int], float],
                 r_run: dict[int, float] | None = None) -> Prediction:
    """The model's speed-up for the method's rounds, from alpha and from per-position rates (engine runs
    only: `generate` does not report which positions it verified, so it gets no prediction), and the first
    two factors of PredictionGap (`r_run`: the rounds' own r by K, as `cost_ratios` gives it)."""
    if method.k is None:
        return Prediction(1.0, 1.0, None, [])
    verified = [s.verified for s in first]
    if any(v is None for v in verified):
        return Prediction(math.nan, math.nan, None, [])
    rounds_k = [k for s in first for k in s.rounds_k]
    forwards = [f for s in first for f in (s.rounds_draft_forwards or s.rounds_k)]
    depths = [d for s in first for d in (s.rounds_depth or s.rounds_k)]
    accepted = sum(s.accepted for s in first)
    alpha = metrics.alpha_rate(accepted, sum(verified))
    checks = [c for s in first for c in s.checks]
    rates = metrics.per_position_acceptance(checks, max(depths)) if checks else []
    e_iid = lambda k: metrics.expected_tokens_per_round(alpha, k)  # noqa: E731
    commit = method.mode is Mode.V1          # v1's rounds each run a commit forward too
    tokens, cost = metrics.formula_terms(e_iid, rounds_k, forwards, c, r_of_n, depths, commit)
    iid = tokens / cost if cost > 0 else math.nan
    by_rates = metrics.predicted_over_rounds(lambda k: metrics.expected_tokens_from_rates(rates, k), rounds_k,
                                             forwards, c, r_of_n, depths, commit) if rates else math.nan
    tokens_factor = verify_factor = math.nan
    if r_run:
        tokens_factor, verify_factor = metrics.gap_factors(e_iid, rounds_k, forwards, c, r_of_n,
                                                           lambda n: r_at(r_run, n - 1), depths,
                                                           sum(len(s.tokens) for s in first), commit)
    return Prediction(iid, by_rates, alpha, rates, tokens_factor, verify_factor)


def forward_share(samples: Sequence[RunSample]) -> float:
    """The decode forwards' time (target and draft, the prefill's left out) over the decode wall time."""
    forwards = sum(t.seconds for s in samples for side in s.decode_forwards for t in side)
    decode = sum(s.wall_s - s.ttft_s for s in samples)
    return forwards / decode if decode > 0 else math.nan


def summarize(method: Method, samples: Sequence[RunSample], t1: float, fastest: Sequence[RunSample],
              reference: dict[int, list[int]], r_of_n: Callable[[int], float]) -> MethodResult:
    """Medians over repeats per prompt, then totals over prompts. Token counts, rounds and
    acceptance come from each prompt's first repeat (greedy runs repeat exactly)."""
    groups = by_prompt(samples)
    first = [runs[0] for runs in groups.values()]
    tokens = sum(len(s.tokens) for s in first)
    ttfts = {p: median([s.ttft_s for s in runs]) for p, runs in groups.items()}
    tpots = [(median([s.wall_s for s in runs]) - ttfts[p]) / (len(runs[0].tokens) - 1)
             for p, runs in groups.items() if len(runs[0].tokens) > 1]
    rounds_k = [k for s in first for k in s.rounds_k]
    drafted, accepted = sum(rounds_k), sum(s.accepted for s in first)
    verified = None if any(s.verified is None for s in first) else sum(s.verified for s in first)
    c, r = cost_ratios(method, samples, t1)
    tps = tokens_per_s(samples)
    pred = predict_runs(method, first, c, r_of_n, r)
    mean_k = drafted / len(rounds_k) if rounds_k else 0.0
    k_for_r = (method.k if method.schedule == "constant" else max(1, round(mean_k))) if method.k else 0
    mismatched = sorted({s.prompt for s in samples if s.tokens != reference[s.prompt]})
    speedup = tps / tokens_per_s(fastest)
    decode_speedup = decode_tokens_per_s(samples) / decode_tokens_per_s(fastest)
    efficiency = decode_speedup / pred.iid if pred.iid and math.isfinite(pred.iid) else math.nan
    gap = None
    if method.k and method.family == "engine" and math.isfinite(pred.tokens_factor * efficiency):
        gap = PredictionGap(pred.tokens_factor, pred.verify_factor,
                            efficiency / (pred.tokens_factor * pred.verify_factor))
    return MethodResult(
        method=method.name, label=method.label, family=method.family, drafter=method.drafter,
        schedule=method.schedule, k=method.k, mean_k=mean_k, prompts=len(groups),
        repeats=max(len(v) for v in groups.values()), tokens=tokens, rounds=len(rounds_k),
        drafted=drafted, verified=verified, accepted=accepted, tokens_per_s=tps,
        ttft_ms=median(list(ttfts.values())) * 1000, tpot_ms=median(tpots, 0.0) * 1000,
        draft_acceptance_rate=metrics.acceptance_rate(accepted, drafted), alpha=pred.alpha,
        position_rates=pred.position_rates, mean_accepted_length=tokens / len(rounds_k) if rounds_k else 0.0,
        target_forwards_per_token=len(rounds_k) / max(tokens, 1), target_forward_ms=t1 * 1000, c=c,
        r=r_at(r, k_for_r), r_calibrated=r_of_n(k_for_r + 1) if k_for_r else 1.0,
        speedup=speedup, decode_speedup=decode_speedup, predicted_speedup=pred.iid, predicted_from_rates=pred.rates,
        efficiency=efficiency, gap=gap,
        forward_share=forward_share(samples) if method.family == "engine" else math.nan,
        identical_tokens=not mismatched, mismatched_prompts=mismatched,
        phases_ms_per_token=phases_per_token(samples) if method.family == "engine" else None)


def summarize_all(methods: Sequence[Method], samples: dict[Method, list[RunSample]],
                  r_of_n: Callable[[int], float], r_after_draft: Callable[[int], float] | None = None,
                  reference_method: str = REFERENCE) -> list[MethodResult]:
    """Results for every method: the reference forward per implementation, the fastest baseline. Methods that
    run a draft model predict with `r_after_draft` (calibrated after the draft's chain) when it is given.
    Tokens are compared with `reference_method`'s (the engine's own target-only run where the engine does not
    multiply with the model's own weights: int8)."""
    t1 = {"hf": reference_forward_s(samples[Method("hf-generate")]),
          "engine": reference_forward_s(samples[Method("target")])}
    reference: dict[int, list[int]] = {}
    for s in samples[Method(reference_method)]:
        reference.setdefault(s.prompt, s.tokens)
    fastest = samples[max((m for m in methods if m.name in UNDRAFTED), key=lambda m: tokens_per_s(samples[m]))]
    return [summarize(m, samples[m], t1[m.family], fastest, reference,
                      r_after_draft if r_after_draft and m.uses_draft_model else r_of_n) for m in methods]

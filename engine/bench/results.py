"""From timed runs to one result per method: medians, c and r, the prediction, the speed-up."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields

from engine import metrics
from engine.bench.methods import REFERENCE, UNDRAFTED, Method
from engine.bench.runs import Phases, RunSample


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
    accepted: int
    tokens_per_s: float
    ttft_ms: float
    tpot_ms: float
    acceptance_rate: float
    mean_accepted_length: float  # tokens per round, the final (correction/bonus) token included
    target_forwards_per_token: float
    target_forward_ms: float     # the single-token reference forward of this method's implementation
    c: float
    r: float                     # at K (heuristic: at the rounded mean K)
    speedup: float               # over the fastest target-only baseline
    predicted_speedup: float
    efficiency: float            # speedup / predicted_speedup
    identical_tokens: bool
    mismatched_prompts: list[int]
    phases_ms_per_token: Phases | None  # engine methods only


def _median(xs: Sequence[float], default: float = math.nan) -> float:
    return statistics.median(xs) if xs else default


def reference_forward_s(samples: Sequence[RunSample]) -> float:
    """Median single-token forward (q == 1, all rows) of a target-only method's runs."""
    return _median([t.seconds for s in samples for t in s.decode_forwards[0] if t.q == 1 and t.all_rows])


def cost_ratios(method: Method, samples: Sequence[RunSample], t1: float) -> tuple[float, dict[int, float]]:
    """(c, {k: r(k)}) from this method's hooked forward times, relative to `t1` seconds."""
    draft = [t.seconds for s in samples for t in s.decode_forwards[1]]
    c = _median(draft, 0.0) / t1 if method.uses_draft_model else 0.0
    by_k: dict[int, list[float]] = {}
    for s in samples:
        for t in s.decode_forwards[0]:
            if t.all_rows:
                by_k.setdefault(t.q - 1, []).append(t.seconds)
    return c, {k: _median(v) / t1 for k, v in by_k.items()}


def r_at(r: dict[int, float], k: int) -> float:
    """r(k) measured, else at the nearest measured K; 1 for a round that drafted nothing."""
    if k == 0 or not r:
        return 1.0
    return r.get(k, r[min(r, key=lambda j: (abs(j - k), j))])


def predicted(alpha: float, rounds_k: Sequence[int], c: float, r: dict[int, float],
              draft_forwards: Sequence[int] | None = None) -> float:
    """Leviathan et al.'s speed-up generalised to rounds of varying K (see the module docstring).
    `draft_forwards` per round, when not one per drafted token (the hybrid's copied rounds cost none)."""
    tokens = sum(metrics.expected_tokens_per_round(alpha, k) if k else 1.0 for k in rounds_k)
    forwards = rounds_k if draft_forwards is None else draft_forwards
    cost = sum(c * f + r_at(r, k) for k, f in zip(rounds_k, forwards, strict=True))
    return tokens / cost if cost > 0 else math.nan


def by_prompt(samples: Sequence[RunSample]) -> dict[int, list[RunSample]]:
    """Samples grouped by prompt index, repeats in run order."""
    out: dict[int, list[RunSample]] = {}
    for s in samples:
        out.setdefault(s.prompt, []).append(s)
    return out


def tokens_per_s(samples: Sequence[RunSample]) -> float:
    """Generated tokens over all prompts / the sum of each prompt's median wall time."""
    groups = by_prompt(samples).values()
    return sum(len(runs[0].tokens) for runs in groups) / sum(_median([s.wall_s for s in runs]) for runs in groups)


def phases_per_token(samples: Sequence[RunSample]) -> Phases:
    """Engine phase times summed over the samples, per generated token."""
    tokens = sum(len(s.tokens) for s in samples)
    total = Phases(*(sum(getattr(s.phases, f.name) for s in samples) for f in fields(Phases)))
    return total.scaled(1 / max(tokens, 1))


def summarize(method: Method, samples: Sequence[RunSample], t1: float, fastest_tps: float,
              reference: dict[int, list[int]]) -> MethodResult:
    """Medians over repeats per prompt, then totals over prompts. Token counts, rounds and
    acceptance come from each prompt's first repeat (greedy runs repeat exactly)."""
    groups = by_prompt(samples)
    first = [runs[0] for runs in groups.values()]
    tokens = sum(len(s.tokens) for s in first)
    ttfts = {p: _median([s.ttft_s for s in runs]) for p, runs in groups.items()}
    tpots = [(_median([s.wall_s for s in runs]) - ttfts[p]) / (len(runs[0].tokens) - 1)
             for p, runs in groups.items() if len(runs[0].tokens) > 1]
    rounds_k = [k for s in first for k in s.rounds_k]
    drafted, accepted = sum(rounds_k), sum(s.accepted for s in first)
    alpha = metrics.acceptance_rate(accepted, drafted)
    c, r = cost_ratios(method, samples, t1)
    tps = tokens_per_s(samples)
    per_round = [s.rounds_draft_forwards for s in first]
    forwards = None if any(f is None for f in per_round) else [f for fs in per_round for f in fs]
    pred = predicted(alpha, rounds_k, c, r, forwards) if method.k is not None else 1.0
    mean_k = drafted / len(rounds_k) if rounds_k else 0.0
    mismatched = sorted({s.prompt for s in samples if s.tokens != reference[s.prompt]})
    speedup = tps / fastest_tps
    return MethodResult(
        method=method.name, label=method.label, family=method.family, drafter=method.drafter,
        schedule=method.schedule, k=method.k, mean_k=mean_k, prompts=len(groups),
        repeats=max(len(v) for v in groups.values()), tokens=tokens, rounds=len(rounds_k),
        drafted=drafted, accepted=accepted, tokens_per_s=tps, ttft_ms=_median(list(ttfts.values())) * 1000,
        tpot_ms=_median(tpots, 0.0) * 1000, acceptance_rate=alpha,
        mean_accepted_length=tokens / len(rounds_k) if rounds_k else 0.0,
        target_forwards_per_token=len(rounds_k) / max(tokens, 1), target_forward_ms=t1 * 1000, c=c,
        r=r_at(r, method.k if method.schedule == "constant" else max(1, round(mean_k))) if method.k else 1.0,
        speedup=speedup, predicted_speedup=pred, efficiency=speedup / pred if pred else math.nan,
        identical_tokens=not mismatched, mismatched_prompts=mismatched,
        phases_ms_per_token=phases_per_token(samples) if method.family == "engine" else None)


def summarize_all(methods: Sequence[Method], samples: dict[Method, list[RunSample]]) -> list[MethodResult]:
    """Results for every method: the reference forward per implementation, the fastest baseline."""
    t1 = {"hf": reference_forward_s(samples[Method("hf-generate")]),
          "engine": reference_forward_s(samples[Method("target")])}
    reference: dict[int, list[int]] = {}
    for s in samples[Method(REFERENCE)]:
        reference.setdefault(s.prompt, s.tokens)
    fastest = max(tokens_per_s(samples[m]) for m in methods if m.name in UNDRAFTED)
    return [summarize(m, samples[m], t1[m.family], fastest, reference) for m in methods]

"""One audit from start to verdict: collect completions (in parallel requests, bounded in number and time,
stoppable between requests), then test them against the exact distribution or a reference server."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from engine.audit.client import AuditError, Completion, Endpoint, Stop, sample, served_model
from engine.audit.exact import FRAGILE_MARGIN, ExactJoint
from engine.audit.verdict import Analysis, Key, against_exact, against_reference
from engine.sampling import SamplingParams

# A repeating list: after its first sampled token, prompt lookup finds a match and drafts, so the first speculative
# round of every completion is tested.
DEFAULT_PROMPT = "a, b, c, a, b, c, a, b,"
MAX_SAMPLES = 200_000
MIN_SAMPLES = 50            # fewer and no verdict is given
REFERENCE_SEED_OFFSET = 1_000_000_007   # the reference draws from other seeds than the audited server

Progress = Callable[[str, int, int], None]    # (which server, completions so far, completions planned)


@dataclass(frozen=True, slots=True)
class AuditPlan:
    """What to ask for: the first m tokens, `samples` completions, `per_request` per request (the API's n),
    request i seeded seed + i * per_request (None: unseeded), up to `concurrency` requests in flight, the
    whole collection within `time_limit_s`; the verdict at `level`."""

    m: int = 3
    samples: int = 2000
    params: SamplingParams = field(default_factory=lambda: SamplingParams(1.0, 8, 1.0))
    per_request: int = 50
    seed: int | None = 0
    level: float = 1e-3
    concurrency: int = 2
    time_limit_s: float = 600.0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.m <= 4:
            raise ValueError(f"tokens per completion must be from 1 to 4, got {self.m}")
        if not MIN_SAMPLES <= self.samples <= MAX_SAMPLES:
            raise ValueError(f"samples must be from {MIN_SAMPLES} to {MAX_SAMPLES}, got {self.samples}")
        if not 1 <= self.per_request <= 512:
            raise ValueError(f"completions per request must be from 1 to 512, got {self.per_request}")
        if self.params.greedy:
            raise ValueError("a greedy (temperature 0) request has one outcome: audit at a temperature above 0")
        if not 0 < self.level < 0.5:
            raise ValueError(f"the level must be in (0, 0.5), got {self.level}")
        if not 1 <= self.concurrency <= 16:
            raise ValueError(f"requests in flight must be from 1 to 16, got {self.concurrency}")
        if not 1 <= self.time_limit_s <= 3600 or not 1 <= self.request_timeout_s <= 600:
            raise ValueError("the time limit must be from 1 to 3600 s and a request's from 1 to 600 s")


@dataclass(frozen=True, slots=True)
class Collected:
    completions: list[Completion]
    requests: int
    seconds: float
    cut_short: str | None       # why collection stopped before `samples` (time limit, stop), or None


def collect(endpoint: Endpoint, model: str, prompt: list[int] | str, plan: AuditPlan, seed_offset: int = 0,
            progress: Progress | None = None, stop: Stop | None = None, name: str = "server") -> Collected:
    """Up to plan.samples completions; every request in flight is waited for before returning (nothing is left
    running), a request's failure ends the audit with its sentence."""
    started = time.monotonic()
    sizes = [min(plan.per_request, plan.samples - i) for i in range(0, plan.samples, plan.per_request)]
    results: dict[int, list[Completion]] = {}
    cut_short = None
    pending: dict[Future, int] = {}
    done_count = 0
    with ThreadPoolExecutor(max_workers=plan.concurrency) as pool:
        try:
            for index, size in enumerate(sizes):
                while len(pending) >= plan.concurrency:
                    done_count += _harvest(pending, results, wait(pending, return_when=FIRST_COMPLETED).done)
                    if progress:
                        progress(name, done_count, plan.samples)
                if stop is not None and stop.requested:
                    cut_short = "stopped"
                    break
                if time.monotonic() - started > plan.time_limit_s:
                    cut_short = f"the time limit ({plan.time_limit_s:g} s)"
                    break
                seed = None if plan.seed is None else plan.seed + seed_offset + index * plan.per_request
                pending[pool.submit(sample, endpoint, model, prompt, plan.m, plan.params, size, seed,
                                    plan.request_timeout_s)] = index
            while pending:
                done_count += _harvest(pending, results, wait(pending, return_when=FIRST_COMPLETED).done)
                if progress:
                    progress(name, done_count, plan.samples)
        finally:
            for future in pending:
                future.cancel()
    completions = [c for i in sorted(results) for c in results[i]]
    return Collected(completions, len(results), time.monotonic() - started, cut_short)


def _harvest(pending: dict[Future, int], results: dict[int, list[Completion]], finished) -> int:
    count = 0
    for future in finished:
        index = pending.pop(future)
        results[index] = future.result()    # an AuditError ends the audit here, with its sentence
        count += len(results[index])
    return count


@dataclass(frozen=True, slots=True)
class AuditReport:
    """An audit's outcome: where, what was asked, how long it took, and the analysis (engine.audit.verdict)."""

    url: str
    reference: str | None       # the reference server's URL, or None: against the exact distribution
    model: str                  # the audited server's model name
    exact_model: str | None     # the local model the exact distribution came from
    prompt_tokens: int | None
    plan: AuditPlan
    analysis: Analysis
    seconds: float
    requests: int
    cut_short: str | None
    margin: float | None         # ExactJoint.margin

    @property
    def fragile(self) -> bool:
        return self.margin is not None and self.margin < FRAGILE_MARGIN

    def lines(self, labels: int = 5) -> list[str]:
        """The report as a terminal shows it."""
        a, p = self.analysis, self.plan
        against = f"the reference {self.reference}" if self.reference else \
            f"the exact distribution from {self.exact_model}"
        sampling = f"T={p.params.temperature:g} top-k={p.params.top_k or 'off'} top-p={p.params.top_p:g}"
        out = [f"audit of {self.url} ({self.model}) against {against}",
               f"  the first {p.m} tokens · {sampling} · {a.n} completions"
               + (f" and {a.reference_n} from the reference" if a.reference_n else "")
               + f" in {self.requests} requests · {self.seconds:.1f} s"
               + (f" (prompt {self.prompt_tokens} tokens)" if self.prompt_tokens else "")]
        if self.cut_short:
            out.append(f"  collection ended early: {self.cut_short}")
        for t in a.tests:
            out.append(f"  tokens 1..{t.depth}: chi-square {t.fit.statistic:.1f}, {t.fit.dof} dof, "
                       f"p = {format_p(t.fit.p_value)}")
        verdict = "consistent with lossless sampling" if a.passed else "NOT lossless: the tokens are not distributed" \
            " as the model samples them"
        out.append(f"  verdict: {verdict} (p = {format_p(a.p_value)}, adjusted for {len(a.tests)} tests, level "
                   f"{p.level:g})")
        if a.outside:
            out.append(f"  {a.outside} completions have probability 0 under the model with these settings")
        out.append("  differs most (observed / expected):")
        for c in a.most_different(labels):
            out.append(f"    {c.label!r}: {c.observed} / {c.expected:.1f}")
        if a.power is not None:
            moved = f", e.g. {a.power.moved_pp:.1f} points of probability moved between the two likeliest " \
                    "outcomes" if math.isfinite(a.power.moved_pp) else ""
            out.append(f"  power: this sample detects (90% of the time) a deviation of Cohen's w >= {a.power.w:.3f}"
                       f"{moved}")
        if self.fragile:
            out.append(f"  caution: a top-k or top-p edge lies within {self.margin:.1e} of a token's probability; a "
                       "server in another precision may keep another set there")
        return out


def format_p(p: float) -> str:
    return "0 (below float range)" if p == 0 else f"{p:.3g}"


def keys_of(completions: list[Completion]) -> list[Key]:
    return [c.ids if c.ids is not None else c.text for c in completions]


def audit_exact(endpoint: Endpoint, prompt_ids: list[int], joint: ExactJoint, exact_model: str,
                label: Callable[[tuple[int, ...]], str], plan: AuditPlan, progress: Progress | None = None,
                stop: Stop | None = None) -> AuditReport:
    """The server's samples against the exact distribution `joint` of the same model (computed here)."""
    if joint.m != plan.m or joint.params != plan.params or joint.prompt != list(prompt_ids):
        raise ValueError("the exact distribution was computed for other settings than the plan's")
    model = served_model(endpoint)
    got = collect(endpoint, model, prompt_ids, plan, 0, progress, stop)
    _enough(got, endpoint.base)
    analysis = against_exact(keys_of(got.completions), joint, label, plan.level)
    return AuditReport(endpoint.base, None, model, exact_model, len(prompt_ids), plan, analysis, got.seconds,
                       got.requests, got.cut_short, joint.margin)


def audit_reference(endpoint: Endpoint, reference: Endpoint, prompt: list[int] | str,
                    label: Callable[[Key], str], plan: AuditPlan, progress: Progress | None = None,
                    stop: Stop | None = None) -> AuditReport:
    """The server's samples against a reference server's (the same model without speculation), each side
    given half the time limit."""
    half = AuditPlan(plan.m, plan.samples, plan.params, plan.per_request, plan.seed, plan.level, plan.concurrency,
                     plan.time_limit_s / 2, plan.request_timeout_s)
    model, ref_model = served_model(endpoint), served_model(reference)
    got = collect(endpoint, model, prompt, half, 0, progress, stop)
    _enough(got, endpoint.base)
    ref = collect(reference, ref_model, prompt, half, REFERENCE_SEED_OFFSET, progress, stop, name="reference")
    _enough(ref, reference.base)
    analysis = against_reference(keys_of(got.completions), keys_of(ref.completions), label, plan.level)
    cut = "; ".join(f"{who}: {c}" for who, c in (("server", got.cut_short), ("reference", ref.cut_short)) if c)
    return AuditReport(endpoint.base, reference.base, model, None, len(prompt) if isinstance(prompt, list) else None,
                       plan, analysis, got.seconds + ref.seconds, got.requests + ref.requests, cut or None, None)


def _enough(got: Collected, url: str) -> None:
    if len(got.completions) < MIN_SAMPLES:
        why = f" ({got.cut_short})" if got.cut_short else ""
        raise AuditError(f"only {len(got.completions)} completions came from {url}{why}: at least {MIN_SAMPLES} "
                         "are needed for a verdict")

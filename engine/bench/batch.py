"""Goodput against batch size: `python -m engine bench --batch 1,2,4,8,16`.

At each batch size B the engine decodes B prompts at once (engine.batch), target-only and with each method,
interleaved and repeated; per B it reports tokens/s over all sequences in the steady state (the rounds every
sequence decoded in: what a server that keeps B sequences in flight sees; the whole run's figure beside it
includes the prefill and the tail of an uneven batch, where sequences that finished early have left), each
method's speed-up over target-only at the same B, α, the measured verify cost (the shared forward over the sequences' K + 1 rows
each, relative to target-only's one row each), Leviathan's prediction from those measurements, and the
batch size where speculation stops paying. A batched calibration per B (engine.calibration, `batch=B`)
measures r_B(n) on a grid, from which each drafter's best K per batch size is predicted and printed beside
the best K measured. At B = 1 the single-sequence engine runs too, so the batched path's own cost is seen.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from engine import metrics
from engine.batch import BatchEngine, BatchRequest
from engine.bench.methods import Method
from engine.bench.prompts import Prompt
from engine.calibration import RCurve, calibrate
from engine.clock import ComputeGate, in_turn
from engine.pair import ModelPair
from engine.speculative import SpeculativeEngine

T = TypeVar("T")
COST_GRID = tuple(range(1, 10))    # rows per sequence: K + 1 for K <= 8
SINGLE = "single"                  # the single-sequence engine at B = 1


@dataclass(frozen=True, slots=True)
class BatchRun:
    """One method at one batch size, once (a `SINGLE` run: the single-sequence engine, B = 1)."""

    batch: int
    method: str
    wall_s: float
    tokens: list[list[int]]                # each sequence's new tokens, in prompt order
    forward_ms: list[float]                # the shared target forward of every decode round all B took part in
    rows: list[int]                        # rows that forward fed (all sequences)
    draft_ms: list[float]                  # every sequence's drafting in those rounds
    drafted: list[int]                     # tokens drafted in those rounds, all sequences
    rest_ms: list[float]                   # the rest of those rounds: every sequence's verify, commit, record
    rounds_k: list[int]                    # per sequence and decode round: tokens drafted (all rounds)
    checks: list[list[bool]]               # per drafted sequence-round: its verified accepts, in order
    accepted: int
    verified: int
    full_tokens: int                       # tokens emitted in the rounds all B sequences decoded in
    full_ms: float                         # those rounds' time

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        """Steady state: the tokens of the rounds every sequence decoded in, over those rounds' time; what a
        server keeping B sequences in flight sees (no prefill, no tail where finished sequences have left)."""
        return self.full_tokens / (self.full_ms / 1000) if self.full_ms > 0 else self.wall_tokens_per_s

    @property
    def wall_tokens_per_s(self) -> float:
        """All new tokens over the whole run: the prefill and the tail of an uneven batch included."""
        return self.generated / self.wall_s


@dataclass(frozen=True, slots=True)
class BatchPoint:
    """One method at one batch size: medians over the repeats."""

    batch: int
    method: str                  # a Method label: "target", "ngram K=4", ...
    drafter: str                 # "none" for target-only
    k: int
    tokens_per_s: float          # steady state: tokens of the rounds all B decoded in, over their time
    speedup: float               # over target-only at the same B (1.0 for target-only)
    alpha: float | None          # accepted / verified positions
    forward_ms: float            # the shared target forward of a round with every sequence in it
    rows_per_sequence: float     # rows each sequence fed it, on average
    r: float                     # forward_ms over target-only's at the same B
    draft_ms: float              # drafting per such round, all sequences
    predicted: float | None      # Leviathan from α (per position), the measured r_B(n), draft time and rest
    same_tokens: bool            # every sequence emitted its single-sequence target-only tokens
    rest_ms: float = 0.0         # the rest of such a round: every sequence's verify, commit and record
    wall_tokens_per_s: float = 0.0   # all new tokens over the whole run (prefill and the uneven tail included)


@dataclass(frozen=True, slots=True)
class BestK:
    """For one drafter at one batch size: the K the prediction picks (from that drafter's per-position α, its
    draft time per token and r_B(K + 1)), and the best K among those run."""

    batch: int
    drafter: str
    predicted_k: int
    predicted_speedup: float
    measured_k: int | None
    measured_speedup: float | None


@dataclass(frozen=True, slots=True)
class BatchStudy:
    """Everything `--batch` measured; the JSON file holds it, the app's batch view draws it."""

    target: str
    machine: str
    prompt_set: str
    prompt_lengths: list[int]
    new_tokens: int
    repeats: int
    batches: list[int]
    points: list[BatchPoint]
    costs: list[RCurve]                    # r_B(n) per batch size
    best_k: list[BestK]
    single_tokens_per_s: dict[str, float]  # B = 1 through the single-sequence engine, per method
    wall_s: float
    command: str = ""
    b1_cost: dict[str, float] = field(default_factory=dict)   # batched B = 1 wall / single wall, paired runs

    def point(self, batch: int, method: str) -> BatchPoint | None:
        return next((p for p in self.points if p.batch == batch and p.method == method), None)

    def methods(self) -> list[str]:
        return list(dict.fromkeys(p.method for p in self.points))

    def crossover(self, method: str, predicted: bool = False) -> int | None:
        """The smallest batch size measured at which `method` stops paying (speed-up < 1, measured or predicted);
        None when it pays at every size measured."""
        points = sorted((p for p in self.points if p.method == method), key=lambda p: p.batch)
        for p in points:
            value = p.predicted if predicted else p.speedup
            if value is not None and value < 1.0:
                return p.batch
        return None

    def best_speculative(self, batch: int) -> BatchPoint | None:
        spec = [p for p in self.points if p.batch == batch and p.drafter != "none"]
        return max(spec, key=lambda p: p.speedup) if spec else None

    def batched_over_single(self, method: str) -> float | None:
        """The batched path's cost at B = 1 relative to the single-sequence engine: the median over runs of the
        two side by side of batched wall time over single (a study without the pairs: single tok/s over
        batched's median)."""
        if method in self.b1_cost:
            return self.b1_cost[method]
        point, single = self.point(1, method), self.single_tokens_per_s.get(method)
        return single / point.tokens_per_s if point and single else None


def run_batch(method: Method, pair: ModelPair, prompts: Sequence[Prompt], new_tokens: int) -> BatchRun:
    """The method on these prompts as one batch; the clock starts before the engines (and their KV) exist."""
    config = method.spec_config(new_tokens)
    t0 = time.perf_counter()
    batch = BatchEngine(pair, [BatchRequest(f"{i}", p.ids) for i, p in enumerate(prompts)], config)
    if batch.failures:
        raise ValueError(f"{method.label}: {batch.failures[0].name}: {batch.failures[0].message}")
    batch.run()
    batch.close()
    wall = time.perf_counter() - t0
    full = [r for r in batch.rounds if r.index > 0 and len(r.names) == len(prompts)]
    records = [rec for r in batch.rounds for rec in r.records if not rec.is_prefill]
    made = batch.generated()
    return BatchRun(len(prompts), method.label, wall, [made[f"{i}"] for i in range(len(prompts))],
                    [r.forward_ms for r in full], [sum(r.rows) for r in full], [r.draft_ms for r in full],
                    [sum(rec.k for rec in r.records) for r in full], [r.finish_ms for r in full],
                    [rec.k for rec in records], [rec.checks() for rec in records if rec.k],
                    sum(rec.accepted for rec in records), sum(rec.verified for rec in records),
                    sum(r.emitted for r in full), sum(r.total_ms for r in full))


def run_single(method: Method, pair: ModelPair, prompt: Prompt, new_tokens: int) -> BatchRun:
    """The single-sequence engine on one prompt (B = 1), timed the same way."""
    t0 = time.perf_counter()
    engine = SpeculativeEngine(pair, prompt.ids, method.spec_config(new_tokens))
    engine.run()
    engine.close()
    wall = time.perf_counter() - t0
    decode = [r for r in engine.rounds if not r.is_prefill]
    return BatchRun(1, method.label, wall, [list(engine.generated)], [r.timings.target_forward_ms for r in decode],
                    [r.k + 1 for r in decode], [r.timings.draft_ms for r in decode], [r.k for r in decode],
                    [r.timings.total_ms - r.timings.draft_ms - r.timings.target_forward_ms for r in decode],
                    [r.k for r in decode],
                    [r.checks() for r in decode if r.k], sum(r.accepted for r in decode),
                    sum(r.verified for r in decode), sum(len(r.emitted) for r in decode),
                    sum(r.timings.total_ms for r in decode))


def _median(xs: Sequence[float]) -> float:
    return metrics.median(list(xs))


def _rates(runs: Sequence[BatchRun]) -> list[float]:
    checks = [c for run in runs for c in run.checks]
    if not checks:
        return []
    return metrics.per_position_acceptance(checks, max(len(c) for c in checks))


def _tokens_at(rates: list[float]) -> Callable[[int], float]:
    return lambda k: metrics.expected_tokens_from_rates(rates, k) if k and rates else 1.0


def predict(runs: Sequence[BatchRun], batch: int, cost: RCurve, step_ms: float, base_rest_ms: float) -> float | None:
    """Leviathan's speed-up over target-only at this B, every cost of a round measured: each sequence's rounds
    yield E(k) tokens from the per-position α; a round costs the shared verify forward (r_B(rows per sequence)
    target-only forwards of `step_ms`), its drafting and the rest of the round (verify, commit and record for
    every sequence), where a target-only round costs one forward and its own rest (`base_rest_ms`). None without
    drafted rounds."""
    rates = _rates(runs)
    if not rates:
        return None
    tokens_at = _tokens_at(rates)
    tokens = math.fsum(tokens_at(k) for run in runs for k in run.rounds_k)
    rounds = sum(len(run.rounds_k) for run in runs) / batch
    rows = sum(k + 1 for run in runs for k in run.rounds_k) / (rounds * batch)
    draft = _median([ms for run in runs for ms in run.draft_ms])
    rest = _median([ms for run in runs for ms in run.rest_ms])
    round_ms = cost.at(rows) * step_ms + draft + rest
    return tokens / (batch * rounds) * (step_ms + base_rest_ms) / round_ms


def best_k(runs_by_k: dict[int, list[BatchRun]], batch: int, cost: RCurve, step_ms: float, base_rest_ms: float,
           drafter: str, measured: dict[int, float], k_max: int = COST_GRID[-1] - 1) -> BestK:
    """The K in 1..k_max with the highest predicted speed-up for this drafter at this B (as `predict`): E(K) from
    its per-position α (pooled over its runs), the verify at r_B(K + 1), and per drafted token its measured
    draft time and its share of the round's rest over target-only's; beside the best K among those measured
    (`measured`: K -> speed-up)."""
    runs = [run for rs in runs_by_k.values() for run in rs]
    tokens_at = _tokens_at(_rates(runs))
    drafted = sum(sum(run.drafted) for run in runs)
    rounds = sum(len(run.rest_ms) for run in runs)
    per_token = sum(sum(run.draft_ms) for run in runs) / drafted if drafted else 0.0   # ms, all sequences
    rest_per_token = max(0.0, sum(sum(run.rest_ms) for run in runs) - rounds * base_rest_ms) / drafted \
        if drafted else 0.0
    # a round drafts K for each of the B sequences: B * K drafted tokens
    curve = {k: tokens_at(k) * (step_ms + base_rest_ms)
             / (cost.at(k + 1) * step_ms + k * batch * (per_token + rest_per_token) + base_rest_ms)
             for k in range(1, k_max + 1)}
    top = max(curve, key=curve.get)
    best_measured = max(measured, key=measured.get) if measured else None
    return BestK(batch, drafter, top, curve[top], best_measured,
                 measured[best_measured] if best_measured is not None else None)


class StudyStopped(Exception):
    """`measure` was asked to stop (its `stop` event was set) between two of its runs."""


def measure(pair: ModelPair, methods: Sequence[Method], prompts: Sequence[Prompt], batches: Sequence[int],
            new_tokens: int, repeats: int = 3, warmup: int = 1, calibration_repeats: int = 3,
            progress: Callable[[int, int, str], None] | None = None, machine: str = "", prompt_set: str = "",
            command: str = "", gate: ComputeGate | None = None, stop: threading.Event | None = None) -> BatchStudy:
    """Run the study. `methods` must hold target-only ("target"); batch sizes over the number of prompts reuse
    prompts from the start (a prompt then appears twice in one batch, each copy its own sequence).
    `progress(done, total, what)` after every run and calibration. `gate` is held for each run and each
    calibration (so that none is timed beside other work of the same process that holds it); once `stop` is
    set, the next run raises StudyStopped instead."""
    if not any(m.name == "target" for m in methods):
        raise ValueError("the batch study needs target-only decoding among its methods")
    if not batches or any(b < 1 for b in batches):
        raise ValueError(f"batch sizes must be positive integers, got {list(batches)}")
    engine_methods = [m for m in methods if m.family == "engine"]
    batches = sorted(set(batches))
    t0 = time.perf_counter()
    total = len(batches) + len(engine_methods) * (warmup + repeats * len(batches))
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    def timed(work: Callable[[], T]) -> T:
        if stop is not None and stop.is_set():
            raise StudyStopped("the batch study was stopped")
        return in_turn(gate, work)

    def prompts_for(b: int) -> list[Prompt]:
        return [prompts[i % len(prompts)] for i in range(b)]

    context = sorted(len(p.ids) for p in prompts)[len(prompts) // 2]
    costs = {}
    for b in batches:
        costs[b] = timed(lambda: calibrate(pair.target, context=context, grid=COST_GRID, repeats=calibration_repeats,
                                           batch=b))
        tick(f"r(n) at B={b}")
    for m in engine_methods:
        for _ in range(warmup):
            timed(lambda: run_batch(m, pair, prompts_for(min(2, batches[-1])), min(new_tokens, 16)))
            tick(f"warm-up {m.label}")
    runs: dict[tuple[int, str], list[BatchRun]] = {}
    singles: dict[str, list[BatchRun]] = {}
    for rep in range(repeats):
        for b in batches:
            shift = (rep + b) % len(engine_methods)
            for m in engine_methods[shift:] + engine_methods[:shift]:
                # at B = 1 the single-sequence engine runs right beside the batched one (alternating which goes
                # first), so that their ratio is a pair measured under the same load
                order = ("batch", "single") if rep % 2 == 0 else ("single", "batch")
                for which in order if b == 1 else ("batch",):
                    if which == "batch":
                        runs.setdefault((b, m.label), []).append(
                            timed(lambda: run_batch(m, pair, prompts_for(b), new_tokens)))
                    else:
                        singles.setdefault(m.label, []).append(
                            timed(lambda: run_single(m, pair, prompts[0], new_tokens)))
                tick(f"{m.label} at B={b}")
        if 1 not in batches:
            for m in engine_methods:
                singles.setdefault(m.label, []).append(timed(lambda: run_single(m, pair, prompts[0], new_tokens)))
    alone = singles["target"][0].tokens[0]
    reference = {0: alone}
    points: list[BatchPoint] = []
    for b in batches:
        base = runs[(b, "target")]
        base_rate = _median([r.tokens_per_s for r in base])
        step_ms = _median([ms for r in base for ms in r.forward_ms])
        base_rest = _median([ms for r in base for ms in r.rest_ms])
        for m in engine_methods:
            rs = runs[(b, m.label)]
            rate = _median([r.tokens_per_s for r in rs])
            forward = _median([ms for r in rs for ms in r.forward_ms])
            rows = sum(sum(r.rows) for r in rs) / max(1, sum(len(r.rows) for r in rs)) / b
            verified = sum(r.verified for r in rs)
            same = all(_same_as_alone(r, prompts, b, reference, pair, new_tokens) for r in rs)
            points.append(BatchPoint(
                b, m.label, m.drafter, m.k or 0, rate, rate / base_rate,
                metrics.alpha_rate(sum(r.accepted for r in rs), verified) if verified else None,
                forward, rows, forward / step_ms, _median([ms for r in rs for ms in r.draft_ms]),
                None if m.k is None else predict(rs, b, costs[b], step_ms, base_rest), same,
                _median([ms for r in rs for ms in r.rest_ms]), _median([r.wall_tokens_per_s for r in rs])))
    bests = []
    for drafter in dict.fromkeys(m.drafter for m in engine_methods if m.k):
        family = [m for m in engine_methods if m.drafter == drafter and m.tree is None]
        for b in batches:
            base = runs[(b, "target")]
            step_ms = _median([ms for r in base for ms in r.forward_ms])
            base_rest = _median([ms for r in base for ms in r.rest_ms])
            measured = {m.k: next(p.speedup for p in points if p.batch == b and p.method == m.label) for m in family}
            bests.append(best_k({m.k: runs[(b, m.label)] for m in family}, b, costs[b], step_ms, base_rest, drafter,
                                measured))
    return BatchStudy(pair.target.name, machine, prompt_set, [len(p.ids) for p in prompts], new_tokens, repeats,
                      list(batches), points, [costs[b] for b in batches], bests,
                      {label: _median([r.tokens_per_s for r in rs]) for label, rs in singles.items()},
                      time.perf_counter() - t0, command,
                      {label: _median([b.wall_s / a.wall_s for a, b in zip(rs, runs[(1, label)])])
                       for label, rs in singles.items()} if 1 in batches else {})


def _same_as_alone(run: BatchRun, prompts: Sequence[Prompt], batch: int, reference: dict[int, list[int]],
                   pair: ModelPair, new_tokens: int) -> bool:
    """Whether every sequence of the run emitted what its prompt emits alone, target-only (computed once per
    prompt and kept in `reference`)."""
    for i, tokens in enumerate(run.tokens):
        index = i % len(prompts)
        if index not in reference:
            engine = SpeculativeEngine(pair, prompts[index].ids, Method("target").spec_config(new_tokens))
            engine.run()
            engine.close()
            reference[index] = list(engine.generated)
        if tokens != reference[index]:
            return False
    return True


# -- the outputs ----------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def format_study(study: BatchStudy) -> str:
    """The text report: one row per batch size and method, the best K per batch size, where speculation stops
    paying, and the batched path's cost at B = 1."""
    lengths = sorted(study.prompt_lengths)
    lines = [f"Goodput against batch size: {study.target}, {study.prompt_set} prompts ({len(lengths)}, "
             f"{lengths[0]}-{lengths[-1]} tokens), {study.new_tokens} new tokens each, greedy, medians of "
             f"{study.repeats} repeats; {study.machine}",
             "tok/s: steady state, the tokens of the rounds every sequence decoded in over their time (wall: all "
             "tokens over the run, the prefill and the tail after the first sequence finishes included); "
             "r: the round's shared forward "
             "over target-only's at the same B; predicted: Leviathan's speed-up from α, r_B(n), the draft time and "
             "the rest of a round (verify, commit, record), all measured",
             "",
             f"{'B':>3}  {'method':<20} {'tok/s':>8} {'wall':>7} {'speed-up':>9} {'predicted':>9} {'alpha':>6} {'r':>6} "
             f"{'fwd ms':>7} {'rows/seq':>8} {'draft ms':>8} {'rest ms':>7}  same tokens"]
    for p in study.points:
        lines.append(f"{p.batch:>3}  {p.method:<20} {p.tokens_per_s:>8.1f} {p.wall_tokens_per_s:>7.1f} "
                     f"{p.speedup:>8.2f}x "
                     f"{_fmt(p.predicted):>8}{'x' if p.predicted is not None else ' '} {_fmt(p.alpha):>6} "
                     f"{p.r:>6.2f} {p.forward_ms:>7.1f} {p.rows_per_sequence:>8.2f} {p.draft_ms:>8.1f} {p.rest_ms:>7.1f}  "
                     f"{'yes' if p.same_tokens else 'NO'}")
    lines += ["", "Best K per batch size (predicted from the drafter's per-position α, its draft and rest time per "
                  "drafted token and r_B(K + 1); measured: the best K run):"]
    for b in study.best_k:
        measured = f"K={b.measured_k} ({b.measured_speedup:.2f}x)" if b.measured_k is not None else "-"
        lines.append(f"  {b.drafter:<13} B={b.batch:<3} predicted K={b.predicted_k} ({b.predicted_speedup:.2f}x)   "
                     f"measured {measured}")
    lines += ["", "Where speculation stops paying (the first batch size with a speed-up below 1):"]
    for method in study.methods():
        if method == "target":
            continue
        measured, predicted = study.crossover(method), study.crossover(method, predicted=True)
        lines.append(f"  {method:<20} measured: {f'B={measured}' if measured else 'pays at every B measured'}; "
                     f"predicted: {f'B={predicted}' if predicted else 'pays at every B measured'}")
    costs = ", ".join(f"{m} {_fmt(study.batched_over_single(m), '.3f')}" for m in study.methods()
                      if study.batched_over_single(m) is not None)
    lines += ["", f"B=1, the batched path's wall time over the single-sequence engine's, run side by side: {costs}",
              "r_B(n) measured (rows per sequence n = 1..9): " + "; ".join(
                  f"B={c.batch}: " + " ".join(f"{r:.2f}" for r in c.r) for c in study.costs),
              f"wall {study.wall_s:.0f} s"]
    return "\n".join(lines)


def write_study(path, study: BatchStudy) -> None:
    import json
    from dataclasses import asdict

    path.write_text(json.dumps(asdict(study), indent=1))


def read_study(path) -> BatchStudy:
    """A study written by `write_study`, checked against its types (engine.typed_json); a ValueError naming
    the file and the field otherwise."""
    import json

    from engine.typed_json import Invalid, decode

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a batch study: {exc}") from None
    try:
        return decode(BatchStudy, data, "batch study")
    except Invalid as exc:
        raise ValueError(f"{path}: {exc.at('study')}") from None

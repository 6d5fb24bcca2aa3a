"""Calibration: r(n), the cost of one target forward over n new tokens relative to one, measured.

Leviathan et al. assume a verify forward over K + 1 tokens costs as much as one decode step (r = 1).
That holds while the target is memory-bound, as on a GPU at small batch; on a CPU the matrix
products with a few rows cost visibly more than with one, so r grows with n and the best K falls.
Every prediction this project shows uses this measured curve, never an assumed r.

The measurement: a fresh paged cache holding `context` tokens, then forwards over n new tokens that
are rolled back at once, for each n on a grid, rotated over `repeats` passes so that background load
hits every n alike, each pass followed by its own one-token forwards back to back (the unit its forwards
are counted in); the median per n, made non-decreasing (pool-adjacent-violators: a forward over
more tokens never really costs less, so a dip is noise), divided by the n = 1 value.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from engine.clock import ComputeGate, Now, in_turn
from engine.metrics import median
from engine.models import LoadedModel
from engine.runner import ForwardRequest, ModelRunner, forward_many


class CalibrationStopped(Exception):
    """`calibrate` was asked to stop (its `stop` event was set) before it finished."""


DEFAULT_GRID = tuple(range(1, 18)) + (21, 25, 29, 33)   # K + 1 for K <= 16, and tree widths up to 33


@dataclass(frozen=True, slots=True)
class RCurve:
    """r(n) of one model on one device at one context length; r[0] = r(1) = 1 and r never decreases."""

    model: str
    device: str
    dtype: str
    context: int
    ns: list[int]          # token counts measured, ascending, starting at 1
    ms: list[float]        # median forward ms at each n (each pass's in units of its own one-token forward)
    r: list[float]         # the smoothed ratio to n = 1
    step_ms: float         # the smoothed one-token forward, ms: what r is relative to
    repeats: int
    batch: int = 1         # sequences per forward: n tokens each, r relative to one token each

    def __post_init__(self) -> None:
        if not self.ns or self.ns[0] != 1 or sorted(set(self.ns)) != list(self.ns):
            raise ValueError(f"ns must be ascending distinct token counts starting at 1, got {self.ns}")
        if not (len(self.ms) == len(self.r) == len(self.ns)):
            raise ValueError("ns, ms and r must have one entry each per token count")
        if any(not math.isfinite(x) or x <= 0 for x in self.ms + self.r + [self.step_ms]):
            raise ValueError("forward times and ratios must be finite and positive")

    def at(self, n: int) -> float:
        """r(n), linear between measured counts, and continued along the last segment past the grid."""
        if n < 1:
            raise ValueError(f"a forward feeds at least one token, got n={n}")
        ns, r = self.ns, self.r
        if n >= ns[-1] or len(ns) == 1:
            if len(ns) == 1:
                return r[0]
            slope = (r[-1] - r[-2]) / (ns[-1] - ns[-2])
            return r[-1] + slope * (n - ns[-1])
        i = next(j for j in range(1, len(ns)) if ns[j] >= n)
        w = (n - ns[i - 1]) / (ns[i] - ns[i - 1])
        return r[i - 1] + w * (r[i] - r[i - 1])


def non_decreasing(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, c2), (m1, w1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return [m for m, _, count in blocks for _ in range(count)]


def curve_from_times(model: str, device: str, dtype: str, context: int, times: dict[int, list[float]],
                     repeats: int, batch: int = 1) -> RCurve:
    """The curve from raw forward times (ms) per token count."""
    ns = sorted(times)
    ms = [median(times[n]) for n in ns]
    smooth = non_decreasing(ms)
    r = [max(1.0, s / smooth[0]) for s in smooth]
    r[0] = 1.0
    return RCurve(model, device, dtype, context, ns, ms, r, smooth[0], repeats, batch)


@torch.inference_mode()
def calibrate(loaded: LoadedModel, context: int = 128, grid: tuple[int, ...] = DEFAULT_GRID, repeats: int = 5,
              fused: bool = True, now: Now = time.perf_counter, warmup: int = 2,
              stop: threading.Event | None = None, draft: LoadedModel | None = None,
              gate: ComputeGate | None = None, batch: int = 1, argmax_only: bool = False) -> RCurve:
    """Measure r(n) for `loaded` on its device with `context` tokens already cached.

    The context is a fixed pseudo-random id sequence (the cost of attention depends on the length,
    not on the tokens). Each forward is timed by the runner's own clock (device time on CUDA).
    `stop`, once set, ends the measurement before its next forward with CalibrationStopped (a
    background calibration must not be inside torch when the interpreter exits).

    With a `draft` model, every timed forward over n >= 2 tokens comes right after n - 1 one-token
    forwards of the draft (untimed), as a verify comes after a chain's drafts: the draft's weights and
    cache displace the target's, and a verify measured alone costs less than one inside a round (on
    the built-in pair here, r(5) 1.07 alone against 1.27 in the rounds). The one-token forward that r
    is relative to runs alone, back to back after the grid, as target-only decoding runs it.

    `gate`: held for each timed forward (with its drafts), so that a calibration in the background never runs
    beside a round that is being timed, nor is timed beside one.

    `batch`: B sequences, each holding the context, fed n tokens each in one batched forward
    (`engine.runner.forward_many`); r(n) is then that forward's cost relative to one token each: what a batch's
    verify of K + 1 rows per sequence costs against its target-only step.

    `argmax_only`: the forwards compute what greedy decoding reads (`ModelRunner.forward_features`), where an int4
    target computes less of its head: both r and its unit then cost what a greedy run's forwards cost.
    """
    if context < 1 or repeats < 1 or not grid or batch < 1:
        raise ValueError(f"need context >= 1, repeats >= 1, a grid and batch >= 1, got {context}, {repeats}, "
                         f"{grid}, {batch}")
    if batch > 1 and draft is not None:
        raise ValueError("a batched calibration times the target alone")
    grid = tuple(sorted(set(grid) | {1}))
    context = min(context, loaded.max_context - grid[-1])
    # one pool for all the sequences, as a batch of engines shares one (engine.batch)
    pool = ModelRunner(loaded, context + grid[-1], fused=fused, now=now, sequences=batch).pool
    runners = [ModelRunner(loaded, context + grid[-1], fused=fused, now=now, pool=pool) for _ in range(batch)]
    caches = [r.new_sequence() for r in runners]
    runner, cache = runners[0], caches[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(loaded.vocab_size, len(loaded.tokenizer)), (context + grid[-1],), generator=g).tolist()
    def prefill() -> None:
        for r, c in zip(runners, caches):
            r.forward(c, ids[:context], last_only=True)
    in_turn(gate, prefill)
    feed = ids[context:]
    drafting = _Drafting(draft, ids[:context], context + grid[-1], now) if draft is not None else None

    def forward(n: int, chain: bool = True) -> float:
        if stop is not None and stop.is_set():
            raise CalibrationStopped(f"the calibration of {loaded.name} was stopped")
        def timed() -> float:
            if drafting is not None and chain:
                drafting.run(n - 1)
            if batch == 1:
                runner.forward_features(cache, feed[:n], features=False, argmax_only=argmax_only)
            else:
                forward_many([ForwardRequest(r, c, feed[:n]) for r, c in zip(runners, caches)], features=False)
            for r, c in zip(runners, caches):
                c.rollback(n)
                ms = r.drain_forward_ms()[0]
            return ms
        return in_turn(gate, timed)

    try:
        for _ in range(warmup):
            for n in grid:
                forward(n)
        times: dict[int, list[float]] = {n: [] for n in grid}
        units: list[float] = []
        for rep in range(repeats):
            shift = rep % len(grid)
            for n in grid[shift:] + grid[:shift]:
                times[n].append(forward(n))
            # r's unit is timed back to back, as target-only decoding runs it: amid the grid's larger forwards a
            # one-token forward is slower (on the built-in target 3.5-3.7 ms against 2.8-3.0, which made r(5)
            # 1.16-1.28 where a verify inside the rounds measured 1.5; timed back to back, r(5) came out 1.44-1.46).
            # Each pass times its own unit right after its grid, and its forwards count against that unit: a slow
            # spell of the machine then slows a pass and its unit alike, where one unit timed once at the end
            # read 13.5-20 ms on SmolLM2 int4 in one evening and moved r(3) between 1.0 and 1.5
            forward(1, chain=False)
            units.append(forward(1, chain=False))
        unit = median(units)
        times = {n: [t * unit / u for t, u in zip(ts, units)] for n, ts in times.items()}
        times[1] = units
    finally:
        for c in caches:
            c.free()
        if drafting is not None:
            drafting.close()
    return curve_from_times(loaded.name, str(loaded.device), loaded.format, context, times, repeats, batch)


class _Drafting:
    """A draft model's chain of one-token forwards over its own cache, rolled back after each chain."""

    def __init__(self, draft: LoadedModel, context: list[int], capacity: int, now: Now) -> None:
        self.runner = ModelRunner(draft, capacity, now=now)
        self.cache = self.runner.new_sequence()
        self.ids = [t % draft.vocab_size for t in context]
        self.runner.forward(self.cache, self.ids[:-1], last_only=True)

    def run(self, forwards: int) -> None:
        for i in range(forwards):
            self.runner.forward(self.cache, [self.ids[-1 - i]], last_only=True)
        self.cache.rollback(forwards)
        self.runner.drain_forward_ms()

    def close(self) -> None:
        self.cache.free()

"""engine.calibration: r(1) = 1, a non-decreasing curve, interpolation, a real measurement, and traces
that carry the curve so a replay shows the machine it was measured on."""
from __future__ import annotations

import itertools
import statistics

import pytest

from engine.calibration import CalibrationStopped, RCurve, calibrate, curve_from_times, non_decreasing
from engine.compared import ComparedRun
from engine.config import SpecConfig
from engine.pair import ModelPair
from engine.trace import TraceError, load_trace


def test_non_decreasing_is_the_least_squares_monotone_fit():
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert non_decreasing([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    fit = non_decreasing([1.0, 5.0, 2.0, 6.0])
    assert fit == pytest.approx([1.0, 3.5, 3.5, 6.0]) and fit == sorted(fit)


def test_curve_from_times_starts_at_one_and_never_decreases():
    times = {1: [4.0, 4.2, 3.9], 2: [3.8, 4.0], 3: [6.0], 5: [5.5], 9: [9.0]}
    curve = curve_from_times("m", "cpu", "float32", 32, times, repeats=3)
    assert curve.ns == [1, 2, 3, 5, 9] and curve.r[0] == 1.0
    assert curve.r == sorted(curve.r) and all(r >= 1.0 for r in curve.r)
    assert curve.ms == pytest.approx([4.0, 3.9, 6.0, 5.5, 9.0])   # the raw medians are kept as measured
    assert curve.step_ms == pytest.approx(3.95)                   # 1 and 2 pooled: the dip at 2 is noise


def test_at_interpolates_and_continues_past_the_grid():
    curve = RCurve("m", "cpu", "float32", 32, [1, 3, 5], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 1.0, 1)
    assert curve.at(1) == 1.0 and curve.at(2) == pytest.approx(1.5) and curve.at(5) == 3.0
    assert curve.at(7) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        curve.at(0)
    with pytest.raises(ValueError):
        RCurve("m", "cpu", "float32", 32, [2, 3], [1.0, 1.0], [1.0, 1.0], 1.0, 1)  # must start at n = 1


def test_calibrate_measures_the_runners_forwards_with_the_injected_clock(builtin_pair):
    _, target = builtin_pair
    ticks = itertools.count()
    # A fake clock: every read advances 1 ms, so each timed forward lasts exactly 1 ms (start and end reads).
    curve = calibrate(target, context=16, grid=(1, 2, 4), repeats=2, now=lambda: next(ticks) / 1000, warmup=0)
    assert curve.ns == [1, 2, 4] and curve.ms == pytest.approx([1.0, 1.0, 1.0]) and curve.r == [1.0, 1.0, 1.0]
    assert curve.context == 16 and curve.model == target.name and curve.repeats == 2


def test_with_a_draft_each_verify_comes_right_after_its_chain_of_draft_forwards(builtin_pair, monkeypatch):
    from engine import calibration

    draft, target = builtin_pair
    chains, runners = [], []
    real = calibration._Drafting.run

    def spy(self, forwards):
        chains.append(forwards)
        runners.append(self.runner)
        real(self, forwards)
    monkeypatch.setattr(calibration._Drafting, "run", spy)
    ticks = itertools.count()
    curve = calibrate(target, context=16, grid=(1, 2, 4), repeats=2, now=lambda: next(ticks) / 1000, warmup=0,
                      draft=draft)
    assert chains == [0, 1, 3, 1, 3, 0]              # n - 1 before each timed n: 1, 2, 4, then rotated 2, 4, 1
    assert runners[0].loaded is draft and runners[0].forwards == 1 + sum(chains)   # its context, then the chains
    assert curve.ms == pytest.approx([1.0, 1.0, 1.0])   # the draft's forwards are not timed


def test_each_pass_times_its_own_one_token_unit_and_a_slow_spell_leaves_r_as_it_is(builtin_pair, monkeypatch):
    """Amid the grid's larger forwards a one-token forward runs slower than in target-only decoding, which
    made r too low: each pass ends with one untimed and one timed one-token forward in a row, its unit. A
    slow spell of the machine that covers passes and their units alike (here two of three passes run 1.5x
    slower) leaves r as it is; with one unit timed at the end, outside the spell, r(4) read 3.0 instead of 2."""
    from engine import calibration

    _, target = builtin_pair
    feeds, cost, slow = [], {1: 10.0, 2: 12.0, 4: 20.0}, (1.5, 1.5, 1.0)
    real_forward = calibration.ModelRunner.forward_features     # what `forward` calls too

    def forward(self, cache, ids, *args, **kwargs):
        feeds.append(len(ids))
        return real_forward(self, cache, ids, *args, **kwargs)

    clock = {"t": 0.0, "seen": 0}

    def now() -> float:        # a forward's first read is its start, its second its end, cost[n] x its pass's pace
        if len(feeds) > clock["seen"]:
            clock["seen"] = len(feeds)
            return clock["t"]
        i = len(feeds) - 2                             # forwards after the context's, 5 a pass
        clock["t"] += cost.get(feeds[-1], 1.0) * (slow[i // 5] if i >= 0 else 1.0) / 1000
        return clock["t"]
    monkeypatch.setattr(calibration.ModelRunner, "forward_features", forward)
    curve = calibrate(target, context=16, grid=(1, 2, 4), repeats=3, warmup=0, now=now)
    assert feeds[0] == 16 and feeds[1:] == [1, 2, 4, 1, 1, 2, 4, 1, 1, 1, 4, 1, 2, 1, 1]   # rotated, each with its unit
    assert curve.r == pytest.approx([1.0, 1.2, 2.0]) and curve.step_ms == pytest.approx(15.0)


def test_a_set_stop_event_ends_a_calibration_at_its_next_forward(builtin_pair):
    import threading

    _, target = builtin_pair
    stop, reads = threading.Event(), itertools.count()

    def clock() -> float:      # sets the event on the 3rd read: inside the 2nd timed forward
        if next(reads) == 2:
            stop.set()
        return 0.0

    with pytest.raises(CalibrationStopped, match="stopped"):
        calibrate(target, context=16, grid=(1, 2, 4), repeats=50, now=clock, warmup=0, stop=stop)
    assert next(reads) == 4    # two forwards ran (two reads each), the third never started


def test_a_calibration_never_times_a_forward_while_a_round_holds_the_gate(builtin_pair):
    """A round holds the gate for its whole length; the calibration's forwards wait for it (and run after)."""
    import threading
    import time

    from engine.clock import ComputeGate

    _, target = builtin_pair
    gate, round_running, seen = ComputeGate(), threading.Event(), []

    def clock() -> float:      # read at both ends of every timed forward: was a round running then?
        seen.append(round_running.is_set())
        return time.perf_counter()

    worker = threading.Thread(target=calibrate, kwargs=dict(loaded=target, context=16, grid=(1, 2, 4), repeats=2,
                                                            now=clock, warmup=0, gate=gate))
    for _ in range(3):                   # three rounds, the calibration going on between them
        with gate.held():
            round_running.set()
            if not worker.is_alive() and not seen:
                worker.start()
            time.sleep(0.05)             # a round's time, in which an ungated forward would be timed
            round_running.clear()
    worker.join()
    assert seen and not any(seen)


def test_a_real_calibration_reports_the_medians_of_its_own_forwards(builtin_pair, monkeypatch):
    from engine import calibration
    from engine.calibration import non_decreasing

    _, target = builtin_pair
    seen: dict[int, list[float]] = {}
    real = calibration.curve_from_times

    def spy(model, device, dtype, context, times, repeats, *batch):
        seen.update({n: list(t) for n, t in times.items()})
        return real(model, device, dtype, context, times, repeats, *batch)
    monkeypatch.setattr(calibration, "curve_from_times", spy)
    curve = calibrate(target, context=32, grid=(3, 9, 17), repeats=3)
    assert sorted(seen) == curve.ns == [1, 3, 9, 17]               # one row is always measured: r's unit
    assert all(len(t) == 3 for t in seen.values())
    assert curve.ms == [statistics.median(seen[n]) for n in curve.ns]
    assert curve.step_ms == pytest.approx(non_decreasing(curve.ms)[0])


def test_a_curve_is_made_non_decreasing_and_relative_to_one_row():
    from engine.calibration import curve_from_times

    curve = curve_from_times("m", "cpu", "float32", 8, {1: [2.0, 2.2, 1.8], 4: [1.9], 8: [3.0, 3.2]}, 2)
    assert curve.ms == [2.0, 1.9, 3.1]                     # the raw medians, as measured
    # the least-squares non-decreasing fit pools 1 and 4 rows (4 rows cannot cost less than one): 1.95 each
    assert curve.step_ms == pytest.approx(1.95) and curve.r == pytest.approx([1.0, 1.0, 3.1 / 1.95])


def test_traces_round_trip_the_calibration(builtin_pair, tmp_path):
    draft, target = builtin_pair
    curve = RCurve(target.name, "cpu", "float32", 40, [1, 2, 5], [3.0, 3.5, 4.0], [1.0, 1.1, 1.3], 3.0, 4)
    path = tmp_path / "t.jsonl"
    run = ComparedRun(ModelPair(target, draft), "def f(x):\n", SpecConfig(k=2, max_new_tokens=6), trace_path=path)
    run.step()
    run.set_calibration(curve)  # it may arrive while the run is under way
    run.run_to_end()
    run.close()
    assert load_trace(path).calibration == curve
    bad = path.read_text().replace('"r": [1.0, 1.1, 1.3]', '"r": [1.0, -1.0, 1.3]')
    with pytest.raises(TraceError, match="calibration"):
        load_trace(bad.encode())


def test_a_batched_calibration_times_b_sequences_in_one_forward(builtin_pair, monkeypatch):
    """batch=B: every timed forward feeds n tokens to each of B sequences at once (one batched forward), and r
    is relative to one token each."""
    from engine import calibration

    _, target = builtin_pair
    fed: list[list[int]] = []
    real = calibration.forward_many

    def spy(requests, *args, **kwargs):
        fed.append([len(r.token_ids) for r in requests])
        return real(requests, *args, **kwargs)
    monkeypatch.setattr(calibration, "forward_many", spy)
    curve = calibrate(target, context=24, grid=(1, 3), repeats=2, warmup=0, batch=3)
    assert curve.batch == 3 and curve.ns == [1, 3] and curve.r[0] == 1.0
    assert fed and all(len(f) == 3 and len(set(f)) == 1 for f in fed)   # three sequences, n tokens each
    assert {f[0] for f in fed} == {1, 3}
    with pytest.raises(ValueError, match="times the target alone"):
        calibrate(target, context=24, grid=(1, 3), batch=2, draft=builtin_pair[0])

"""The Step benchmark's arithmetic (the command itself, `--browser` included, is run by hand: it measures time)."""
from __future__ import annotations

from playground.stepbench import StepTimes, p95


def test_p95_is_the_nearest_rank():
    assert p95([5.0]) == 5.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0
    assert p95([float(i) for i in range(100, 0, -1)]) == 95.0


def test_a_line_reports_the_step_the_engine_and_the_rest():
    line = StepTimes(64, "charts", (0.1, 0.3, 0.2), (0.05, 0.2, 0.1)).line()
    assert "3 steps" in line and "first  100.0 ms" in line and "median  200.0 ms, p95  300.0 ms" in line
    assert "engine: median  100.0 ms" in line and "the rest: median  100.0 ms, p95  100.0 ms" in line



def test_the_page_run_is_read_once_its_target_only_rounds_have_caught_up(builtin_pair, tmp_path):
    """`--to-end` reads the finished run as the page shows it: it waits for the target-only rounds the page asks
    for after drawing the last round, then reports the speed-up the run's own figures give."""
    import threading

    from engine import metrics
    from engine.calibration import calibrate
    from playground import controller
    from playground.controller import Context, DecodeRequest
    from playground.registry import ModelRegistry
    from playground.sessions import SessionPool
    from playground.settings import AppSettings
    from playground.stepbench import run_figures

    draft, target = builtin_pair
    registry = ModelRegistry(loader=lambda source, role, device: draft if role == "draft" else target)
    ctx = Context(registry, SessionPool(2, 64 * 2**20, 60.0, root=tmp_path), AppSettings(max_new_tokens=64))
    req = DecodeRequest(prompt="def fibonacci(n):\n", preset="default", custom_draft="", custom_target="", mode="v2",
                        drafter="model", k=4.0, k_schedule="constant", k_min=1.0, k_max=8.0, temperature=1.0,
                        top_k=0.0, top_p=1.0, seed=3.0, max_new_tokens=16.0)
    try:
        s = ctx.pool.open("a")
        assert run_figures(ctx.pool.sessions()) is None                     # nothing run yet
        controller.step(ctx, s, req)
        s.run.set_calibration(calibrate(target, context=32, grid=(1, 2, 3, 4, 5), repeats=1, warmup=1))
        while not s.run.finished:
            controller.step(ctx, s, req, catch_up=False)                     # as the page's Step
        assert s.run.behind
        threading.Timer(0.3, s.run.catch_up).start()                         # the page's catch-up, once drawn
        line = run_figures(ctx.pool.sessions())
        assert not s.run.behind
        view = s.view()
        measured = metrics.decode_speedup(view.rounds, view.baseline)
        predicted = metrics.Tally.of(view.rounds, view.baseline).speedup_iid(view.calibration.at)
        assert f"measured after the prefill {measured:.2f}×" in line and f"predicted {predicted:.2f}×" in line
        assert f"measured / predicted {measured / predicted:.2f} = " in line and f"{len(view.rounds)} rounds" in line
    finally:
        ctx.pool.shutdown()

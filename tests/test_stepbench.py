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


"""The Step benchmark's arithmetic (the command itself is run by hand: it measures time), and that its browser
mode times each Step in the page (where Chromium is installed)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from playground import stepbench
from playground.stepbench import StepTimes, p95
from tests.conftest import CHROMIUM


def test_p95_is_the_nearest_rank():
    assert p95([5.0]) == 5.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0
    assert p95([float(i) for i in range(100, 0, -1)]) == 95.0


def test_a_line_reports_the_step_the_engine_and_the_rest():
    line = StepTimes(64, "charts", (0.1, 0.3, 0.2), (0.05, 0.2, 0.1)).line()
    assert "3 steps" in line and "first  100.0 ms" in line and "median  200.0 ms, p95  300.0 ms" in line
    assert "engine: median  100.0 ms" in line and "the rest: median  100.0 ms, p95  100.0 ms" in line


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)")
def test_the_browser_mode_times_every_step_from_the_click_to_the_round_on_screen(capsys):
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with pytest.raises(SystemExit) as done:
        stepbench.main(["--browser", "3", "--tokens", "16", "--target", "builtin", "--chromium", CHROMIUM,
                        "--pause", "0.2"])
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    for what in ("status line shows the round", "round detail plot names it"):
        line = next(line for line in out.splitlines() if what in line)
        first, median = (float(x) for x in re.search(r"first +([\d.]+) ms .* median +([\d.]+) ms", line).groups())
        assert line.startswith("3 Steps") and 0 < first < 60_000 and 0 < median < 60_000, line

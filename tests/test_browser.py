"""A real browser: headless Debian Chromium driven by Playwright clicks through the main flow.

Saves a screenshot (to $SPECPLAY_SCREENSHOT if set, e.g. assets/screenshot.png for the README).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from engine.records import Outcome
from playground.render.palette import chip_class
from tests.conftest import launched_app

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

MAX_STEPS = 30   # with the default prompt, seed and temperature 1, every outcome appears well before this


@pytest.fixture(scope="module")
def url(builtin_pair, tmp_path_factory):
    with launched_app(builtin_pair, tmp_path_factory.mktemp("sessions"), max_sessions=4, max_new_tokens=128) as (u, _):
        yield u


@pytest.fixture(scope="module")
def page(url):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#step-btn")
        yield page
        browser.close()


def click_step(page, expect_round: int) -> None:
    page.click("#step-btn")
    page.wait_for_function(f"document.querySelector('#status').innerText.includes('Round {expect_round} of')")


def count(page, outcome: Outcome) -> int:
    return page.locator(f"#token-stream .{chip_class(outcome)}").count()


def test_stepping_shows_every_outcome_and_the_charts(page, tmp_path):
    finals = (Outcome.ACCEPTED, Outcome.REJECTED, Outcome.CORRECTED, Outcome.BONUS)
    for n in range(1, MAX_STEPS + 1):
        click_step(page, n)
        if all(count(page, o) for o in finals) or "finished" in page.locator("#status").inner_text():
            break
    assert all(count(page, o) for o in finals), {o.value: count(page, o) for o in finals}
    assert count(page, Outcome.PENDING) == 0
    title = page.locator(f"#token-stream .{chip_class(Outcome.REJECTED)}:not(.unchecked)").first.get_attribute("title")
    assert "α=min(1,p/q)=" in title and " u=" in title and " p=" in title and " q=" in title
    page.wait_for_selector("#detail-plot .js-plotly-plot svg")
    page.get_by_role("tab", name="Charts").click()
    page.wait_for_function("document.querySelectorAll('#chart-speedup .js-plotly-plot svg').length > 0")
    for chart in ("acceptance", "per-position", "lengths", "tokens-time", "speedup"):
        assert page.locator(f"#chart-{chart} .js-plotly-plot").count() == 1, chart
    page.get_by_role("tab", name="KV cache").click()
    page.wait_for_selector("#kv-target .js-plotly-plot svg")
    assert "block table" in page.locator("#kv-table").inner_text()
    page.get_by_role("tab", name="Round detail").click()
    shot = tmp_path / "screenshot.png"
    page.screenshot(path=str(shot))  # the first screen: controls, stream and the round detail
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("SPECPLAY_SCREENSHOT"):
        shutil.copy(shot, os.environ["SPECPLAY_SCREENSHOT"])


def test_reveal_substep_and_chip_click(page):
    rounds = page.locator("#token-stream .round-sep").count()
    page.click("#reveal-box input")
    click_step(page, rounds + 1)
    assert count(page, Outcome.PENDING) > 0
    page.wait_for_function("document.querySelector('#status').innerText.includes('pending')")
    page.click("#step-btn")
    page.wait_for_function("!document.querySelector('#status').innerText.includes('pending')")
    assert count(page, Outcome.PENDING) == 0
    page.click("#reveal-box input")
    chip = page.locator(f"#token-stream .{chip_class(Outcome.ACCEPTED)}").first
    where = chip.get_attribute("data-round"), chip.get_attribute("data-pos")
    assert int(where[0]) < rounds   # an earlier round than the one selected by default
    chip.click()
    page.wait_for_selector(f'#token-stream .chip.selected[data-round="{where[0]}"][data-pos="{where[1]}"]')
    assert page.locator("#token-stream .chip.selected").count() == 1
    page.wait_for_function(f"document.querySelector('#detail-plot').innerText.includes("
                           f"'round {int(where[0]) + 1}, draft #{int(where[1]) + 1}')")


def test_an_empty_prompt_keeps_the_previous_run_visible_and_step_refuses_it(page):
    page.click("#step-btn")
    page.wait_for_function("document.querySelector('#status').innerText.includes('Round ')")
    page.fill("#prompt-box textarea", "   ")
    page.click("#reset-btn")
    page.wait_for_selector("text=The prompt is empty")
    page.wait_for_function("document.querySelector('#status').innerText.includes('Previous run')")
    rounds = page.locator("#token-stream .round-sep").count()
    assert rounds > 0      # the old run is still on screen
    page.click("#step-btn")
    page.wait_for_selector("text=This is the previous run")
    assert page.locator("#token-stream .round-sep").count() == rounds
    page.fill("#prompt-box textarea", "import os\n")
    page.click("#reset-btn")
    page.wait_for_function("document.querySelector('#status').innerText.includes('Round 0 of 0')")
    assert "Previous run" not in page.locator("#status").inner_text()
    click_step(page, 1)


def test_play_steps_on_its_own_until_paused(page):
    rounds = page.locator("#token-stream .round-sep").count()
    page.click("#play-btn")
    page.wait_for_function(f"document.querySelector('#status').innerText.includes('Round {rounds + 2} of')")
    assert "Pause" in page.locator("#play-btn").inner_text()
    page.click("#play-btn")
    page.wait_for_function("document.querySelector('#play-btn').innerText.includes('Play')")

"""A real browser: headless Debian Chromium driven by Playwright clicks through the main flow.

Saves a screenshot (to $SPECPLAY_SCREENSHOT if set, e.g. assets/screenshot.png for the README).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

from engine.records import Outcome
from playground.render.palette import chip_class
from tests.conftest import CHROMIUM as CHROMIUM_PATH
from tests.conftest import launched_app

CHROMIUM = Path(CHROMIUM_PATH)
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
from playwright.sync_api import TimeoutError as PlaywrightTimeout  # noqa: E402  (after the skip above)

MAX_STEPS = 30   # with the default prompt, seed and temperature 1, every outcome appears well before this


@pytest.fixture(scope="module")
def url(builtin_pair, tmp_path_factory):
    with launched_app(builtin_pair, tmp_path_factory.mktemp("sessions"), max_sessions=4, max_new_tokens=128) as (u, _):
        yield u


def open_page(browser, url: str, width: int, height: int):
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector("#step-btn")
    return page


@pytest.fixture(scope="module")
def page(browser, url):
    page = open_page(browser, url, 1500, 1100)
    yield page
    page.close()


def click_step(page, expect_round: int) -> None:
    page.click("#step-btn")
    try:
        page.wait_for_function(f"document.querySelector('#status').innerText.includes('Round {expect_round} of')")
    except Exception as exc:   # say what the page showed instead, not only that the wait ran out
        raise AssertionError(f"Step did not show round {expect_round}; the status reads "
                             f"{page.locator('#status').inner_text()!r}") from exc


def wait_for_rounds(page, drawn_rounds: str, condition: str) -> None:
    """Wait until the acceptance chart's round count meets `condition` ("=== 2"); a failure says what it held."""
    try:
        page.wait_for_function(f"({drawn_rounds})() {condition}")
    except PlaywrightTimeout as exc:
        raise AssertionError(f"the acceptance chart held {page.evaluate(f'({drawn_rounds})()')} rounds, not "
                             f"{condition}; the status reads {page.locator('#status').inner_text()!r}") from exc


def count(page, outcome: Outcome) -> int:
    return page.locator(f"#token-stream .{chip_class(outcome)}").count()


# the target-only run's forwards, as the Round detail's summary counts them
BASELINE_FORWARDS = ("+((document.querySelector('#summary').innerText.match("
                     "/target forwards: speculative \\/ target-only\\s+\\d+ \\/ (\\d+)/) || [0, 0])[1])")


def test_stepping_shows_every_outcome_and_the_charts(page, tmp_path):
    finals = (Outcome.ACCEPTED, Outcome.REJECTED, Outcome.CORRECTED, Outcome.BONUS)
    for n in range(1, MAX_STEPS + 1):
        click_step(page, n)
        if n == 1:   # the Step's target-only round runs after the page drew the round, and the frame is redrawn
            page.wait_for_function(BASELINE_FORWARDS + " >= 1")
        if all(count(page, o) for o in finals) or "finished" in page.locator("#status").inner_text():
            break
    assert all(count(page, o) for o in finals), {o.value: count(page, o) for o in finals}
    assert count(page, Outcome.PENDING) == 0
    title = page.locator(f"#token-stream .{chip_class(Outcome.REJECTED)}:not(.unchecked)").first.get_attribute("title")
    assert "α=min(1,p/q)=" in title and " u=" in title and " p=" in title and " q=" in title
    page.wait_for_selector("#detail-plot svg.bars-svg rect")
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


@pytest.mark.parametrize("button", ["#step-btn", "#play-btn"])
def test_the_loading_notice_stays_while_its_step_waits_and_closes_once_the_step_has_run(browser, builtin_pair,
                                                                                          tmp_path, button):
    """A Step (or Play's first tick) that first waits for the default pair to load says so in a notice at once;
    the notice stays while it waits, and its reply closes it (left open, it went on saying the models were
    loading beside their rounds)."""
    import threading

    from playground.registry import ModelRegistry
    from playground.ui import LOADING_NOTICE_OPENS

    draft, target = builtin_pair
    loaded = threading.Event()

    def loader(source, role, device):
        assert loaded.wait(120), "the test never let the models load"
        return draft if role == "draft" else target
    registry = ModelRegistry(loader=loader)
    with launched_app(builtin_pair, tmp_path, max_sessions=2, max_new_tokens=32, registry=registry) as (url, _):
        page = open_page(browser, url, 1440, 1000)
        notice = page.locator(".toast-body", has_text=LOADING_NOTICE_OPENS)
        try:
            page.click(button)
            notice.wait_for(state="visible")
            assert notice.count() == 1 and "Round 1 of" not in page.locator("#status").inner_text()
            loaded.set()
            page.wait_for_function("document.querySelector('#status').innerText.includes('Round 1 of')")
            notice.wait_for(state="hidden")
            if button == "#play-btn":
                page.click("#play-btn")                 # pause
                page.wait_for_function("document.querySelector('#play-btn').innerText.includes('Play')")
            else:
                click_step(page, 2)                    # the pair is loaded now: no notice again
            assert notice.count() == 0
        finally:
            loaded.set()
            page.close()
    registry.close()


def test_play_steps_on_its_own_until_paused(page):
    rounds = page.locator("#token-stream .round-sep").count()
    page.click("#play-btn")
    page.wait_for_function(f"document.querySelector('#status').innerText.includes('Round {rounds + 2} of')")
    assert "Pause" in page.locator("#play-btn").inner_text()
    page.click("#play-btn")
    page.wait_for_function("document.querySelector('#play-btn').innerText.includes('Play')")


# Each plot's drawn width is read off its main SVG and compared with its panel (the component's block).
PLOT_WIDTHS = """ids => ids.map(id => {
  const panel = document.getElementById(id),
        svg = panel && panel.querySelector('.js-plotly-plot svg.main-svg, svg.bars-svg');
  if (!svg) return [id, null, null, null];
  // every title line, annotation and legend entry, measured: plotly does not wrap text, and the panel cuts
  // what overhangs (the Round detail's bars: the axis' numbers, the token labels and the mark in their SVG)
  const box = svg.getBoundingClientRect();
  const texts = panel.querySelectorAll('.gtitle, .g-gtitle text, .annotation-text, .legendtext, svg.bars-svg text');
  const over = Math.max(0, ...Array.from(texts, t => Math.max(box.left - t.getBoundingClientRect().left,
                                                              t.getBoundingClientRect().right - box.right)));
  return [id, box.width, panel.getBoundingClientRect().width, over];
})"""
TABS = {"Charts": [f"chart-{c}" for c in ("acceptance", "per-position", "lengths", "tokens-time", "speedup")],
        "Theory": ["theory-plot", "theory-r", "theory-formats"], "KV cache": ["kv-target", "kv-draft"], "Round detail": ["detail-plot"]}


def wait_for_plots(page, ids: list[str]) -> None:
    page.wait_for_function("ids => ids.every(id => document.querySelector(`#${id} .js-plotly-plot svg.main-svg, "
                           "#${id} svg.bars-svg`))",
                           arg=ids)


def shown_plots_fit(page, tab: str, rounds: int, shots: Path, suffix: str = "", resized: bool = False) -> None:
    """Open `tab`, wait until its plots are drawn (the charts: with all `rounds`), and check that none
    is drawn wider than its panel, which would cut it off on the right."""
    page.get_by_role("tab", name=tab).click()
    wait_for_plots(page, TABS[tab])
    if tab == "Charts":
        page.wait_for_function("n => document.querySelector('#chart-acceptance .js-plotly-plot')?.data?.[0]?.x?.length "
                               "=== n", arg=rounds)
    plots_fit(page, TABS[tab], shots / f"{tab.replace(' ', '-').lower()}{suffix}.png", resized)


def plots_fit(page, ids: list[str], shot: Path, resized: bool = False) -> None:
    """Every plot of `ids` within its panel, and every line of text within its plot. `resized`: the window was
    resized while some of them were hidden; plotly's own resize of those is debounced, so first wait (up to
    10 s, a bound, not a timing) for the panels' widths to reach them."""
    page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")
    if resized:
        with contextlib.suppress(PlaywrightTimeout):   # if they never do, the assertions below say how far off
            page.wait_for_function(f"ids => ({PLOT_WIDTHS})(ids).every(([, d, p]) => d !== null && d <= p + 0.5)",
                                   arg=ids, timeout=10_000)
    widths = page.evaluate(PLOT_WIDTHS, ids)  # before the screenshot: a full-page one resizes the window
    page.screenshot(path=str(shot), full_page=True)
    for plot, drawn, panel, over in widths:
        assert drawn is not None and 0 < drawn <= panel + 0.5, (plot, drawn, panel)
        assert over <= 0.5, f"{plot}: a title or note overhangs its plot by {over:.1f} px ({shot.name})"


def test_plots_drawn_while_their_tab_was_hidden_still_fit_their_panels(browser, url, tmp_path):
    """The Charts tab seen once, then Step and Run to end on the Round detail tab, at 1440 × 1000, then every
    tab again 1024 wide."""
    shots = Path(os.environ.get("SPECPLAY_SHOTS", tmp_path))
    page = open_page(browser, url, 1440, 1000)
    try:
        page.get_by_role("tab", name="Charts").click()
        wait_for_plots(page, TABS["Charts"])
        page.get_by_role("tab", name="Round detail").click()
        for n in range(1, 5):
            click_step(page, n)
        page.click("#run-end-btn")
        page.wait_for_function("document.querySelector('#status').innerText.includes('finished')")
        rounds = int(page.locator("#status").inner_text().split("Round ", 1)[1].split(" of", 1)[0])
        for tab in ("Charts", "Theory", "KV cache", "Round detail"):
            shown_plots_fit(page, tab, rounds, shots)
        page.set_viewport_size({"width": 1024, "height": 900})   # a laptop: the charts wrap, every line still fits
        page.wait_for_function("() => { const s = document.querySelector('#detail-plot svg.bars-svg');"
                               " return s && s.getBoundingClientRect().width < 700; }")
        for tab in ("Round detail", "Charts", "Theory", "KV cache"):
            shown_plots_fit(page, tab, rounds, shots, "-1024", resized=True)
    finally:
        page.close()


def test_charts_drawn_by_play_behind_the_lesson_tab_fit_when_the_playground_returns(browser, url, tmp_path):
    shots = Path(os.environ.get("SPECPLAY_SHOTS", tmp_path))
    page = open_page(browser, url, 1440, 1000)
    drawn_rounds = "() => document.querySelector('#chart-acceptance .js-plotly-plot')?.data?.[0]?.x?.length ?? 0"
    try:
        page.get_by_role("tab", name="Charts").click()
        click_step(page, 1)
        click_step(page, 2)                                    # round 1 is the prefill: nothing drafted yet
        wait_for_rounds(page, drawn_rounds, "=== 2")
        page.click("#play-btn")
        page.get_by_role("tab", name="Lesson").click()       # the playground hidden while Play draws the charts
        wait_for_rounds(page, drawn_rounds, ">= 4")
        page.get_by_role("tab", name="Playground").click()
        page.click("#play-btn")
        page.wait_for_function("document.querySelector('#play-btn').innerText.includes('Play')")
        # a tick still running when Pause was pressed draws once more: Run to end queues behind it, so once the
        # run reads finished and the charts hold all its rounds, nothing is left to draw them again
        page.click("#run-end-btn")
        page.wait_for_function("document.querySelector('#status').innerText.includes('finished')")
        rounds = int(page.locator("#status").inner_text().split("Round ", 1)[1].split(" of", 1)[0])
        wait_for_rounds(page, drawn_rounds, f"=== {rounds}")
        plots_fit(page, TABS["Charts"], shots / "charts-after-play.png")
    finally:
        page.close()


@pytest.fixture(scope="module")
def calibrated_trace(builtin_pair, tmp_path_factory) -> Path:
    """A recorded run whose trace holds a calibration, so that the Theory tab has every curve to draw."""
    from engine.calibration import curve_from_times
    from engine.compared import ComparedRun
    from engine.config import SpecConfig
    from engine.pair import ModelPair

    draft, target = builtin_pair
    path = tmp_path_factory.mktemp("traces") / "calibrated.jsonl"
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    run = ComparedRun(ModelPair(target, draft), prompt, SpecConfig(max_new_tokens=48, seed=3), trace_path=path)
    times = {n: [2.0 + 0.12 * (n - 1)] for n in range(1, 18)}
    run.set_calibration(curve_from_times(target.name, "cpu", "float32", 128, times, 1))
    run.run_to_end()
    run.close()
    return path


def test_the_theory_figures_of_a_replayed_trace_fit_their_panels(page, calibrated_trace, tmp_path):
    shots = Path(os.environ.get("SPECPLAY_SHOTS", tmp_path))
    page.set_viewport_size({"width": 1440, "height": 1000})
    try:
        page.get_by_role("tab", name="Traces").click()
        page.set_input_files("#trace-upload input[type=file]", str(calibrated_trace))
        page.wait_for_function("document.querySelector('#status').innerText.includes('replaying calibrated.jsonl')")
        page.get_by_role("tab", name="Round detail").click()
        page.click("#run-end-btn")
        page.wait_for_function("document.querySelector('#status').innerText.includes('finished')")
        page.get_by_role("tab", name="Theory").click()
        page.wait_for_function("document.querySelectorAll('#theory-plot .js-plotly-plot .scatterlayer .trace')"
                               ".length >= 4")
        page.wait_for_selector("#theory-recommendation table")
        shown_plots_fit(page, "Theory", 0, shots)
        assert "recommended K" in page.locator("#theory-recommendation").inner_text()
    finally:
        page.set_viewport_size({"width": 1500, "height": 1100})


def test_a_deep_hybrid_tree_scrolls_inside_its_panel_with_no_chip_on_another(browser, url, tmp_path):
    """A greedy hybrid tree on a repetitive prompt grows deep: the view scrolls sideways inside the
    Round detail panel instead of spilling out of it, and no chip (the final token included) covers
    another."""
    page = open_page(browser, url, 1100, 1000)
    page.locator("#drafter-radio label", has_text="else the draft model").click()
    page.fill("#prompt-box textarea", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef")
    page.fill("#tree-box textarea, #tree-box input", "N24d16")
    temperature = page.get_by_label("Temperature (0 = greedy)").first
    temperature.fill("0")
    temperature.press("Enter")
    page.click("#reset-btn")
    page.wait_for_function("document.querySelector('#status').innerText.includes('Round 0 of')")
    geometry = None
    for n in range(1, 25):
        click_step(page, n)
        if not page.locator("#tree-view .tree-scroll").count():
            continue   # the prefill round drafts nothing
        geometry = page.evaluate("""() => {
            const view = document.querySelector('#tree-view'), scroll = view.querySelector('.tree-scroll');
            const chips = [...scroll.querySelectorAll('.chip')].map(c => c.getBoundingClientRect());
            const overlaps = chips.some((a, i) => chips.some((b, j) => j > i && a.left < b.right - 1 &&
                b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1));
            const viewRight = view.getBoundingClientRect().right;
            const clipped = ['auto', 'scroll'].includes(getComputedStyle(scroll).overflowX);
            return {depth: new Set([...scroll.querySelectorAll('.chip')].map(c => c.style.left)).size - 1,
                    beyond: chips.some(c => c.right > viewRight + 1), clipped, overlaps,
                    scrollWidth: scroll.scrollWidth, clientWidth: scroll.clientWidth};
        }""")
        assert not geometry["overlaps"], (n, geometry)
        if geometry["beyond"]:
            break
    assert geometry["beyond"], geometry                                  # wider than the panel...
    assert geometry["clipped"] and geometry["scrollWidth"] > geometry["clientWidth"], geometry   # ...so it scrolls
    page.locator("#tree-view").screenshot(path=str(tmp_path / "tree.png"))
    page.close()


def test_the_live_engine_page_watches_a_server_and_its_charts_fit(browser, url, tmp_path):
    """The Live engine tab against a real vLLM /metrics body served on loopback, whose counters grow between
    two readings (tests/data)."""
    from tests.test_watch import Serving, body, scaled

    shots = Path(os.environ.get("SPECPLAY_SHOTS", tmp_path))
    served = Serving(scaled(body(), 0.5))
    page = open_page(browser, url, 1440, 1000)
    try:
        page.get_by_role("tab", name="Live engine").click()
        page.fill("#live-url textarea, #live-url input", served.url)
        page.fill("#live-interval input", "1")
        page.click("#live-watch")
        page.wait_for_function("document.querySelector('#live-summary').innerText.includes('Watching')")
        served.text = body()
        # an interval with drafts in it: on a busy machine the page's 1 s timer can read the halved body a second
        # time before the line above runs, and that interval drafted nothing
        page.wait_for_function("(() => { const t = document.querySelector('#live-summary').innerText;"
                               " return t.includes('intervals') && !t.includes('began: 0 drafts'); })()")
        summary = page.locator("#live-summary").inner_text()
        assert "acceptance rate 0.189" in summary     # the capture's counters halved: Δaccepted 14 / Δdraft tokens 74
        page.click("#live-stop")
        ids = ["live-acceptance", "live-per-position", "live-throughput", "live-prediction"]
        wait_for_plots(page, ids)
        plots_fit(page, ids, shots / "live-engine.png")
    finally:
        page.close()
        served.close()

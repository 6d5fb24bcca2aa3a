"""The event handlers without a server: what each event renders, and what a failed Reset shows."""
from __future__ import annotations

import json
import threading
from dataclasses import astuple, replace

import gradio as gr
import plotly.graph_objects as go
import pytest

from playground.controller import Context, DecodeRequest
from playground.registry import ModelRegistry
from playground.sessions import SessionPool
from playground.settings import AppSettings
from playground.ui import Handlers
from playground.view import Panel

# Positions in a handler's reply: the session, then `Pages.frame_outputs`.
STATUS, STREAM, BADGE, SUMMARY, POSITION, DETAIL, TREE, KV_TARGET, KV_DRAFT, KV_TABLE = range(1, 11)
ACCEPTANCE, PER_POSITION, LENGTHS, TOKENS_TIME, SPEEDUP, SCRUBBER = range(11, 17)
BY_PANEL = {Panel.DETAIL: (BADGE, SUMMARY, POSITION, DETAIL, TREE), Panel.KV: (KV_TARGET, KV_DRAFT, KV_TABLE),
            Panel.CHARTS: (ACCEPTANCE, PER_POSITION, LENGTHS, TOKENS_TIME, SPEEDUP)}
SKIPPED = gr.skip()
NO_PROGRESS = lambda *args, **kwargs: None   # what gradio passes as `progress` is not used outside an event


def values(**changes) -> tuple:
    """The controls' values, in the order the events take them (DecodeRequest's fields)."""
    request = DecodeRequest(prompt="def fibonacci(n):\n", preset="default", custom_draft="", custom_target="",
                            mode="v2", drafter="model", k=4.0, k_schedule="constant", k_min=1.0, k_max=8.0,
                            temperature=1.0, top_k=0.0, top_p=1.0, seed=3.0, max_new_tokens=12.0)
    return astuple(replace(request, **changes))


@pytest.fixture
def handlers(builtin_pair, tmp_path) -> Handlers:
    draft, target = builtin_pair
    registry = ModelRegistry(loader=lambda source, role, device: draft if role == "draft" else target)
    pool = SessionPool(2, 64 * 2**20, 60.0, root=tmp_path)
    yield Handlers(Context(registry, pool, AppSettings(max_sessions=2, max_new_tokens=64)))
    pool.shutdown()


def drawn(out: tuple) -> set[Panel]:
    """The panels whose outputs the reply carries (all of a panel's, or none)."""
    shown = set()
    for panel, slots in BY_PANEL.items():
        skipped = [out[i] == SKIPPED for i in slots]
        assert all(skipped) or not any(skipped), panel
        if not any(skipped):
            shown.add(panel)
    return shown


def test_each_event_draws_the_shown_tab_and_leaves_the_hidden_ones(handlers):
    out = handlers.on_step(None, None, False, *values())
    session = out[0]
    assert "Round 1 of 1" in out[STATUS] and drawn(out) == {Panel.DETAIL}
    assert 'class="bars-svg"' in out[DETAIL] and "round 1, final token" in out[DETAIL]
    out = handlers.on_show(Panel.CHARTS)(None, session)
    assert drawn(out) == {Panel.CHARTS} and isinstance(out[SPEEDUP], go.Figure)
    out = handlers.on_step(None, session, False, *values())
    assert "Round 2 of 2" in out[STATUS] and drawn(out) == {Panel.CHARTS}
    assert list(out[ACCEPTANCE].data[0].x) == [1, 2]            # the charts are up to date with round 2
    out = handlers.on_show(Panel.KV)(None, session)
    assert drawn(out) == {Panel.KV} and "block table" in out[KV_TABLE]
    out = handlers.on_show(Panel.OTHER)(None, session)
    assert drawn(out) == set() and "Round 2 of 2" in out[STATUS]
    out = handlers.on_show(Panel.DETAIL)(None, session)
    assert drawn(out) == {Panel.DETAIL} and "Round 2 of 2" in out[STATUS]


def test_the_status_line_says_what_the_target_multiplies_with_and_where_its_layers_run(handlers, builtin_pair):
    target = builtin_pair[1]
    assert target.layers_in in ("C++", "Python")                         # the built-in target has a fused forward
    out = handlers.on_step(None, None, False, *values())
    assert f"(fp32 weights, layers in {target.layers_in})" in out[STATUS]


def test_a_step_from_the_page_leaves_the_baseline_for_after_the_drawing(handlers):
    """The page's Step returns its round before the target-only rounds run, and leaves what reads them (badge,
    summary, charts) as they are; the catch-up the page calls next runs them and draws those, nothing else. The
    API's Step does both in one reply."""
    out = handlers.on_step(None, None, False, *values())               # as an API call: level at once
    session = out[0]
    assert not session.run.behind and drawn(out) == {Panel.DETAIL}
    out = handlers.on_page_step(None, session, False, *values())
    assert "Round 2 of 2" in out[STATUS] and "round 2, " in out[DETAIL] and session.run.behind
    assert out[BADGE] == out[SUMMARY] == SKIPPED
    behind = len(session.run.baseline.generated)
    out = handlers.on_catch_up(None, session)
    assert out[0] is session and not session.run.behind and len(session.run.baseline.generated) > behind
    assert f"/ {len(session.run.baseline.rounds)}<" in out[SUMMARY]    # target forwards: spec / target-only
    assert "identical" in out[BADGE] or "not expected" in out[BADGE]
    assert all(out[i] == SKIPPED for i in (STATUS, STREAM, POSITION, DETAIL, TREE, SCRUBBER))   # what it leaves
    again = handlers.on_catch_up(None, session)                        # nothing behind: the same drawing
    assert not session.run.behind and again[SUMMARY] == out[SUMMARY]
    handlers.on_show(Panel.CHARTS)(None, session)
    out = handlers.on_page_step(None, session, False, *values())
    assert all(out[i] == SKIPPED for i in (ACCEPTANCE, PER_POSITION, LENGTHS, TOKENS_TIME, SPEEDUP))
    out = handlers.on_catch_up(None, session)
    assert list(out[ACCEPTANCE].data[0].x) == [1, 2, 3] and isinstance(out[SPEEDUP], go.Figure)
    handlers.on_page_step(None, session, False, *values())
    with session.hold("Reset", 0.0):                                  # busy: left as drawn, for the next Step
        assert handlers.on_catch_up(None, session)[1:] == (SKIPPED,) * 16 and session.run.behind
    handlers.on_page_step(None, session, False, *values())            # which catches up first
    run = session.run
    assert len(run.baseline.generated) >= len(run.spec.generated) - len(run.spec.rounds[-1].emitted)


def test_the_catch_up_waits_behind_a_quick_event_and_a_step_waits_behind_the_catch_up(handlers):
    """A tab shown or a scrub holding the session when the catch-up comes is waited for (skipped, the charts
    would stay a round behind until the next Step); a Step arriving during a catch-up waits for it, not refused."""
    session = handlers.on_step(None, None, False, *values())[0]
    handlers.on_show(Panel.CHARTS)(None, session)
    handlers.on_page_step(None, session, False, *values())
    held, release = threading.Event(), threading.Event()

    def hold(name: str) -> None:
        with session.hold(name, 0.0):
            held.set()
            release.wait(5.0)

    for name, then in (("showing a tab", handlers.on_catch_up), ("catching up", None)):
        worker = threading.Thread(target=hold, args=(name,))
        held.clear(), release.clear()
        worker.start()
        held.wait(5.0)
        threading.Timer(0.3, release.set).start()
        if then is not None:
            out = then(None, session)
            assert not session.run.behind and list(out[ACCEPTANCE].data[0].x) == [1, 2]
        else:
            out = handlers.on_page_step(None, session, False, *values())
            assert "Round 3 of 3" in out[STATUS], out[STATUS]
        worker.join()


def test_export_right_after_a_pages_step_holds_every_target_only_round(handlers):
    session = handlers.on_step(None, None, False, *values())[0]
    handlers.on_page_step(None, session, False, *values())
    assert session.run.behind
    trace, csv = handlers.on_export(session)
    assert not session.run.behind and csv.endswith(".csv")
    lines = [json.loads(line) for line in open(trace, encoding="utf-8")]
    baseline = [line for line in lines if line.get("stream") == "baseline"]
    assert baseline and len(baseline) == len(session.run.baseline.rounds)


def test_the_pages_catch_up_is_never_dropped_behind_a_pending_one(handlers):
    """Gradio drops an event's second call while its first is pending (trigger mode "once"): the catch-up of
    a quick second Step would be lost while the first catch-up's reply is still being drawn."""
    from playground.ui import build_app

    catch_ups = [f for f in build_app(handlers.ctx).fns.values() if getattr(f.fn, "__name__", "") == "on_catch_up"]
    assert len(catch_ups) == 1 and catch_ups[0].trigger_mode == "always_last"


def test_a_tab_that_draws_nothing_from_a_run_opens_no_session(handlers):
    out = handlers.on_show(Panel.OTHER)(None, None)
    assert out[0] is None and len(handlers.ctx.pool) == 0
    out = handlers.on_show(Panel.CHARTS)(None, None)     # the charts tab is remembered for the first Step
    assert out[0].panel is Panel.CHARTS and len(handlers.ctx.pool) == 1


def test_a_failed_reset_says_so_above_the_run_it_leaves_on_screen(handlers):
    session = handlers.on_step(None, None, False, *values())[0]
    before = handlers.on_step(None, session, False, *values())[STATUS]
    with pytest.warns(UserWarning, match="The prompt is empty"):
        out = handlers.on_reset(None, NO_PROGRESS, session, *values(prompt="   "))
    assert out[STATUS].startswith("**⚠ Reset failed: The prompt is empty")
    assert "** **Previous run** — the last Reset failed (The prompt is empty" in out[STATUS]
    assert "Step will not continue it" in out[STATUS] and "**Round 2 of 2**" in out[STATUS] and "Round 2 of 2" in before
    with pytest.warns(UserWarning, match="This is the previous run"):
        stepped = handlers.on_step(None, session, False, *values())[STATUS]   # Step does not continue it
    assert "**Round 2 of 2**" in stepped and "⚠ Reset failed" not in stepped
    out = handlers.on_reset(None, NO_PROGRESS, session, *values())
    assert out[STATUS].startswith("**Round 0 of 0**")


def test_a_step_never_waits_in_the_decoding_slot_for_its_sessions_slow_reset(handlers):
    """A Reset still loading (a hung Hub read) holds the session: a Step is refused at once, saying so, and
    leaves every view as drawn; behind a quick event (a scrub) it waits for the lock instead."""
    session = handlers.on_step(None, None, False, *values())[0]
    holding, release = threading.Event(), threading.Event()

    def hold(name: str) -> None:
        with session.hold(name, 0):
            holding.set()
            release.wait(60)

    worker = threading.Thread(target=hold, args=("Reset",), daemon=True)
    worker.start()
    assert holding.wait(60)
    with pytest.warns(UserWarning, match="This session is busy"):
        out = handlers.on_step(None, session, False, *values())
    release.set()
    worker.join(60)
    assert out[STATUS] == ("**⚠ Step refused: This session is busy: Reset is still running. Try Step again when it "
                           "has finished.**")
    assert all(v == SKIPPED for v in out[STATUS + 1:])
    holding.clear(), release.clear()
    worker = threading.Thread(target=hold, args=("Scrub",), daemon=True)
    worker.start()
    assert holding.wait(60)
    threading.Timer(0.2, release.set).start()
    assert "Round 2 of 2" in handlers.on_step(None, session, False, *values())[STATUS]
    worker.join(60)


def test_a_refused_step_says_so_in_the_status_line(handlers):
    """An API caller reads no warning toast: the status line itself says what was refused and why."""
    with pytest.warns(UserWarning, match="K must be"):
        out = handlers.on_step(None, None, False, *values(k=0.0))
    assert out[STATUS].startswith("**⚠ Step refused: K must be")


def test_a_new_page_shows_the_recorded_welcome_run_until_its_first_step(handlers):
    """The first page is a finished example, drawn at once with no session opened; the first Step starts the
    visitor's own live run."""
    from engine.trace import load_trace
    from playground.make_examples import WELCOME, WELCOME_QUESTION, welcome_config
    from playground.pages.traces import EXAMPLES_DIR
    from playground.registry import CHAT_EXAMPLES
    from playground.ui import WELCOME_NOTE, welcome_cursor
    from playground.view import view_from_trace

    trace = load_trace(EXAMPLES_DIR / f"{WELCOME}.jsonl")
    assert trace.complete and trace.config == welcome_config()   # recorded as the pair recommends
    assert trace.calibration is not None and trace.calibration.model == "smollm2"   # so its prediction shows
    handlers.welcome = view_from_trace(trace, f"{WELCOME}.jsonl")
    shown = welcome_cursor(handlers.welcome).shown
    def every_outcome(rounds) -> bool:    # a round with every draft accepted (a bonus), and one with a rejection
        return any(r.k and r.accepted == r.k for r in rounds) and any(r.accepted < r.k for r in rounds)
    assert every_outcome(trace.rounds[:shown]) and not every_outcome(trace.rounds[: shown - 1])
    assert trace.header.chat.user == WELCOME_QUESTION == CHAT_EXAMPLES[0]       # the page's default prompt
    from engine.metrics import Prediction

    assert isinstance(handlers.welcome.prediction(), Prediction)
    out = handlers.on_load(None)
    assert out[0].startswith(WELCOME_NOTE) and f"Round {shown} of {len(trace.rounds)}" in out[0]
    assert f"recorded on {trace.header.machine}" in out[0] and trace.header.machine   # the figures' machine, named
    assert f"round {shown}, " in out[DETAIL - 1] and out[STREAM - 1].count('class="round-sep"') == shown
    assert handlers.on_show(Panel.DETAIL)(None, None)[STATUS].startswith(WELCOME_NOTE)   # fired as a page loads
    assert len(handlers.ctx.pool) == 0
    with pytest.warns(UserWarning, match=f"replay '{WELCOME.replace('_', ' ')}' from Example traces to export it"):
        assert handlers.on_export(None) is None                     # the run on screen is the recorded one
    session, theory, r_curve, *_ = handlers.on_theory(None, None)  # Theory draws it too
    assert theory.data and r_curve.data and session.view() is None
    with pytest.warns(UserWarning, match="needs a live run; the run shown is recorded in advance"):
        handlers.on_lab(None, None, "correct", 100, 0, True, 1, 1)   # the lab cannot re-run a recorded round
    # Back and the scrubber move through the welcome run (the session takes it over as a replay)...
    back = handlers.on_back(None, None)
    assert back[STATUS].startswith(WELCOME_NOTE) and f"Round {shown - 1} of {len(trace.rounds)}" in back[STATUS]
    scrubbed = handlers.on_scrub(None, back[0], 9)
    assert scrubbed[STATUS].startswith(WELCOME_NOTE) and f"Round 9 of {len(trace.rounds)}" in scrubbed[STATUS]
    assert scrubbed[STREAM].count('class="round-sep"') == 9
    assert handlers.on_export(scrubbed[0])[0].endswith(f"{WELCOME}.jsonl")   # and export hands over its trace
    # ...and Step still starts the visitor's own live run, as the welcome note says
    stepped = handlers.on_step(None, None, False, *values())
    assert "Round 1 of 1" in stepped[STATUS] and WELCOME_NOTE not in stepped[STATUS]
    assert not handlers.on_load(stepped[0])[0].startswith(WELCOME_NOTE)   # a page with a session shows that

"""Composes the pages into one gr.Blocks and wires every event to the controller.

Each handler finds the visitor's session (the SessionPool's, keyed by Gradio's session hash and
bounded per client address), runs one controller action under the session's lock, and renders a
Frame of the tab shown (the others are rendered when their tab is selected). Anything a visitor can
get wrong becomes a gr.Warning; the session and the server keep working. Serving it (heartbeats,
sweeping, shutdown) is playground.serve's job.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from engine.records import RoundRecord
from engine.sources import SMOLLM2
from engine.trace import MAX_TRACE_BYTES, TraceError, load_trace
from playground import controller
from playground.connections import client_address, heartbeat_middleware
from playground.controller import USER_ERRORS, Context, DecodeRequest
from playground.controls import Controls, build_controls, preset_defaults
from playground.inputs import as_int, as_number, as_seed
from playground.pages import batch as page_batch
from playground.pages import charts as page_charts
from playground.pages import compare as page_compare
from playground.pages import detail as page_detail
from playground.pages import kv as page_kv
from playground.pages import lab as page_lab
from playground.pages import lesson as page_lesson
from playground.pages import live as page_live
from playground.pages import stream as page_stream
from playground.pages import theory as page_theory
from playground.pages import traces as page_traces
from playground.registry import Deadlines, ModelRegistry
from playground.render.fit import FIT_SHOWN_PLOTS_JS
from playground.render.frame import failure_status, render_frame
from playground.render.palette import stylesheet
from playground.sessions import Session, SessionBusy, SessionPool
from playground.settings import AppSettings, default_pair
from playground.spaces_shim import gpu
from playground.teach.lab import MAX_TRIALS, run_lab, token_texts
from playground.view import Cursor, Panel, RunView, view_from_trace

log = logging.getLogger("specplay")
TITLE = "specplay: speculative decoding, one round at a time"
FRAME_OUTPUTS = 16        # len(Pages.frame_outputs())
BASELINE_OUTPUTS = {2, 3, *range(10, 15)}   # of those, the ones the target-only run changes: badge, summary, charts
PROGRESS_EVERY_S = 2.0    # Run to end updates its progress bar this long after it starts, then as often
# Events that decode in the shared slot ("decode" group) never wait there for their session's lock while a slow
# event (a Reset loading models, a long run) holds it: they are refused at once. Behind a quick event (a scrub,
# a tab) they wait QUICK_WAIT_S at most; other events wait EVENT_WAIT_S for the event before them.
DECODING = ("Step", "Run to end", "Play")
SLOW = ("Reset", "Run to end", "Step", "Play", "Lab")
CATCHING_UP = "catching up"   # the page's catch-up after a Step: quick, so a Step waits for it
QUICK_WAIT_S, EVENT_WAIT_S = 1.0, 10.0


def lock_wait(name: str, session: Session) -> float:
    """How long event `name` may wait for `session`'s lock (see DECODING)."""
    if name in DECODING:
        return 0.0 if session.holder in SLOW else QUICK_WAIT_S
    return EVENT_WAIT_S


def refused(name: str, exc: BaseException) -> None:
    """A visitor's input refused: a warning for them, and one log line (never a traceback) for the operator."""
    log.info("refused %s: %s", name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    gr.Warning(str(exc))


@dataclass(frozen=True)
class Pages:
    controls: Controls
    stream: page_stream.StreamPanel
    detail: page_detail.DetailPage
    kv: page_kv.KVPage
    charts: page_charts.ChartsPage
    traces: page_traces.TracesPage

    def frame_outputs(self) -> list:
        """In the order `Handlers.render` returns values."""
        d, k, c = self.detail, self.kv, self.charts
        return [self.stream.status, self.stream.stream, d.badge, d.summary, d.position, d.detail, d.tree, k.target,
                k.draft, k.table, c.acceptance, c.per_position, c.lengths, c.tokens_time, c.speedup,
                self.controls.scrubber]


class Handlers:
    """The event functions. One instance per app; per-visitor state lives only in gr.State."""

    def __init__(self, ctx: Context, welcome: RunView | None = None) -> None:
        self.ctx, self.welcome = ctx, welcome

    # -- plumbing -----------------------------------------------------------------------------------
    def render(self, session: Session | None, failure: str | None = None) -> tuple:
        """Every frame output, in `Pages.frame_outputs` order: the stream panel and the shown tab's views.
        The hidden tabs' outputs are skipped (left as drawn); selecting a tab renders it (`on_show`). Until
        a visitor's first run, the recorded welcome run is what they see (`welcome`)."""
        view = session.view() if session is not None else None
        panel = session.panel if session is not None else Panel.DETAIL
        if view is None and failure is None and self.welcome is not None:
            return self.render_view(self.welcome, welcome_cursor(self.welcome), panel, note=WELCOME_NOTE)
        note = WELCOME_NOTE if self.on_welcome(session) and failure is None else ""
        return self.render_view(view, session.cursor if session is not None else Cursor(), panel, failure, note)

    def on_welcome(self, session: Session | None) -> bool:
        """Whether the session holds the welcome run, taken over by a visitor's Back, scrub or chip click."""
        return session is not None and self.welcome is not None and session.replay is self.welcome

    def navigating(self, action: Callable[[Session], str | None]) -> Callable[[Session], str | None]:
        """`action` (Back, scrub, a chip or position pick) on the run the page shows: before a visitor's first
        run that is the welcome run, which the session takes over as a replay at the round shown."""
        def act(session: Session) -> str | None:
            if session.view() is None and self.welcome is not None:
                controller.adopt_replay(session, self.welcome, welcome_cursor(self.welcome),
                                        page_traces.EXAMPLES_DIR / self.welcome.source)
            return action(session)
        return act

    def decoding(self, action: Callable[[Session], str | None]) -> Callable[[Session], str | None]:
        """`action` (Step, Play, Run to end) from the welcome run starts the visitor's own live run, as its
        note says, even after Back or a chip click took the welcome run over."""
        def act(session: Session) -> str | None:
            if self.on_welcome(session):
                session.drop_run()
            return action(session)
        return act

    @staticmethod
    def render_view(view: RunView | None, cursor: Cursor, panel: Panel, failure: str | None = None,
                    note: str = "") -> tuple:
        """`render` for a view and cursor; `note` heads the status line."""
        f = render_frame(view, cursor, (panel,), failure)
        d, k, c = f.detail, f.kv, f.charts
        detail = (d.badge, d.summary, gr.Dropdown(choices=d.positions, value=d.position), d.detail, d.tree) if d \
            else _skip(5)
        kv = (k.target, k.draft, k.table) if k else _skip(3)
        charts = (c.acceptance, c.per_position, c.lengths, c.tokens_time, c.speedup) if c else _skip(5)
        s = f.stream
        return (note + s.status, s.stream, *detail, *kv, *charts,
                gr.Slider(minimum=0, maximum=max(1, s.rounds_total), value=s.shown, step=1))

    def _session(self, state: Session | None, request: gr.Request) -> Session:
        """The visitor's session, renewed; a fresh one if it was reclaimed. `state` (the gr.State copy) is
        only ever the pool's own session or a reclaimed one, so the pool, keyed by Gradio's session hash,
        decides."""
        key = request.session_hash if request is not None and request.session_hash else "anonymous"
        return self.ctx.pool.open(key, client_address(request, self.ctx.settings.proxy_hops))

    def guarded(self, state: Session | None, request: gr.Request, action: Callable[[Session], str | None],
                failed: str | None = None, *, name: str = "this action") -> tuple:
        """(state, *frame) after running `action` (`name`: "Step", "Reset", ...); errors become warnings,
        logged in one line each, and leave the session usable. The status line heads with `failed` ("Reset
        failed"), else "<name> refused", when the action fails, so that the run still on screen is not taken
        for its result (an API caller reads only that line)."""
        failed = failed or f"{name} refused"
        try:
            session = self._session(state, request)
        except USER_ERRORS as exc:
            refused(name, exc)
            return (state, *self.render(state, _failure(failed, str(exc))))
        try:
            with session.hold(name, lock_wait(name, session)):
                failure = None
                try:
                    note = action(session)
                    if note:
                        gr.Info(note)
                except USER_ERRORS as exc:
                    refused(name, exc)
                    failure = _failure(failed, str(exc))
                except Exception as exc:  # a bug, not bad input: log it, tell the visitor briefly, keep going
                    log.exception("unexpected error in a playground action")
                    gr.Warning(f"Unexpected error ({type(exc).__name__}: {exc}). Press Reset to start again.")
                    failure = _failure(failed, f"unexpected error ({type(exc).__name__})")
                return (session, *self.render(session, failure))
        except SessionBusy as exc:   # the session's own earlier event still runs: what it shows stays as it is
            refused(name, exc)
            return (session, failure_status(f"{failed}: {exc}"), *_skip(FRAME_OUTPUTS - 1))

    def read(self, state: Session | None, request: gr.Request, action: Callable[[Session], tuple],
             fallback: Callable[[str], tuple], name: str = "this page") -> tuple:
        """(state, *outputs) of a page that reads the session (Theory, Lab): `action` runs under the
        session's lock like every event; a user error shows as a warning and `fallback(message)`."""
        try:
            session = self._session(state, request)
            with session.hold(name, lock_wait(name, session)):
                return (session, *action(session))
        except USER_ERRORS as exc:
            refused(name, exc)
            return (state, *fallback(str(exc)))
        except Exception as exc:  # a bug: log it, keep the page usable
            log.exception("unexpected error in a playground page")
            gr.Warning(f"Unexpected error ({type(exc).__name__}: {exc}).")
            return (state, *fallback(f"Unexpected error ({type(exc).__name__})."))

    def on_theory(self, request: gr.Request, state: Session | None) -> tuple:
        def show(session: Session) -> tuple:
            controller.show(session, Panel.OTHER)
            view = controller.theory_view(self.ctx, session)
            if view is None and self.welcome is not None:   # before a first run the page shows the welcome run
                view = self.welcome.upto(welcome_cursor(self.welcome).shown)
            return page_theory.render(view)
        return self.read(state, request, show, lambda message: page_theory.render(None), "Theory")

    def on_remeasure(self, request: gr.Request, state: Session | None) -> tuple:
        def start(session: Session) -> tuple:
            gr.Info(controller.remeasure(self.ctx, session))
            return page_theory.render(controller.theory_view(self.ctx, session))
        return self.read(state, request, start, lambda message: page_theory.render(None), "Re-measure")

    def on_show(self, panel: Panel) -> Callable[..., tuple]:
        """The select event of a tab: render `panel` now and on every event until another tab is shown.
        A tab that draws nothing from a run opens no session (Compare works without one, even when the
        server is full), and neither does the first tab's select event, which Gradio fires as every page
        loads: a page view alone takes no session."""
        def show(request: gr.Request, state: Session | None) -> tuple:
            if state is None and panel in (Panel.OTHER, Panel.DETAIL):   # nothing to remember: DETAIL is the default
                return (state, *self.render(None))
            return self.guarded(state, request, lambda s: controller.show(s, panel), name="showing a tab")
        return show

    def on_lab(self, request: gr.Request, state: Session | None, rule: str, trials: float, seed: float,
               auto: bool, start: float, length: float) -> tuple:
        def run(session: Session) -> tuple:
            if session.view() is None and self.welcome is not None:   # the round on screen is the welcome run's
                raise ValueError("The lab re-runs the selected round's forwards, so it needs a live run; the run "
                                 "shown is recorded in advance. Press Step ▶ to start yours.")
            rows, decode = controller.lab_rows(session)
            window = (None, None) if auto else (as_int("First draft", start, 1) - 1, as_int("Drafts", length, 1))
            result = run_lab(rows, rule, as_int("N", trials, 1, MAX_TRIALS), as_seed(seed), *window)
            return page_lab.render(result, token_texts(result, decode))
        return self.read(state, request, run, page_lab.blank, "Lab")

    def decode_request(self, values: tuple) -> DecodeRequest:
        return DecodeRequest(*values)

    def loading_notice(self, values: tuple) -> str | None:
        """A Step or Play tick from the page that will first wait for the server's default pair to load (its first
        minute on a new machine) says so at once, in a notice: the page shows no timer for them where the browser
        runs beside the server (see `_wire`). Returns the notice, or None when the pair is loaded (or the request
        names another pair, which a Step does not load: it says so itself)."""
        default = self.ctx.registry.presets[0].key
        if self.decode_request(values).preset != default or self.ctx.registry.ready(default):
            return None
        gr.Info(LOADING_NOTICE, duration=None)
        return LOADING_NOTICE

    # -- events -------------------------------------------------------------------------------------
    def on_load(self, state: Session | None) -> tuple:
        """A new page shows the welcome run at once, finished and drawn (no session is opened for it)."""
        return self.render(state)

    @gpu()
    def on_reset(self, request: gr.Request, progress=gr.Progress(track_tqdm=True), state: Session | None = None,
                 *values) -> tuple:
        """Reset; a first load of SmolLM2 converts its GGUF once, and its progress bar shows here."""
        return self.guarded(state, request, lambda s: controller.reset(self.ctx, s, self.decode_request(values)),
                            failed="Reset failed", name="Reset")

    @gpu()
    def on_step(self, request: gr.Request, state: Session | None, reveal: bool, *values) -> tuple:
        """Step, as the API calls it: the round and the target-only rounds level with it."""
        return self.guarded(state, request, self.decoding(
            lambda s: controller.step(self.ctx, s, self.decode_request(values), bool(reveal))), name="Step")

    @gpu()
    def on_page_step(self, request: gr.Request, state: Session | None, reveal: bool, *values) -> tuple:
        """Step, as the page's button calls it: the round alone, its target-only rounds left for `on_catch_up`,
        which the page calls once it has drawn the round, and which draws what reads them (left as they are
        here, so that the Charts tab's figures are drawn once a Step, not twice)."""
        self.loading_notice(values)
        out = self.guarded(state, request, self.decoding(
            lambda s: controller.step(self.ctx, s, self.decode_request(values), bool(reveal), catch_up=False)),
            name="Step")
        return (out[0], *_baseline_part(out[1:], keep=False))

    @gpu()
    def on_catch_up(self, request: gr.Request, state: Session | None) -> tuple:
        """The target-only rounds a page's Step left for after the page drew its round, then what reads them
        (the identity badge, the summary's speed-up, the charts), which that Step left undrawn; nothing else."""
        try:
            session = self._session(state, request)
            # behind a slow event (a Reset, a run, the next Step) it is left to that event, which draws it all;
            # behind a quick one (a tab shown, a scrub) it waits, so the charts never stay a round behind
            with session.hold(CATCHING_UP, lock_wait("Step", session)):
                controller.catch_up(self.ctx, session)
                frame = self.render(session)
                return (session, *_baseline_part(frame, keep=True))
        except (SessionBusy, *USER_ERRORS):
            return (state, *_skip(FRAME_OUTPUTS))
        except Exception:  # a bug: logged; the round on screen stays, and the next Step catches up
            log.exception("unexpected error catching up the target-only baseline")
            return (state, *_skip(FRAME_OUTPUTS))

    @gpu(duration=120)
    def on_run_to_end(self, request: gr.Request, progress=gr.Progress(), state: Session | None = None,
                      *values) -> tuple:
        last = [time.monotonic()]

        def report(done: int, total: int) -> None:
            # a progress update is work for the server's event loop and the page while the next round is timed:
            # after every round it held SmolLM2's default run at 1.03x where the engine's bench measures 1.24x
            # (1.10-1.14x at two a second, 1.17-1.24x with none), so a run shorter than PROGRESS_EVERY_S sends none
            if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
                last[0] = time.monotonic()
                progress((done, total), desc="decoding", unit="tokens")

        return self.guarded(state, request, self.decoding(
            lambda s: controller.run_to_end(self.ctx, s, self.decode_request(values), report)), name="Run to end")

    def on_back(self, request: gr.Request, state: Session | None) -> tuple:
        return self.guarded(state, request, self.navigating(controller.back), name="Back")

    def on_scrub(self, request: gr.Request, state: Session | None, shown: float) -> tuple:
        return self.guarded(state, request, self.navigating(lambda s: controller.scrub(s, shown)), name="Scrub")

    def on_position(self, request: gr.Request, state: Session | None, position: int | None) -> tuple:
        def pick(s: Session) -> None:
            view = s.view()
            selection = s.cursor.selection(view) if view is not None else None
            if selection is not None and position is not None:
                controller.select(s, selection[0], as_int("Position", position, 0))
        return self.guarded(state, request, self.navigating(pick), name="Position")

    def on_chip(self, request: gr.Request, evt: gr.EventData, state: Session | None) -> tuple:
        round_index, position = getattr(evt, "round", None), getattr(evt, "position", None)
        if not isinstance(round_index, int) or not isinstance(position, int):
            return (state, *self.render(state))
        return self.guarded(state, request, self.navigating(lambda s: controller.select(s, round_index, position)),
                            name="Select")

    def on_trace(self, request: gr.Request, state: Session | None, path: str | None) -> tuple:
        if not path:
            return (state, *self.render(state))
        name = path.rsplit("/", 1)[-1]
        return self.guarded(state, request, lambda s: controller.load_replay(s, path, name), name="Replay")

    @gpu()
    def on_export(self, state: Session | None) -> list[str] | None:
        """The run's trace and its rounds as CSV; a page's Step left behind is caught up first, so that the trace
        holds the target-only rounds of every round shown."""
        try:
            if state is None or state.view() is None:
                if self.welcome is not None:   # the page shows the welcome run: say where its trace is
                    raise ValueError(f"This is the example run recorded in advance: replay "
                                     f"'{page_traces.example_label(self.welcome.source)}' from Example traces to "
                                     f"export it, or press Step ▶ to start your own run.")
                raise ValueError("Nothing to export yet: step a few rounds first.")
            with state.hold("Export", EVENT_WAIT_S):
                controller.catch_up(self.ctx, state)
                csv = controller.export_rounds_csv(state)
            # a replayed upload may have been deleted from Gradio's cache meanwhile (UPLOAD_AGE_S)
            return [str(p) for p in (state.trace_path, csv) if p is not None and p.exists()]
        except USER_ERRORS as exc:
            refused("Export", exc)
            return None

    @gpu()
    def on_tick(self, request: gr.Request, state: Session | None, playing: bool, *values) -> tuple:
        """One Play tick: a Step that also stops the timer when the run ends or fails."""
        if not playing:  # a tick already queued when Pause was pressed: what is on screen stays as it is
            return (state, *_skip(FRAME_OUTPUTS), *play_controls(False))
        notes: list[str | None] = []
        self.loading_notice(values)
        out = self.guarded(state, request, self.decoding(
            lambda s: notes.append(controller.step(self.ctx, s, self.decode_request(values)))), name="Play")
        session = out[0]
        view = session.view() if session is not None else None
        done = view is None or session.previous is not None or bool(notes and notes[0]) or (
            session.cursor.shown >= len(view.rounds) and view.complete)
        # a tick only ever stops Play: one still running when Pause was pressed must not start it again
        return (*out, *(play_controls(False) if done else _skip(3)))

    @staticmethod
    def on_play(playing: bool, speed: object) -> tuple:
        return play_controls(not playing, play_speed(speed))

    @staticmethod
    def on_speed(speed: object, playing: bool) -> gr.Timer:
        return gr.Timer(value=play_speed(speed), active=bool(playing))

    def on_unload(self, request: gr.Request) -> None:
        self.ctx.pool.close_key(request.session_hash)


def play_speed(value: object) -> float:
    """Seconds per Play step; a value the slider cannot have sent falls back to 1 s, with a warning."""
    allowed = "a number of seconds from 0.2 to 3"
    try:
        speed = as_number("Play speed", value, allowed)
        if not 0.2 <= speed <= 3:
            raise ValueError(f"Play speed must be {allowed}, got {speed}.")
        return speed
    except ValueError as exc:
        gr.Warning(f"{exc} Playing at 1 s per step.")
        return 1.0


def _skip(n: int) -> tuple:
    return tuple(gr.skip() for _ in range(n))


def _failure(failed: str | None, reason: str) -> str | None:
    return None if failed is None else f"{failed}: {reason}"


def play_controls(playing: bool, speed: float | None = None) -> tuple:
    """(timer, play button, playing flag) for the Play/Pause toggle."""
    timer = gr.Timer(active=playing) if speed is None else gr.Timer(value=float(speed), active=playing)
    return timer, gr.Button(value="❚❚ Pause" if playing else "▷ Play"), playing


def _wire(pages: Pages, handlers: Handlers, state: gr.State, demo: gr.Blocks,
          shows: tuple[tuple[gr.Tab, Panel], ...]) -> None:
    c = pages.controls
    out = [state, *pages.frame_outputs()]
    decode = c.decode_inputs()
    # Everything that runs model forwards shares one queue group, so `concurrency` bounds the CPU/GPU work;
    # the rest of a classroom waits in Gradio's queue, and show_progress="full" shows each visitor their
    # place in it ("queue: 3/12") instead of a button that seems frozen. It shows on the token stream only:
    # an animated overlay on each of the frame's sixteen outputs kept a local browser drawing on the cores
    # the rounds are timed on (the target step read 55 ms against 38 ms without a page open, on 2 cores).
    busy = dict(concurrency_id="decode", concurrency_limit=handlers.ctx.settings.concurrency, show_progress="full",
                show_progress_on=[pages.stream.status])
    # A browser on the server's own machine draws that timer on every frame while a round is timed, on the cores
    # the round needs, and more while the Step's round runs than while its target-only rounds catch up after the
    # drawing: on 2 cores the page then measured speculation slower than its own prediction said (measured /
    # predicted 0.61-0.77 with the timer, 0.81-1.08 without; docs/performance.md). The page's Step and Play's
    # ticks show it only where browsers run elsewhere, where a classroom waits in the queue and needs its place.
    stepping = busy | dict(show_progress="hidden" if handlers.ctx.settings.browsers_here else "full")
    # Reset loads models and allocates KV but runs no forward: it has its own, wider group, so a slow load
    # for one visitor (the registry holds no lock while loading) never queues another visitor's Reset.
    loads = dict(concurrency_id="reset", concurrency_limit=handlers.ctx.settings.max_sessions, show_progress="full")
    c.reset.click(handlers.on_reset, [state, *decode], out, api_name="reset", **loads)
    # The page's Step runs the round alone and its target-only rounds (the baseline its speed-up is measured
    # against) once the page has drawn the round: the visitor does not wait for them, and the page's drawing does
    # not share the cores with them. The API's /step (a button never shown) returns both, as it always did.
    # A catch-up still pending in the page (its reply being drawn) when the next Step's reply lands would have
    # Gradio drop the next one (trigger mode "once") and leave the charts a round behind: "always_last" runs it after.
    c.step.click(handlers.on_page_step, [state, c.reveal, *decode], out, api_name=False, **stepping).then(
        handlers.on_catch_up, [state], out, api_name=False, js=AFTER_PAINT_JS, concurrency_id="decode",
        concurrency_limit=handlers.ctx.settings.concurrency, show_progress="hidden", trigger_mode="always_last")
    gr.Button(visible=False).click(handlers.on_step, [state, c.reveal, *decode], out, api_name="step", **busy)
    c.run_to_end.click(handlers.on_run_to_end, [state, *decode], out, api_name="run_to_end", **busy)
    c.back.click(handlers.on_back, [state], out, api_name="back")
    c.scrubber.release(handlers.on_scrub, [state, c.scrubber], out, api_name="scrub")
    pages.detail.position.input(handlers.on_position, [state, pages.detail.position], out, api_name=False)
    pages.stream.stream.click(handlers.on_chip, [state], out, api_name=False)
    pages.detail.tree.click(handlers.on_chip, [state], out, api_name=False)
    c.preset.change(lambda key: preset_defaults(handlers.ctx.registry, key), [c.preset], c.preset_outputs(),
                    api_name=False)
    t = pages.traces
    t.upload.upload(handlers.on_trace, [state, t.upload], out, api_name="replay_upload")
    t.load_example.click(handlers.on_trace, [state, t.example], out, api_name="replay_example")
    t.export.click(handlers.on_export, [state], [t.files], api_name="export")
    playing = gr.State(False)
    timer = gr.Timer(1.0, active=False)
    c.play.click(handlers.on_play, [playing, c.speed], [timer, c.play, playing], api_name=False)
    c.speed.change(handlers.on_speed, [c.speed, playing], [timer], api_name=False)
    timer.tick(handlers.on_tick, [state, playing, *decode], [*out, timer, c.play, playing], api_name=False,
               **stepping).then(None, js="() => { " + CLOSE_LOADING_NOTICE_JS + " }", api_name=False)
    for tab, panel in shows:  # a tab's views are rendered when it is shown, not on every event before
        tab.select(handlers.on_show(panel), [state], out,
                   api_name=False if panel is Panel.OTHER else f"show_{panel.value}")
    demo.load(handlers.on_load, [state], pages.frame_outputs(), api_name=False)
    demo.unload(handlers.on_unload)


def _baseline_part(frame: tuple, keep: bool) -> tuple:
    """A frame's outputs that read the target-only run (BASELINE_OUTPUTS) with the rest skipped (`keep`), or the
    rest with those skipped."""
    return tuple(v if (i in BASELINE_OUTPUTS) == keep else gr.skip() for i, v in enumerate(frame))


LOADING_NOTICE = ("The models are still loading: on a new machine the first minute converts them and compiles "
                  "the C++ layer loop. This Step runs as soon as they are in.")
LOADING_NOTICE_OPENS = LOADING_NOTICE.split(":")[0]   # what the page finds the notice by, to close it

# closes the loading notice, which stays open until a Step or Play tick has waited for the models (left open, it
# went on saying they were loading beside their rounds): run once that Step's or tick's reply has come
CLOSE_LOADING_NOTICE_JS = ("document.querySelectorAll('.toast-body').forEach(t => { if (t.innerText.includes("
                           + json.dumps(LOADING_NOTICE_OPENS) + ")) t.querySelector('.toast-close')?.click(); });")

# resolves once the page has painted what the Step returned (the frame after next has begun)
# (or after a second, in a tab in the background, where animation frames wait until it is shown)
AFTER_PAINT_JS = ("(...inputs) => new Promise(done => { " + CLOSE_LOADING_NOTICE_JS + " requestAnimationFrame("
                  "() => requestAnimationFrame(() => done(inputs))); setTimeout(() => done(inputs), 1000); })")


def make_context(settings: AppSettings) -> Context:
    """The server's shared objects: the model registry (models load lazily) and the session pool."""
    draft, target = default_pair(settings.draft, settings.target)
    registry = ModelRegistry(draft, target, draft_device=settings.draft_device,
                             target_device=settings.target_device, allow_custom=settings.allow_custom_models,
                             allow_local_paths=settings.allow_local_paths,
                             deadlines=Deadlines(settings.config_timeout_s, settings.load_timeout_s),
                             compute_threads=settings.compute_threads)
    return Context(registry, make_pool(settings), settings)


def make_pool(settings: AppSettings, root: Path | None = None) -> SessionPool:
    """The session pool with the settings' bounds (its folder under `root`, else the system's temp folder)."""
    return SessionPool(settings.max_sessions, settings.kv_budget_mib * 2**20, settings.session_ttl_s, root,
                       lease_s=settings.session_lease_s, per_client=settings.max_sessions_per_client)


class PlaygroundBlocks(gr.Blocks):
    """gr.Blocks whose refusals of malformed input are one log line, not a traceback.

    Gradio checks some input before any handler runs: a value outside a Dropdown's or Radio's choices,
    too few input values in an API call. It raises there, and prints a traceback of some 25 lines for
    each: a few hundred bad calls would flood the log. Here such a refusal keeps its message for the
    caller, is logged once, and prints no traceback; errors past preprocessing (bugs) still print theirs.
    """

    async def preprocess_data(self, block_fn, inputs, state, explicit_call: bool = False):
        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except (gr.Error, ValueError) as exc:
            message = exc.message if isinstance(exc, gr.Error) else str(exc).splitlines()[0]
            log.info("refused a call to %s: %s", block_fn.api_name or block_fn.name, message)
            raise gr.Error(message, print_exception=False) from None


UPLOAD_BYTES = 2 * MAX_TRACE_BYTES      # Gradio stops an upload past this (a trace just over its limit is still read)
UPLOAD_QUOTA_BYTES = 256 * 2**20        # all uploads kept at once; each is deleted UPLOAD_AGE_S after it came
UPLOAD_AGE_S, UPLOAD_SWEEP_S = 600, 60


WELCOME_NOTE = ("**An example run, recorded in advance** with this pair's recommended settings. Press "
                "**Step ▶** to start your own, live. · ")


def welcome_cursor(view: RunView) -> Cursor:
    """The welcome run shown up to its first round by which the chips show every outcome: a round whose every
    draft was accepted (its bonus token) and a round with a draft rejected (its correction); else up to its
    first such full round, else its first accepted draft, else four rounds."""
    def first(found: Callable[[RoundRecord], bool]) -> int | None:
        return next((i for i, r in enumerate(view.rounds) if found(r)), None)

    full, rejected = first(lambda r: r.k and r.accepted == r.k), first(lambda r: r.accepted < r.k)
    if full is not None:
        upto = full if rejected is None else max(full, rejected)
    else:
        some = first(lambda r: r.accepted > 0)
        upto = some if some is not None else 3
    return Cursor(shown=min(upto + 1, len(view.rounds)))


def welcome_view(ctx: Context) -> RunView | None:
    """The recorded welcome run (playground.make_examples) when the server's first pair is the pair it was
    recorded on (its target and EAGLE head); None otherwise, or when the file is missing or unreadable (the page
    then starts empty)."""
    from playground.make_examples import WELCOME

    path = page_traces.EXAMPLES_DIR / f"{WELCOME}.jsonl"
    first = ctx.registry.presets[0]
    if first.target != SMOLLM2 or not path.is_file():
        return None
    try:
        trace = load_trace(path)
    except TraceError as exc:
        log.warning("the welcome run %s cannot be shown: %s", path, exc)
        return None
    if trace.header.eagle is not None and trace.header.eagle != f"eagle:{first.eagle}":
        log.warning("the welcome run %s was recorded with %s, not the first pair's head; not shown", path,
                    trace.header.eagle)
        return None
    try:
        return view_from_trace(trace, path.name)
    except TraceError as exc:
        log.warning("the welcome run %s cannot be shown: %s", path, exc)
        return None


def build_app(ctx: Context) -> gr.Blocks:
    """The whole playground, built but not launched: `playground.serve.start` launches it (with `launch_kwargs`)."""
    examples = page_traces.example_traces()
    handlers = Handlers(ctx, welcome_view(ctx))
    # Gradio's analytics would reach outside servers at launch; uploads are deleted on a schedule and at exit
    with PlaygroundBlocks(title=TITLE, analytics_enabled=False, delete_cache=(UPLOAD_SWEEP_S, UPLOAD_AGE_S)) as demo:
        gr.Markdown(f"## {TITLE}")
        state = gr.State(None, time_to_live=ctx.settings.session_ttl_s, delete_callback=ctx.pool.close)
        with gr.Tabs() as top_tabs:
            with gr.Tab("Playground", id="playground"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=320):
                        controls = build_controls(ctx.registry, ctx.settings.max_new_tokens)
                    with gr.Column(scale=3):
                        stream = page_stream.build()
                        with gr.Tabs() as tabs:
                            with gr.Tab("Round detail", id="detail") as detail_tab:
                                detail = page_detail.build()
                            with gr.Tab("KV cache", id="kv") as kv_tab:
                                kv = page_kv.build()
                            with gr.Tab("Charts", id="charts") as charts_tab:
                                charts = page_charts.build()
                            with gr.Tab("Theory", id="theory") as theory_tab:
                                theory = page_theory.build()
                            with gr.Tab("Losslessness lab", id="lab") as lab_tab:
                                lab = page_lab.build()
                            with gr.Tab("Traces", id="traces") as traces_tab:
                                traces = page_traces.build(examples)
                            with gr.Tab("Compare", id="compare") as compare_tab:
                                page_compare.build(examples)
            with gr.Tab("Lesson", id="lesson"):
                # The lesson drives its own run, beside the playground's.
                page_lesson.build_lesson(ctx.registry)
            with gr.Tab("Batch", id="batch") as batch_tab:
                batch = page_batch.build(ctx)
            with gr.Tab("Live engine", id="live"):
                page_live.build(ctx)
        # the shown study is drawn when its tab opens (plotly measures its box then)
        batch_tab.select(batch.handlers.show, [batch.study, batch.state], batch.outputs(), api_name=False)
        theory_tab.select(handlers.on_theory, [state], [state, *theory.outputs()], api_name=False)
        theory.refresh.click(handlers.on_theory, [state], [state, *theory.outputs()], api_name=False)
        theory.remeasure.click(handlers.on_remeasure, [state], [state, *theory.outputs()], api_name=False)
        lab.run.click(handlers.on_lab, [state, *lab.inputs()], [state, *lab.outputs()], api_name=False,
                      concurrency_id="lab", concurrency_limit=1)
        pages = Pages(controls, stream, detail, kv, charts, traces)
        shows = ((detail_tab, Panel.DETAIL), (kv_tab, Panel.KV), (charts_tab, Panel.CHARTS),
                 (lab_tab, Panel.OTHER), (traces_tab, Panel.OTHER), (compare_tab, Panel.OTHER))
        _wire(pages, handlers, state, demo, shows)
        for t in (top_tabs, tabs):
            t.select(None, js=FIT_SHOWN_PLOTS_JS, api_name=False)
    demo.queue(max_size=8 * ctx.settings.max_sessions)
    return demo


def launch_kwargs(ctx: Context) -> dict:
    """What `demo.launch` needs beside the address: Gradio 6 takes CSS at launch, not in gr.Blocks; the
    example traces may be served for download; the heartbeat watch keeps sessions tied to connections
    and guards uploads (playground.connections); and uploads far over the trace limit are refused before
    they reach the disk (those just over it get the trace reader's own message)."""
    watch = heartbeat_middleware(ctx.pool, ctx.settings.proxy_hops, UPLOAD_BYTES, UPLOAD_QUOTA_BYTES)
    return {"css": stylesheet(), "allowed_paths": [str(page_traces.EXAMPLES_DIR)],
            "app_kwargs": {"middleware": [watch]}, "max_file_size": UPLOAD_BYTES}

"""One frame of the playground: the views of the tabs asked for, rendered from a RunView and a Cursor, nothing else."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import plotly.graph_objects as go

from playground.render import charts
from playground.render.bars import bars_html, message_chart
from playground.render.kv_plots import kv_figure, kv_table_html
from playground.render.round_plots import position_chart, position_choices
from playground.render.tokens import stream_html
from playground.render.tree import tree_html
from playground.view import Cursor, Panel, RunView

WEIGHT_WORDS = {"float32": "fp32 weights", "bfloat16": "bf16 weights", "float16": "fp16 weights",
                "int8": "int8 weights", "int4": "int4 weights"}


def weights_words(dtype: str | None) -> str:
    """What the status line says the target multiplies with (a trace's dtype for it)."""
    return WEIGHT_WORDS.get(dtype or "float32", f"{dtype} weights")


@dataclass(frozen=True)
class StreamFrame:
    """The panel above every tab, always drawn: where the run stands, and the token chips."""

    status: str
    stream: str
    rounds_total: int
    shown: int


@dataclass(frozen=True)
class DetailFrame:
    badge: str
    summary: str
    positions: list[tuple[str, int]]
    position: int | None
    detail: str               # the selected token's bars (bars.bars_html)
    tree: str = ""            # a tree round drawn as a tree ("" for a chain)


@dataclass(frozen=True)
class KVFrame:
    target: go.Figure
    draft: go.Figure
    table: str


@dataclass(frozen=True)
class ChartsFrame:
    acceptance: go.Figure
    per_position: go.Figure
    lengths: go.Figure
    tokens_time: go.Figure
    speedup: go.Figure


@dataclass(frozen=True)
class Frame:
    """One frame. A tab's part is None when it was not asked for: its tab is hidden, and is drawn
    when it is shown (a hidden tab's figures would be drawn at no width and cost time for nothing)."""

    stream: StreamFrame
    detail: DetailFrame | None
    kv: KVFrame | None
    charts: ChartsFrame | None


def _status(view: RunView | None, cursor: Cursor, failure: str | None) -> str:
    """Where the run stands; after a failed action, the failure first, so the run shown is not taken for
    the result of what was just pressed."""
    where = _where(view, cursor)
    if failure is None:
        return where
    shown = "" if view is None or view.previous is not None else "Showing the previous run: "   # a previous run says so
    return f"{failure_status(failure)} {shown}{where}"


def failure_status(failure: str) -> str:
    """The status line's head after a failed action (alone, when the session is busy and nothing is redrawn)."""
    return f"**⚠ {failure.rstrip('.')}.**"


def _where(view: RunView | None, cursor: Cursor) -> str:
    if view is None:
        return "No run yet: press **Step** (or **Reset**) to start one with these settings."
    total = len(view.rounds)
    where = "live" if view.source == "live" else f"replaying {view.source}" + \
        (f", recorded on {view.info.machine}" if view.info.machine else "")
    state = "finished" if view.complete and cursor.shown >= total else "running" if view.source == "live" else "replay"
    pending = " — drafts pending: **Step** reveals the verification" if not cursor.revealed else ""
    layers = f", layers in {view.info.layers}" if view.info.layers else ""
    codes = f" read from {view.info.codes}" if view.info.codes else ""
    models = f"target `{view.info.target}` ({weights_words(view.info.dtypes.get('target'))}{codes}{layers})" + \
        (f" · draft `{view.info.draft}`" if view.info.draft else "")
    if view.previous is not None:
        return (f"**Previous run** — the last Reset failed ({view.previous}), so this is the run from before it, "
                f"with its own settings, and Step will not continue it: fix the settings and press **Reset**. "
                f"· **Round {cursor.shown} of {total}** ({where}) · {view.info.label()} · {models}")
    return f"**Round {cursor.shown} of {total}** ({state}, {where}) · {view.info.label()} · " + models + pending


def _detail(view: RunView | None, verified: RunView | None, cursor: Cursor) -> DetailFrame:
    """The badge and headline numbers (verified rounds only), and the selected token's figure (pending
    while unrevealed)."""
    badge, summary = charts.identity_badge(verified), charts.summary_html(verified)
    selection = cursor.selection(view) if view is not None else None
    if selection is None:
        return DetailFrame(badge, summary, [], None, bars_html(message_chart("Step to see a round's verification here.")))
    index, position = selection
    record = view.rounds[index]
    revealed = cursor.revealed or index != cursor.shown - 1
    tree = tree_html(record, position) if record.tree is not None and revealed else ""
    return DetailFrame(badge, summary, position_choices(record), position,
                       bars_html(position_chart(record, position, revealed)), tree)


def _kv(view: RunView | None) -> KVFrame:
    """KV after the last verified round shown (a pending round's rollbacks would give its verdict away)."""
    states = view.rounds[-1].kv if view is not None and view.rounds else []
    by_model = {k.model: k for k in states}
    target = kv_figure(by_model["target"]) if "target" in by_model else charts.empty_figure("No target cache yet.")
    drafts = [by_model[m] for m in ("draft", "eagle") if m in by_model]
    draft = kv_figure(drafts[0]) if drafts else charts.empty_figure(
        "No draft cache: n-gram drafter or target-only mode." if states else "No draft cache yet.")
    return KVFrame(target, draft, kv_table_html(states))


def _charts(view: RunView | None) -> ChartsFrame:
    if view is None:
        return ChartsFrame(*[charts.empty_figure("No rounds yet.") for _ in range(5)])
    return ChartsFrame(charts.acceptance_figure(view), charts.per_position_figure(view),
                       charts.accepted_length_figure(view), charts.tokens_time_figure(view),
                       charts.speedup_figure(view))


def render_frame(view: RunView | None, cursor: Cursor, panels: Collection[Panel] = tuple(Panel),
                 failure: str | None = None) -> Frame:
    """The stream panel, and the parts of the tabs in `panels`, for the rounds up to the cursor. The
    stream shows a pending round's drafts; the charts, KV grids and badge use only verified rounds, so
    they never give a verdict away early. `failure`: what the action just pressed failed with, if it did."""
    shown = view.upto(cursor.shown) if view is not None else None
    verified = view.upto(cursor.shown - (0 if cursor.revealed else 1)) if view is not None else None
    stream = StreamFrame(_status(view, cursor, failure), stream_html(shown, cursor),
                         len(view.rounds) if view is not None else 0, cursor.shown)
    return Frame(stream, _detail(view, verified, cursor) if Panel.DETAIL in panels else None,
                 _kv(verified) if Panel.KV in panels else None,
                 _charts(verified) if Panel.CHARTS in panels else None)

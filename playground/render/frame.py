"""One frame of the playground: every view rendered from a RunView and a Cursor, nothing else."""
from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from playground.render import charts
from playground.render.kv_plots import kv_figure, kv_table_html
from playground.render.round_plots import position_choices, position_figure
from playground.render.tokens import stream_html
from playground.view import Cursor, RunView


@dataclass(frozen=True)
class Frame:
    stream: str
    status: str
    badge: str
    summary: str
    positions: list[tuple[str, int]]
    position: int | None
    detail: go.Figure
    kv_target: go.Figure
    kv_draft: go.Figure
    kv_table: str
    acceptance: go.Figure
    per_position: go.Figure
    lengths: go.Figure
    tokens_time: go.Figure
    speedup: go.Figure
    rounds_total: int
    shown: int


def _status(view: RunView | None, cursor: Cursor) -> str:
    if view is None:
        return "No run yet: press **Step** (or **Reset**) to start one with these settings."
    total = len(view.rounds)
    where = "live" if view.source == "live" else f"replaying {view.source}"
    state = "finished" if view.complete and cursor.shown >= total else "running" if view.source == "live" else "replay"
    pending = " — drafts pending: **Step** reveals the verification" if not cursor.revealed else ""
    models = f"target `{view.info.target}`" + (f" · draft `{view.info.draft}`" if view.info.draft else "")
    if view.previous is not None:
        return (f"**Previous run** — the last Reset failed ({view.previous}), so this is the run from before it, "
                f"with its own settings, and Step will not continue it: fix the settings and press **Reset**. "
                f"· **Round {cursor.shown} of {total}** ({where}) · {view.info.label()} · {models}")
    return f"**Round {cursor.shown} of {total}** ({state}, {where}) · {view.info.label()} · " + models + pending


def _detail(view: RunView | None, cursor: Cursor) -> tuple[list[tuple[str, int]], int | None, go.Figure]:
    """Position picker entries, the selected position, and its figure (pending while unrevealed)."""
    selection = cursor.selection(view) if view is not None else None
    if selection is None:
        return [], None, charts.empty_figure("Step to see a round's verification here.")
    index, position = selection
    record = view.rounds[index]
    revealed = cursor.revealed or index != cursor.shown - 1
    return position_choices(record), position, position_figure(record, position, revealed)


def _kv(view: RunView | None) -> tuple[go.Figure, go.Figure, str]:
    """KV after the last verified round shown (a pending round's rollbacks would give its verdict away)."""
    states = view.rounds[-1].kv if view is not None and view.rounds else []
    by_model = {k.model: k for k in states}
    target = kv_figure(by_model["target"]) if "target" in by_model else charts.empty_figure("No target cache yet.")
    draft = kv_figure(by_model["draft"]) if "draft" in by_model else charts.empty_figure(
        "No draft cache: n-gram drafter or target-only mode." if states else "No draft cache yet.")
    return target, draft, kv_table_html(states)


def _charts(view: RunView | None) -> list[go.Figure]:
    if view is None:
        return [charts.empty_figure("No rounds yet.")] * 5
    return [charts.acceptance_figure(view), charts.per_position_figure(view), charts.accepted_length_figure(view),
            charts.tokens_time_figure(view), charts.speedup_figure(view)]


def render_frame(view: RunView | None, cursor: Cursor) -> Frame:
    """Every output for the rounds up to the cursor. The stream shows a pending round's drafts; the
    charts, KV grids and badge use only verified rounds, so they never give a verdict away early."""
    shown = view.upto(cursor.shown) if view is not None else None
    verified = view.upto(cursor.shown - (0 if cursor.revealed else 1)) if view is not None else None
    positions, position, detail = _detail(view, cursor)
    kv_target, kv_draft, kv_table = _kv(verified)
    acceptance, per_position, lengths, tokens_time, speedup = _charts(verified)
    return Frame(stream=stream_html(shown, cursor), status=_status(view, cursor), badge=charts.identity_badge(verified),
                 summary=charts.summary_html(verified), positions=positions, position=position, detail=detail,
                 kv_target=kv_target, kv_draft=kv_draft, kv_table=kv_table, acceptance=acceptance,
                 per_position=per_position, lengths=lengths, tokens_time=tokens_time, speedup=speedup,
                 rounds_total=len(view.rounds) if view is not None else 0, shown=cursor.shown)

"""Two runs side by side (e.g. K=2 vs K=4, or v1 vs v2): a table of measures and overlaid charts."""
from __future__ import annotations

import html
import math

import plotly.graph_objects as go

from engine import metrics
from engine.metrics import NotMeasured
from playground.render.charts import HEIGHT, empty_figure
from playground.render.palette import BLUE, ORANGE, styled_figure
from playground.view import RunView

COLOURS = (BLUE, ORANGE)   # run A, run B


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if not metrics.finite(x) else f"{x:{spec}}"


def _row(view: RunView) -> list[str]:
    last = view.rounds[-1] if view.rounds else None
    tokens = last.tokens_total if last else 0
    pred = view.prediction()
    return [view.source, view.info.label(), view.info.target,
            " + ".join(d for d in (view.info.draft, view.info.eagle) if d) or "—",
            ", ".join(f"{k}: {v}" for k, v in view.info.devices.items()), view.info.machine or "— (not recorded)",
            str(len(view.rounds)), str(tokens),
            _fmt(metrics.draft_acceptance(view.rounds)), _fmt(metrics.alpha(view.rounds)),
            _fmt(metrics.tokens_per_round(view.rounds), ".2f"),
            _fmt(metrics.cost_ratio(view.rounds, view.baseline)),
            _fmt(None if isinstance(pred, NotMeasured) else pred.r, ".2f"),
            _fmt(metrics.decode_speedup(view.rounds, view.baseline), ".2f"),
            _fmt(None if isinstance(pred, NotMeasured) else pred.speedup_iid, ".2f"),
            str(sum(r.target_forwards for r in view.rounds))]


ROW_NAMES = ("trace", "settings", "target", "draft model / EAGLE head", "devices", "machine", "rounds", "tokens",
             "draft acceptance (accepted / drafted)", "α (accepted / verified)", "tokens per drafted round (τ)",
             "c (measured)", "r(K+1) (the run's own, else calibrated)", "speed-up after the prefill, measured ×",
             "speed-up predicted ×", "target forwards")


def compare_table_html(a: RunView, b: RunView) -> str:
    cols = [_row(a), _row(b)]
    body = "".join(f"<tr><th>{html.escape(name)}</th>" + "".join(f"<td>{html.escape(c[i])}</td>" for c in cols)
                   + "</tr>" for i, name in enumerate(ROW_NAMES))
    return f'<table class="kv-table"><tr><th></th><th>A</th><th>B</th></tr>{body}</table>'


def compare_tokens_time(a: RunView, b: RunView) -> go.Figure:
    """Four measured curves: each run's speculative stream (solid) and its target-only baseline (dashed)."""
    fig = styled_figure()
    for name, view, colour in (("A", a, COLOURS[0]), ("B", b, COLOURS[1])):
        fig.add_trace(go.Scatter(x=[0] + [r.elapsed_s for r in view.rounds],
                                 y=[0] + [r.tokens_total for r in view.rounds],
                                 name=f"{name}: {view.info.label()}", line=dict(color=colour, shape="hv")))
        if view.baseline:
            fig.add_trace(go.Scatter(x=[0] + [r.elapsed_s for r in view.baseline],
                                     y=[0] + [r.tokens_total for r in view.baseline], name=f"{name}: target-only",
                                     line=dict(color=colour, dash="dash", shape="hv")))
    fig.update_layout(title="Tokens vs decode time", height=HEIGHT + 60,
                      xaxis_title="seconds", yaxis_title="tokens", legend=dict(orientation="h", y=-0.3))
    return fig


def compare_per_position(a: RunView, b: RunView) -> go.Figure:
    rates = [metrics.position_rates(v.rounds) for v in (a, b)]
    if not any(rates):
        return empty_figure("Neither run drafted anything.")
    fig = styled_figure([go.Bar(x=list(range(1, len(r) + 1)), y=[None if math.isnan(x) else x for x in r],
                            name=f"{n}: {v.info.label()}", marker_color=c)
                     for n, v, r, c in zip("AB", (a, b), rates, COLOURS)])
    fig.update_layout(title="Per-position acceptance", barmode="group", height=HEIGHT,
                      xaxis_title="draft position", yaxis=dict(title="accepted / verified", range=[0, 1.05]),
                      legend=dict(orientation="h", y=-0.3))
    return fig

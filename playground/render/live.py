"""The Live engine page's figures and text, from a `engine.watch.Watcher`'s records: acceptance and mean
acceptance length over time, per-position acceptance (the whole watch, and specplay's run of the same K
beside it), tokens per second, and Leviathan's prediction from the measured rates."""
from __future__ import annotations

import html
import math
from dataclasses import dataclass

import plotly.graph_objects as go

from engine import metrics
from engine.watch import Interval, Point, Watcher
from playground.render.charts import chart_figure, empty_figure
from playground.render.palette import BASELINE_COLOUR, GREEN, PREDICTED_COLOUR, SPEC_COLOUR

ENGINE_COLOUR = "#7B3294"   # the watched engine's bars, apart from specplay's blue


@dataclass(frozen=True, slots=True)
class SideRun:
    """specplay's run beside the watched engine: its K, vLLM-style per-position rates (accepted at i over
    drafted rounds, engine.metrics.accepted_at_positions), and its measured c and r."""

    label: str
    k: int
    rates: tuple[float, ...]
    mean_length: float | None
    c: float | None
    r: float | None


def _num(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, spec)


def _series(points: list[Point], value) -> tuple[list[float], list[float | None]]:
    xs, ys = [], []
    for p in points:
        v = value(p.interval)
        xs.append(round(p.t, 1))
        ys.append(v if v is not None and math.isfinite(v) else None)
    return xs, ys


def idle_figures() -> tuple[go.Figure, go.Figure, go.Figure, go.Figure]:
    """The four charts before a watch: what each will show (acceptance over time, per position, throughput, the
    prediction), in the place of an empty frame."""
    return tuple(empty_figure(f"{what} will show here: enter the metrics URL and press Watch.")
                 for what in ("Acceptance over time", "Per-position acceptance", "Throughput",
                              "The predicted speed-up"))


def acceptance_over_time(points: list[Point]) -> go.Figure:
    """Acceptance rate and each position's rate (left axis) and mean acceptance length (right axis), one point
    per interval."""
    if not points:
        return empty_figure("Waiting for a second reading.")
    xs, rate = _series(points, lambda iv: iv.acceptance_rate)
    _, length = _series(points, lambda iv: iv.mean_acceptance_length)
    positions = max(len(p.interval.position_rates) for p in points)
    per_position = [go.Scatter(x=xs, y=_series(points, lambda iv, i=i: iv.position_rates[i]
                                               if i < len(iv.position_rates) else None)[1],
                               name="positions 1, 2, …: accepted there / drafts (fainter: later)", mode="lines",
                               line=dict(color=ENGINE_COLOUR, width=1), opacity=max(0.25, 1 - 0.2 * i),
                               legendgroup="positions", showlegend=i == 0, hovertemplate=f"position {i + 1}: %{{y:.3f}}")
                    for i in range(positions)]
    fig = chart_figure([go.Scatter(x=xs, y=rate, name="acceptance rate: accepted / drafted", mode="lines+markers",
                              line=dict(color=GREEN)),
                   go.Scatter(x=xs, y=length, name="mean acceptance length: tokens per verify", mode="lines+markers",
                              line=dict(color=SPEC_COLOUR, dash="dot"), yaxis="y2"), *per_position],
                  "Acceptance over time (per interval)", "seconds since watching began", "acceptance rate",
                  yaxis_range=[0, 1.05])
    fig.update_layout(yaxis2=dict(title="tokens per verify", overlaying="y", side="right", rangemode="tozero"),
                      margin=dict(l=50, r=55, t=50, b=45), height=340, legend=dict(orientation="h", y=-0.35))
    return fig


def throughput_over_time(points: list[Point]) -> go.Figure:
    """Drafted, accepted and generated tokens per second, per interval."""
    if not points:
        return empty_figure("Waiting for a second reading.")
    traces = []
    for name, value, colour in (("generated tok/s", lambda iv: iv.generated_per_s, "#000"),
                                ("drafted tok/s", lambda iv: iv.drafted_per_s, BASELINE_COLOUR),
                                ("accepted tok/s", lambda iv: iv.accepted_per_s, GREEN)):
        xs, ys = _series(points, value)
        traces.append(go.Scatter(x=xs, y=ys, name=name, mode="lines+markers", line=dict(color=colour)))
    return chart_figure(traces, "Tokens per second (per interval)", "seconds since watching began", "tokens / s",
                   yaxis_rangemode="tozero")


def per_position(total: Interval | None, side: SideRun | None) -> go.Figure:
    """Accepted at position i over drafts, for the whole watch, with specplay's run of the same K beside it."""
    if total is None or not total.position_rates:
        return empty_figure("No drafts counted yet.")
    k = len(total.position_rates)
    xs = list(range(1, k + 1))
    traces = [go.Bar(x=xs, y=list(total.position_rates), name=f"{total.model} (watched)", marker_color=ENGINE_COLOUR,
                     text=[f"{v:.2f}" for v in total.position_rates], textposition="outside")]
    if side is not None and side.rates:
        traces.append(go.Bar(x=list(range(1, len(side.rates) + 1)), y=list(side.rates), name=side.label,
                             marker_color=SPEC_COLOUR, text=[f"{v:.2f}" for v in side.rates], textposition="outside"))
    fig = chart_figure(traces, "Per-position acceptance: accepted at position i / drafts", "draft position",
                  "share of drafts", yaxis_range=[0, 1.1], barmode="group")
    return fig


def prediction(total: Interval | None, c: float | None, r: float | None, k_max: int = 8) -> go.Figure:
    """Leviathan's speed-up E(rates, K) / (cK + r) at K = 1..k_max from the watch's per-position rates
    (positions past the drafted K take the last measured rate), with the entered or measured c and r."""
    if total is None or not total.position_rates:
        return empty_figure("No drafts counted yet.")
    if c is None or r is None or not (c >= 0 and r > 0):
        return empty_figure("Enter c ≥ 0 and r > 0 (or run specplay beside it) for the prediction.")
    rates = [a for a in total.conditional_rates]
    if not any(math.isfinite(a) for a in rates):
        return empty_figure("No draft accepted yet: nothing to predict from.")
    ks = list(range(1, max(k_max, len(rates)) + 1))
    ys = [metrics.expected_tokens_from_rates(rates, k) / (c * k + r) for k in ks]
    drafted = len(rates)
    fig = chart_figure([go.Scatter(x=ks, y=ys, name="predicted speed-up E / (cK + r)", mode="lines+markers",
                              line=dict(color=PREDICTED_COLOUR)),
                   go.Scatter(x=[drafted], y=[ys[drafted - 1]], name=f"the server's K = {drafted}", mode="markers",
                              marker=dict(size=12, color=ENGINE_COLOUR))],
                  f"Does K pay? Predicted from the measured rates (c = {c:g}, r = {r:g})", "K (drafts per round)",
                  "speed-up over target-only", yaxis_rangemode="tozero")
    fig.add_hline(y=1.0, line=dict(color="#999", dash="dash"))
    return fig


def summary_markdown(watcher: Watcher | None, model: str | None, side: SideRun | None) -> str:
    """The page's sentence: what is watched, the whole watch's figures, restarts, and specplay beside it."""
    if watcher is None:
        return "Not watching. Enter the server's metrics URL and press **Watch**."
    if model is None or watcher.total(model) is None:
        return f"Watching `{html.escape(watcher.url)}`: waiting for a second reading."
    total = watcher.total(model)
    parts = [f"Watching `{html.escape(watcher.url)}` · model `{html.escape(model)}` · {len(watcher.points[model])} "
             f"intervals · since watching began: {total.drafts:.0f} drafts, acceptance rate "
             f"{_num(total.acceptance_rate)}, mean acceptance length {_num(total.mean_acceptance_length, '.2f')}, "
             f"generated {total.generated_per_s:.1f} tok/s"]
    if total.gauges:
        parts.append("gauges as read: " + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in total.gauges.items()))
    if watcher.restarts.get(model):
        parts.append(f"the server restarted {watcher.restarts[model]}× (counted from zero after each)")
    if len(watcher.models) > 1:
        parts.append(f"{len(watcher.models)} models on this server: pick one above")
    if side is not None:
        parts.append(f"{side.label}: K = {side.k}, mean acceptance length {_num(side.mean_length, '.2f')}, "
                     f"c = {_num(side.c)}, r = {_num(side.r, '.2f')} (measured here)")
    return " · ".join(parts)

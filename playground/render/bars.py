"""Grouped probability bars over a position's candidate tokens: the record (`BarChart`) and its two drawings, inline
SVG for the Round detail tab and a Plotly figure for the lesson.

Why SVG for the Round detail: its chart changes on every Step, and a Plotly figure there is redrawn whole by the
page (Gradio calls react, then resize): on a 2-core machine that drawing took ~110 ms of the browser's 340 ms of
work a Step, beside the server on the same cores (docs/performance.md, "the Step in a browser"). The same bars as
some 60 SVG elements are set in one go and cost the page next to nothing; hovering a bar still shows its value.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass

import plotly.graph_objects as go

from playground.render.palette import PLOT_GRID, PLOT_INK, styled_figure


@dataclass(frozen=True)
class BarSeries:
    """One kind of bar (p_target, q_draft, the residual), one value per candidate; `outlines`: its bar at the
    chart's marked candidate is outlined."""

    name: str
    values: tuple[float, ...]
    colour: str
    opacity: float = 1.0
    outlines: bool = True


@dataclass(frozen=True)
class BarChart:
    """A position's bars: `labels` name the candidates, `outlined` the one marked (the drafted or sampled token;
    None: none), `mark` the words over it. `title` lines are shown above the bars. With no series, `title` is a
    message shown in their place (a pending verdict, a position never checked)."""

    title: tuple[str, ...]
    labels: tuple[str, ...] = ()
    series: tuple[BarSeries, ...] = ()
    outlined: int | None = None
    mark: str = ""

    def __post_init__(self) -> None:
        if any(len(s.values) != len(self.labels) for s in self.series):
            raise ValueError("every series needs one value per label")
        if self.outlined is not None and not 0 <= self.outlined < len(self.labels):
            raise ValueError(f"outlined {self.outlined} is not one of the {len(self.labels)} labels")

    @property
    def top(self) -> float:
        """The tallest bar at the marked candidate (where the mark's arrow points), 0 without one."""
        if self.outlined is None:
            return 0.0
        return max((s.values[self.outlined] for s in self.series), default=0.0)


def message_chart(text: str) -> BarChart:
    return BarChart(title=(text,))


def marked(tokens: list[int], token: int) -> int | None:
    """Where the marked token sits among a chart's candidates (None: it is not among them)."""
    return next((i for i, t in enumerate(tokens) if t == token), None)


# -- SVG -------------------------------------------------------------------------------------------------------

WIDTH, PLOT_H = 860, 250          # the drawing's own units; it scales to the panel's width
LEFT, RIGHT, TOP = 52, 12, 34     # room for the axis' numbers, the right edge, and the mark over the tallest bar
LABEL_PX = 7.2                    # a label character's width at 12 px
LABEL_CHARS = 14                  # longer labels are cut (the bar's tooltip has them whole)
SLANT = 35                        # degrees, when the labels do not fit their columns flat
COS, SIN = math.cos(math.radians(SLANT)), math.sin(math.radians(SLANT))
OUTLINE = 3


def bars_html(chart: BarChart) -> str:
    """The chart as HTML: its title lines and legend as text (they wrap in a narrow panel), the bars as an inline
    SVG that scales to the panel's width. Every bar carries its value as a tooltip."""
    title = "".join(f'<div class="bars-title{" first" if i == 0 else ""}">{html.escape(line)}</div>'
                    for i, line in enumerate(chart.title))
    if not chart.series:
        return f'<div class="bars bars-message">{title}</div>'
    legend = "".join(f'<span class="bars-key"><i style="background:{s.colour};opacity:{s.opacity}"></i>'
                     f'{html.escape(s.name)}</span>' for s in chart.series)
    return f'<div class="bars">{title}{_svg(chart)}<div class="bars-legend">{legend}</div></div>'


def _svg(chart: BarChart) -> str:
    n, groups = len(chart.labels), len(chart.series)
    column = (WIDTH - LEFT - RIGHT) / n
    slanted = any(len(label) * LABEL_PX > column - 4 for label in chart.labels)
    longest = min(LABEL_CHARS, max(len(label) for label in chart.labels)) * LABEL_PX
    bottom = 24 + (int(longest * SIN) if slanted else 0)
    # a slanted first label reaches left of its column: the axis moves right as far as it would overhang
    left = LEFT + (max(0.0, len(chart.labels[0][:LABEL_CHARS]) * LABEL_PX * COS - (LEFT + column / 2)) if slanted else 0)
    column = (WIDTH - left - RIGHT) / n
    height = TOP + PLOT_H + bottom
    top_value = max([v for s in chart.series for v in s.values] + [1e-9])
    step = _tick_step(top_value)
    ceiling = step * math.ceil(top_value / step - 1e-9)

    def y(value: float) -> float:
        return TOP + PLOT_H * (1 - value / ceiling)

    parts = []
    for i in range(int(round(ceiling / step)) + 1):   # the grid and the axis' numbers
        v = i * step
        parts.append(f'<line x1="{left:.1f}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="{PLOT_GRID}"/>'
                     f'<text x="{left - 6:.1f}" y="{y(v) + 4:.1f}" text-anchor="end">{_tick(v)}</text>')
    parts.append(f'<text transform="translate(13,{TOP + PLOT_H / 2:.0f}) rotate(-90)" text-anchor="middle">'
                 f'probability</text>')
    bar = column * 0.8 / groups
    for c, label in enumerate(chart.labels):
        x0 = left + c * column + column * 0.1
        for g, s in enumerate(chart.series):
            v = s.values[c]
            edge = f' stroke="#000" stroke-width="{OUTLINE}"' if c == chart.outlined and s.outlines else ""
            parts.append(f'<rect x="{x0 + g * bar:.1f}" y="{y(v):.1f}" width="{max(bar - 1, 1):.1f}" '
                         f'height="{max(y(0) - y(v), 0):.1f}" fill="{s.colour}" fill-opacity="{s.opacity}"{edge}>'
                         f'<title>{html.escape(f"{s.name} of {label}: {v:.4f}")}</title></rect>')
        parts.append(_label(label, left + (c + 0.5) * column, TOP + PLOT_H + 16, slanted))
    if chart.outlined is not None and chart.mark:
        x = left + (chart.outlined + 0.5) * column
        tip = y(chart.top) - 4
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{tip - 18:.1f}" y2="{tip:.1f}" stroke="{PLOT_INK}"/>'
                     f'<path d="M{x - 4:.1f},{tip - 6:.1f} L{x:.1f},{tip:.1f} L{x + 4:.1f},{tip - 6:.1f}" '
                     f'fill="none" stroke="{PLOT_INK}"/>'
                     f'<text x="{x:.1f}" y="{tip - 22:.1f}" text-anchor="middle">{html.escape(chart.mark)}</text>')
    return (f'<svg class="bars-svg" viewBox="0 0 {WIDTH} {height}" role="img" font-size="12" fill="{PLOT_INK}" '
            f'font-family="sans-serif">{"".join(parts)}</svg>')


def _label(label: str, x: float, y: float, slanted: bool) -> str:
    shown = label if len(label) <= LABEL_CHARS else label[:LABEL_CHARS - 1] + "…"
    text = html.escape(shown)
    if slanted:
        return f'<text transform="translate({x:.1f},{y - 6:.1f}) rotate(-{SLANT})" text-anchor="end">{text}</text>'
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="middle">{text}</text>'


def _tick_step(top: float) -> float:
    """A round step giving 4-6 grid lines up to `top`."""
    raw = top / 5
    unit = 10 ** math.floor(math.log10(raw))
    return next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit >= raw)


def _tick(value: float) -> str:
    return f"{round(value, 6):g}"


# -- Plotly ----------------------------------------------------------------------------------------------------

def bars_figure(chart: BarChart) -> go.Figure:
    """The chart as a Plotly figure (the lesson's, which changes only when the reader moves on)."""
    title = "<br>".join(html.escape(line, quote=False) for line in chart.title)
    if not chart.series:
        return styled_figure(annotations=[dict(text=title, showarrow=False, x=0.5, y=0.5, xref="paper",
                                               yref="paper", font=dict(size=14))],
                             height=220, xaxis=dict(visible=False), yaxis=dict(visible=False),
                             margin=dict(l=10, r=10, t=10, b=10))
    labels = list(chart.labels)
    line = dict(color=["#000" if i == chart.outlined else "rgba(0,0,0,0)" for i in range(len(labels))],
                width=[OUTLINE + 1 if i == chart.outlined else 0 for i in range(len(labels))])
    bars = [go.Bar(name=s.name, x=labels, y=list(s.values), opacity=s.opacity if s.opacity < 1 else None,
                   marker=dict(color=s.colour, line=line) if s.outlines else dict(color=s.colour))
            for s in chart.series]
    # the mark by position: plotly would read a label such as "22" as the number 22, off the category axis
    marks = [dict(x=chart.outlined, y=chart.top, text=chart.mark, showarrow=True, arrowhead=2, ay=-35)] \
        if chart.outlined is not None and chart.mark else []
    return styled_figure(bars, title=dict(text=title, font=dict(size=14)), barmode="group", height=360,
                         margin=dict(l=40, r=20, t=70, b=60), yaxis=dict(title="probability", rangemode="tozero"),
                         xaxis=dict(type="category"), legend=dict(orientation="h", y=-0.25), annotations=marks)

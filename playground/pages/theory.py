"""The Theory tab: Leviathan's E(alpha, K) and predicted speed-up over K for the run's measured alpha
and c, the measured points on top, and the K the curve recommends.

Pure renderers (`theory_inputs`, `theory_curves`, `theory_figure`, `recommendation_html`) take a
RunView and return data, figures or HTML; `build_theory` lays the tab out and wires its refresh.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine import metrics
from engine.config import K_BOUND
from playground import measure
from playground.render.charts import empty_figure
from playground.render.palette import GREY, PREDICTED_COLOUR, SPEC_COLOUR
from playground.view import RunView

R_VERIFY = 1.0   # Leviathan's assumption: a verify forward over K+1 tokens costs one target step
# Speed-ups within this relative distance of the maximum count as ties (won by the smaller K):
# with c = 0 the curve creeps up by ~1e-16 per K once alpha^K underflows the sum, and drafting
# 16 tokens for a gain nobody can measure is not a recommendation.
TIE_RTOL = 1e-9


@dataclass(frozen=True, slots=True)
class MeasuredPoint:
    """Rounds that drafted k tokens: how many tokens they emitted on average."""

    k: int
    rounds: int
    tokens_per_round: float


@dataclass(frozen=True, slots=True)
class TheoryInputs:
    """What the curves are drawn for, all read off the run's records."""

    alpha: float                   # accepted / drafted
    c: float                       # one draft forward / one target-only step (0 for n-gram)
    r: float                       # verify cost relative to one target step (assumed)
    points: tuple[MeasuredPoint, ...]
    measured_speedup: float | None  # measured tokens/s over the target-only baseline's
    mean_k: int


@dataclass(frozen=True, slots=True)
class NotMeasured:
    """Why there is nothing to draw yet."""

    reason: str


@dataclass(frozen=True, slots=True)
class TheoryCurves:
    ks: tuple[int, ...]
    expected: tuple[float, ...]   # E(alpha, K) = sum_{i<=K} alpha^i
    speedup: tuple[float, ...]    # E / (cK + r)
    best_k: int                   # the curve's argmax (the smallest K on ties, within TIE_RTOL)

    @property
    def best_speedup(self) -> float:
        return self.speedup[self.ks.index(self.best_k)]


def theory_inputs(view: RunView | None) -> TheoryInputs | NotMeasured:
    """The measured alpha and c of a run, or why they are not measured yet."""
    if view is None or not view.rounds:
        return NotMeasured("Not measured yet: step at least one speculative round in the playground.")
    alpha = measure.acceptance(view.rounds)
    if alpha is None:
        return NotMeasured("Not measured yet: no round has drafted anything (target-only, or no n-gram match).")
    ratio = measure.cost_ratio(view)
    if ratio is None:
        return NotMeasured("c not measured yet: it needs the target-only baseline's timings (not recorded in "
                           "target-only mode) and a timed draft forward.")
    by_k: dict[int, list[int]] = {}
    for r in measure.drafted_rounds(view.rounds):
        by_k.setdefault(r.k, []).append(len(r.emitted))
    points = tuple(MeasuredPoint(k, len(n), sum(n) / len(n)) for k, n in sorted(by_k.items()))
    return TheoryInputs(alpha, ratio.c, R_VERIFY, points, measure.measured_speedup(view), measure.mean_k(view.rounds))


def theory_curves(alpha: float, c: float, r: float = R_VERIFY, k_max: int = K_BOUND) -> TheoryCurves:
    """E(alpha, K) and the predicted speed-up for K = 1..k_max, and the K with the highest speed-up."""
    ks = tuple(range(1, k_max + 1))
    expected = tuple(metrics.expected_tokens_per_round(alpha, k) for k in ks)
    speedup = tuple(metrics.predicted_speedup(alpha, k, c, r) for k in ks)
    top = max(speedup)
    best = next(k for k, s in zip(ks, speedup) if s >= top * (1 - TIE_RTOL))
    return TheoryCurves(ks, expected, speedup, best)


def curves_for(inputs: TheoryInputs, k_max: int = K_BOUND) -> TheoryCurves:
    return theory_curves(inputs.alpha, inputs.c, inputs.r, k_max)


def theory_figure(view: RunView | None, k_max: int = K_BOUND) -> go.Figure:
    """Two panels over K: E(alpha, K) with the measured tokens per round, and the predicted speed-up
    with the measured one; the recommended K marked on both."""
    inputs = theory_inputs(view)
    if isinstance(inputs, NotMeasured):
        return empty_figure(inputs.reason)
    curves = curves_for(inputs, k_max)
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        f"E(α, K): tokens per round, α = {inputs.alpha:.3f}",
        f"predicted speed-up E / (cK + {inputs.r:g}), c = {inputs.c:.3f}"))
    ks = list(curves.ks)
    fig.add_trace(go.Scatter(x=ks, y=list(curves.expected), mode="lines+markers", name="E(α, K), Leviathan",
                             line=dict(color=PREDICTED_COLOUR)), row=1, col=1)
    fig.add_trace(go.Scatter(x=[p.k for p in inputs.points], y=[p.tokens_per_round for p in inputs.points],
                             mode="markers", name="measured tokens per round",
                             marker=dict(color=SPEC_COLOUR, size=12, symbol="diamond"),
                             text=[f"{p.rounds} rounds at K={p.k}" for p in inputs.points]), row=1, col=1)
    fig.add_trace(go.Scatter(x=ks, y=list(curves.speedup), mode="lines+markers", name="predicted speed-up",
                             line=dict(color=PREDICTED_COLOUR, dash="dot")), row=1, col=2)
    if inputs.measured_speedup is not None:
        fig.add_trace(go.Scatter(x=[inputs.mean_k], y=[inputs.measured_speedup], mode="markers",
                                 name="measured speed-up (at the run's mean K)",
                                 marker=dict(color=SPEC_COLOUR, size=12, symbol="star")), row=1, col=2)
    fig.add_hline(y=1.0, line=dict(color=GREY, width=1), row=1, col=2)
    for col in (1, 2):
        fig.add_vline(x=curves.best_k, line=dict(color="#000", dash="dash", width=1), row=1, col=col)
    fig.update_xaxes(title_text="K (drafts per round)", dtick=1 if k_max <= 16 else None)
    fig.update_layout(height=380, template="plotly_white", margin=dict(l=50, r=20, t=60, b=45),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def recommendation_html(view: RunView | None, k_max: int = K_BOUND) -> str:
    """The recommended K and whether speculation is predicted to pay, with where each number comes from."""
    inputs = theory_inputs(view)
    if isinstance(inputs, NotMeasured):
        return f'<p class="theory-note"><em>{html.escape(inputs.reason)}</em></p>'
    curves = curves_for(inputs, k_max)
    pays = curves.best_speedup > 1.0
    verdict = (f"predicted to pay: {curves.best_speedup:.2f}× at K = {curves.best_k}" if pays else
               f"not predicted to pay: even the best K ({curves.best_k}) gives {curves.best_speedup:.2f}×")
    measured = "—" if inputs.measured_speedup is None else f"{inputs.measured_speedup:.2f}× at mean K = {inputs.mean_k}"
    rows = [("recommended K", f"{curves.best_k} (the curve's maximum over K = 1..{k_max})"),
            ("verdict", verdict),
            ("α (measured: accepted / drafted)", f"{inputs.alpha:.3f}"),
            ("c (measured: draft forward / target-only step)", f"{inputs.c:.3f}"),
            ("r (verify forward / target step)", f"{inputs.r:g} (assumed, as in Leviathan et al.)"),
            ("measured speed-up", measured)]
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv-table">{body}</table>'


# -- the tab ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TheoryPage:
    figure: gr.Plot
    recommendation: gr.HTML
    refresh: gr.Button

    def outputs(self) -> list:
        return [self.figure, self.recommendation]


def render(view: RunView | None) -> tuple[go.Figure, str]:
    return theory_figure(view), recommendation_html(view)


def refresh(session) -> tuple[go.Figure, str]:
    """Event handler: the theory panel for the playground session's run (a Session or None)."""
    if session is None:
        return render(None)
    with session.lock:
        view, cursor = session.view(), session.cursor
        # Only verified rounds: a round whose drafts are still pending would give its verdict away.
        verified = view.upto(cursor.shown - (0 if cursor.revealed else 1)) if view is not None else None
    return render(verified)


def build_theory(state: gr.State) -> TheoryPage:
    """Lay the tab out in the current Blocks context. `state` is the playground's per-visitor
    gr.State holding its Session; the panel reads the rounds shown there."""
    gr.Markdown("Leviathan et al.'s model: each draft is accepted with probability α, so a round with K drafts "
                "emits E(α, K) = (1 − α^(K+1)) / (1 − α) tokens; it costs K draft forwards (c each) and one verify "
                "forward. α and c are measured from the playground's run, never assumed.")
    figure = gr.Plot(show_label=False, elem_id="theory-plot")
    recommendation = gr.HTML(elem_id="theory-recommendation")
    refresh_button = gr.Button("↻ Update from the playground's run", size="sm", elem_id="theory-refresh")
    page = TheoryPage(figure, recommendation, refresh_button)
    refresh_button.click(refresh, [state], page.outputs(), api_name=False)
    return page

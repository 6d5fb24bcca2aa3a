"""Live charts, redrawn from the records each round their tab is shown: acceptance, accepted lengths, time, speed-up."""
from __future__ import annotations

import html
import math
from collections import Counter
from collections.abc import Callable

import plotly.graph_objects as go

from engine import metrics
from engine.config import K_BOUND, Mode
from engine.metrics import NotMeasured, Prediction
from playground.render.palette import BASELINE_COLOUR, GREEN, GREY, PREDICTED_COLOUR, SPEC_COLOUR, styled_figure
from playground.view import RunView

HEIGHT = 300


def chart_figure(traces: list, title: str, xtitle: str, ytitle: str, **layout) -> go.Figure:
    return styled_figure(traces, title=dict(text=title, font=dict(size=14)), height=HEIGHT,
                         margin=dict(l=50, r=20, t=50, b=45), xaxis=dict(title=xtitle), yaxis=dict(title=ytitle),
                         legend=dict(orientation="h", y=-0.3), **layout)


def empty_figure(message: str) -> go.Figure:
    return styled_figure(annotations=[dict(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")],
                         height=HEIGHT, xaxis=dict(visible=False), yaxis=dict(visible=False))


def _no_drafts(view: RunView) -> str | None:
    if not view.rounds:
        return "No rounds yet."
    if not metrics.drafted_rounds(view.rounds):   # short lines: the message sits in a third of the row
        if view.info.config.mode is Mode.TARGET:
            return "Target-only decoding:<br>nothing is drafted."
        if len(view.rounds) == 1:
            return "Nothing drafted yet:<br>the first round reads the prompt."
        return "Nothing drafted yet:<br>prompt lookup drafts<br>once the text repeats."
    return None


def acceptance_figure(view: RunView) -> go.Figure:
    """Per-round draft acceptance (bars), and both cumulative measures: accepted / drafted and
    alpha = accepted / verified positions (the one Leviathan's formula takes)."""
    if (msg := _no_drafts(view)) is not None:
        return empty_figure(msg)
    xs = [r.index + 1 for r in view.rounds]
    per_round = [metrics.draft_acceptance([r]) for r in view.rounds]
    drafted, verified = metrics.running_acceptance(view.rounds)
    return chart_figure([go.Bar(x=xs, y=per_round, name="this round (accepted / drafted)", marker_color=GREEN, opacity=0.7),
                    go.Scatter(x=xs, y=drafted, name="draft acceptance rate: accepted / drafted", mode="lines",
                               line=dict(color="#000")),
                    go.Scatter(x=xs, y=verified, name="α: accepted / verified", mode="lines",
                               line=dict(color=SPEC_COLOUR, dash="dot"))],
                   "Acceptance", "round", "rate", yaxis_range=[0, 1.05])


def per_position_figure(view: RunView) -> go.Figure:
    """Acceptance at draft position i, over the rounds that reached position i."""
    if (msg := _no_drafts(view)) is not None:
        return empty_figure(msg)
    rates = metrics.position_rates(view.rounds)
    ys = [None if math.isnan(r) else r for r in rates]
    return chart_figure([go.Bar(x=list(range(1, len(rates) + 1)), y=ys, name="acceptance", marker_color=SPEC_COLOUR)],
                   "Per-position acceptance (a tree: per depth)", "draft position or tree depth",
                   "accepted / verified", yaxis_range=[0, 1.05], xaxis_dtick=1)


def accepted_length_figure(view: RunView) -> go.Figure:
    """How many drafts each round accepted."""
    if (msg := _no_drafts(view)) is not None:
        return empty_figure(msg)
    drafted = metrics.drafted_rounds(view.rounds)
    counts = Counter(r.accepted for r in drafted)
    xs = list(range(0, max(r.k for r in drafted) + 1))
    ys = [counts.get(x, 0) for x in xs]
    return chart_figure([go.Bar(x=xs, y=ys, name="rounds", marker_color=SPEC_COLOUR)],
                   "Accepted drafts per round", "accepted drafts", "rounds", xaxis_dtick=1,
                   yaxis_dtick=1 if max(ys) <= 10 else None)    # a count of rounds: no half-rounds on its axis


def tokens_time_figure(view: RunView) -> go.Figure:
    """Cumulative tokens against decode time, speculative and target-only, both measured."""
    if not view.rounds:
        return empty_figure("No rounds yet.")
    traces = [go.Scatter(x=[0] + [r.elapsed_s for r in view.rounds], y=[0] + [r.tokens_total for r in view.rounds],
                         name=f"speculative ({view.info.config.mode.value})", mode="lines+markers",
                         line=dict(color=SPEC_COLOUR, shape="hv"))]
    if view.baseline:
        traces.append(go.Scatter(x=[0] + [b.elapsed_s for b in view.baseline],
                                 y=[0] + [b.tokens_total for b in view.baseline], name="target-only (measured)",
                                 mode="lines", line=dict(color=BASELINE_COLOUR, dash="dash", shape="hv")))
    return chart_figure(traces, "Tokens vs decode time (prefill included)", "seconds", "tokens generated")


def speedup_figure(view: RunView) -> go.Figure:
    """Measured speed-up after each round, decoding after the prefill as the formula counts it, beside Leviathan's
    prediction from the measured α and c."""
    if not view.rounds or not view.baseline:
        return empty_figure("Needs a target-only baseline (not recorded in target-only mode).")
    xs, measured, predicted, band = speedup_series(view)
    v1 = view.info.config.mode is Mode.V1
    parity = dict(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=1.0, y1=1.0, line=dict(color=GREY, width=1))
    lows, highs = [b[0] if b else None for b in band], [b[1] if b else None for b in band]
    # the prediction's band: α's 95% interval over the positions verified so far (wide after a few rounds)
    interval = [go.Scatter(x=xs, y=highs, mode="lines", line=dict(width=0, color=PREDICTED_COLOUR), hoverinfo="skip",
                           showlegend=False),
                go.Scatter(x=xs, y=lows, mode="lines", line=dict(width=0, color=PREDICTED_COLOUR), fill="tonexty",
                           fillcolor="rgba(230, 159, 0, 0.18)", name="predicted with α's 95% interval")]
    return chart_figure([go.Scatter(x=xs, y=measured, name="measured", mode="lines+markers", line=dict(color=SPEC_COLOUR)),
                         go.Scatter(x=xs, y=predicted, name=f"predicted: {metrics.formula_text(v1)}, all measured",
                                    mode="lines", line=dict(color=PREDICTED_COLOUR, dash="dot")),
                         *interval],
                        "Speed-up over target-only, after the prefill", "round", "× target-only", shapes=[parity],
                        xaxis_dtick=1 if len(xs) <= 12 else None)        # rounds are whole: no round 1.5


def identity_badge(view: RunView | None) -> str:
    """Greedy runs must reproduce target-only token for token; sampled runs need not."""
    if view is None or not view.rounds:
        return '<span class="badge na">no tokens yet</span>'
    if not view.info.greedy:
        return '<span class="badge na">sampling (T &gt; 0): identical output is not expected</span>'
    same = view.identical_to_baseline()
    if same is None:
        return '<span class="badge na">no target-only baseline to compare</span>'
    n = min(len(view.spec_tokens), len(view.baseline_tokens))
    if same:
        return f'<span class="badge ok">✓ greedy output identical to target-only ({n} tokens)</span>'
    return f'<span class="badge bad">✗ greedy output differs from target-only within {n} tokens</span>'


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if not metrics.finite(x) else f"{x:{spec}}{suffix}"


def summary_html(view: RunView | None) -> str:
    """The headline numbers, each labelled with where it comes from."""
    if view is None or not view.rounds:
        return ""
    last = view.rounds[-1]
    pred = view.prediction()
    rows = [
        ("run", f"{view.info.label()} · {view.source}"),
        ("tokens / rounds", f"{last.tokens_total} / {len(view.rounds)}" + (" (finished)" if last.finished else "")),
        ("draft acceptance rate: accepted / drafted", _fmt(metrics.draft_acceptance(view.rounds), ".3f")),
        ("α: accepted / verified positions", _fmt(metrics.alpha(view.rounds), ".3f")),
        ("tokens per drafted round (τ)", _fmt(metrics.tokens_per_round(view.rounds))),
        ("c, measured from this run", _cost_text(view)),
        ("r(K+1): a verify forward of K + 1 rows / a target step", "—" if isinstance(pred, NotMeasured)
                                                                  else f"at mean K = {pred.k}: {r_text(pred)}"),
        ("speed-up after the prefill: measured / predicted",
         f"{_fmt(metrics.decode_speedup(view.rounds, view.baseline), suffix='×')} / "
         + ("—" if isinstance(pred, NotMeasured) else f"{pred.speedup_iid:.2f}×")),
        ("measured / predicted, taken apart", _gap_text(view)),
        ("on this machine, for this drafter and sampling", "—" if isinstance(pred, NotMeasured) else
                                                           verdict(pred, view.calibration.at)),
        ("tokens/s, the prefill included: speculative / target-only",
         f"{_fmt(metrics.tokens_per_s(view.rounds), '.1f')} / {_fmt(metrics.tokens_per_s(view.baseline), '.1f')} "
         f"({_fmt(metrics.measured_speedup(view.rounds, view.baseline), suffix='×')})"),
        ("target forwards: speculative / target-only", f"{sum(r.target_forwards for r in view.rounds)} / "
                                                       f"{sum(b.target_forwards for b in view.baseline)}"),
    ]
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv-table">{body}</table>'


def r_text(pred: Prediction) -> str:
    """The r(K+1) a prediction read and where from: the run's own verify forwards, or the calibration's."""
    if pred.r_forwards:
        return (f"{pred.r:.2f} from this run's {pred.r_forwards} verify forwards over its target-only steps "
                f"(calibrated: {pred.r_calibrated:.2f})")
    return f"{pred.r:.2f} calibrated (the run's own once it has verified {metrics.OWN_R_LEAST} times at this K)"


def verdict(pred: Prediction, r_of_n: Callable[[int], float], k_max: int = K_BOUND) -> str:
    """Whether speculation is predicted to pay at its best K for this run's α, c and r(n), and when it is not, why:
    what a round at that K yields against what it costs, in target steps."""
    best = metrics.best_k(pred.alpha, pred.c, r_of_n, k_max, pred.commit)
    tokens = metrics.expected_tokens_per_round(pred.alpha, best)
    commit = metrics.commit_cost(pred.alpha, best, r_of_n, pred.commit)
    cost = pred.c * best + r_of_n(best + 1) + commit
    second = f", and v1's commit forward {commit:.2f}" if pred.commit else ""
    if tokens / cost > 1.0:
        return f"predicted to pay: {tokens / cost:.2f}× at K = {best}"
    return (f"not predicted to pay: even the best K ({best}) gives {tokens / cost:.2f}×, since a round yields "
            f"{tokens:.2f} tokens for the time of {cost:.2f} target steps (α {pred.alpha:.2f}, c {pred.c:.3f}, "
            f"r({best + 1}) {r_of_n(best + 1):.2f} on this machine{second})")


def _gap_text(view: RunView) -> str:
    """measured / predicted as tokens × verify × rest (metrics.PredictionGap): which of the formula's inputs the
    run departed from, or that the time went outside the forwards, which the formula does not count."""
    gap = metrics.prediction_gap(view.rounds, view.baseline, view.calibration.at if view.calibration else None)
    if gap is None:
        return "—"
    return (f"{gap.tokens * gap.verify * gap.rest:.2f} = {gap.tokens:.2f} tokens (yielded / E(α, K) expects) × "
            f"{gap.verify:.2f} verify (the r read / the rounds' own) × {gap.rest:.2f} the rest (time outside the "
            f"forwards: sampling, verification, drafting's bookkeeping)")


def _cost_text(view: RunView) -> str:
    c = metrics.cost_ratio(view.rounds, view.baseline)
    if c is None:
        return "—"
    draft, step = metrics.draft_forward_ms(view.rounds), metrics.target_step_ms(view.baseline)
    if draft is None:
        return "0 (prompt lookup: no draft forwards)"
    return f"{c:.3f} = {draft:.2f} ms per draft forward / {step:.2f} ms per target step"


def speedup_series(view: RunView) -> tuple[list[int], list[float | None], list[float | None],
                                           list[tuple[float, float] | None]]:
    """(round numbers, measured, predicted, the prediction's band from α's interval) after each round, from the
    records up to that round: the same as reading `view.upto(n)` for every n, in one pass (the prediction's
    sums are carried from round to round in a metrics.Tally, so a run of n rounds costs O(n), not O(n²))."""
    curve = view.calibration.at if view.calibration else None
    tally, counted = metrics.Tally(), 0
    xs, measured, predicted, band = [], [], [], []
    for n, r in enumerate(view.rounds, 1):
        tally.add(r)
        by = view.baseline_by(r.tokens_total)
        for b in view.baseline[counted:by]:
            tally.add_baseline(b)
        counted = by
        xs.append(n)
        measured.append(metrics.decode_speedup(view.rounds[:n], view.baseline[:by]))
        predicted.append(tally.speedup_iid(curve))
        band.append(tally.speedup_iid_interval(curve))
    return xs, measured, predicted, band

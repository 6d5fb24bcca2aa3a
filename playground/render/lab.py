"""The Losslessness lab's pictures: a result's frequencies beside p_target, its table and its verdict."""
from __future__ import annotations

import html
from collections.abc import Mapping

import plotly.graph_objects as go

from playground.render.charts import empty_figure
from playground.render.palette import BLUE, ORANGE, VERMILLION, styled_figure
from playground.render.tokens import visible
from playground.teach.lab import ALPHA_LEVEL, LabResult, top_tokens
from playground.teach.losslessness import MIN_SAMPLES, Rule


def lab_figure(result: LabResult, index: int, texts: Mapping[int, str]) -> go.Figure:
    """Empirical frequencies of the emitted token at one output index beside p_target and the
    rule's exact limit, over the most likely tokens. texts: token id -> text for the axis."""
    n = int(result.counts[index].sum())
    if n == 0:
        return empty_figure(f"Output index {index} never emitted a token in {result.trials:,} rounds.")
    ids = top_tokens(result, index)
    labels = [f"{visible(texts.get(t, str(t)))} #{t}" for t in ids]
    freq = result.counts[index].double() / n
    fig = styled_figure([
        go.Bar(name=f"empirical ({n:,} tokens)", x=labels, y=[float(freq[t]) for t in ids], marker_color=BLUE),
        go.Scatter(name="p_target (what the target would sample)", x=labels,
                   y=[float(result.p_target[index][t]) for t in ids], mode="markers",
                   marker=dict(symbol="line-ew-open", size=28, color="#000", line=dict(width=3, color="#000"))),
        go.Scatter(name=f"limit under “{result.rule.value}”", x=labels,
                   y=[float(result.limit.dist[index][t]) for t in ids], mode="markers",
                   marker=dict(symbol="x", size=9, color=VERMILLION if result.rule is not Rule.CORRECT else ORANGE)),
    ])
    fit = next((f for f in result.fits if f.index == index), None)
    verdict = "not tested (too few tokens)" if fit is None else (
        f"χ² = {fit.statistic:.1f}, dof = {fit.dof}, p-value = {fit.p_value:.3g} → "
        + ("consistent with p_target" if fit.passed else "REJECTED: not distributed as p_target"))
    row = result.start + index
    fig.update_layout(title=dict(text=f"output index {index}: p row {row} of round {result.round + 1}"
                                      f"{' (the bonus row)' if index == result.length else ''}<br>{verdict}",
                                 font=dict(size=14)),
                      xaxis=dict(type="category"),
                      height=380, margin=dict(l=50, r=20, t=70, b=90),
                      yaxis=dict(title="probability", rangemode="tozero"), legend=dict(orientation="h", y=-0.35))
    return fig


def fits_table_html(result: LabResult) -> str:
    """One row per output index: tokens emitted, chi-square, dof, p-value, verdict."""
    rows = []
    for i in range(result.counts.shape[0]):
        n = int(result.counts[i].sum())
        fit = next((f for f in result.fits if f.index == i), None)
        cells = [str(i), f"{n:,}"] + (["—", "—", "—", f"not tested (< {MIN_SAMPLES} tokens)"] if fit is None else [
            f"{fit.statistic:.1f}", str(fit.dof), f"{fit.p_value:.3g}", "✓ pass" if fit.passed else "✗ FAIL"])
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("output index", "tokens", "χ²", "dof", "p-value",
                                              f"at level {ALPHA_LEVEL:g}"))
    return f'<table class="kv-table"><tr>{head}</tr>{"".join(rows)}</table>'


def verdict_html(result: LabResult) -> str:
    if not result.fits:
        return '<span class="badge na">no output index had enough tokens to test: raise N</span>'
    if result.passed:
        return (f'<span class="badge ok">✓ “{html.escape(result.rule.value)}”: every tested index is consistent with '
                f'p_target ({result.trials:,} rounds)</span>')
    failed = ", ".join(str(f.index) for f in result.fits if not f.passed)
    return (f'<span class="badge bad">✗ “{html.escape(result.rule.value)}”: index {failed} is not distributed as '
            f'p_target ({result.trials:,} rounds) — this rule is not lossless</span>')


def describe_html(result: LabResult) -> str:
    last = result.start + result.length
    given = "" if result.start == 0 else f", from the moment its first {result.start} draft(s) were accepted"
    return (f"<p>Round {result.round + 1}: verifying drafts #{result.start + 1}–#{last} with q rows "
            f"{result.start}–{last - 1} and p rows {result.start}–{last} (row {last} is their bonus row). The rows "
            "are held fixed and the drafts are re-drawn from q every time, as if the round were run "
            f"{result.trials:,} times{given}.</p>")

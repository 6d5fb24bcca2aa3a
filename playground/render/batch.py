"""The batch view's pictures and tables, from a goodput study (engine.bench.batch.BatchStudy)."""
from __future__ import annotations

import html

import plotly.graph_objects as go

from engine.bench.batch import BatchStudy
from engine.bench.plot import batch_figure
from playground.render.charts import empty_figure
from playground.render.palette import styled_figure


def study_figure(study: BatchStudy | None) -> go.Figure:
    """tokens/s and speed-up against batch size, measured and predicted (engine.bench.plot.batch_figure)."""
    if study is None:
        return empty_figure("No batch study yet: pick a measured one or measure here.")
    fig = batch_figure(study)
    fig.update_layout(title=None, height=460, margin={"t": 40, "b": 40})
    return fig


def cost_figure(study: BatchStudy | None) -> go.Figure:
    """r_B(n) per batch size: a verify of n rows per sequence against target-only's one, as B grows."""
    if study is None:
        return empty_figure("r_B(n) appears with a study.")
    fig = styled_figure()
    for curve in study.costs:
        fig.add_scatter(x=curve.ns, y=curve.r, mode="lines+markers", name=f"B = {curve.batch}",
                        hovertemplate="n = %{x} rows each: %{y:.2f}× target-only<extra>B = " + str(curve.batch)
                                      + "</extra>")
    fig.update_layout(xaxis_title="rows per sequence n (a verify of K drafts: n = K + 1)",
                      yaxis_title="forward cost / target-only's (r_B(n))", height=360,
                      legend={"orientation": "h", "y": -0.25})
    return fig


def summary_markdown(study: BatchStudy | None) -> str:
    """Where it was measured, the command, and the table of best K."""
    if study is None:
        return ""
    lengths = sorted(study.prompt_lengths)
    lines = [f"**{html.escape(study.target)}**, {len(lengths)} {html.escape(study.prompt_set)} prompts "
             f"({lengths[0]}–{lengths[-1]} tokens), {study.new_tokens} new tokens each, greedy, medians of "
             f"{study.repeats}; measured on {html.escape(study.machine)} in {study.wall_s:.0f} s."]
    if study.command:
        lines.append(f"`{study.command}`")
    drafters = list(dict.fromkeys(b.drafter for b in study.best_k))
    lines += ["", "Best K per batch size, predicted · measured (speed-up over target-only):", "",
              "| B | " + " | ".join(drafters) + " |", "|---|" + "---|" * len(drafters)]
    for batch in study.batches:
        cells = [f"{b.predicted_k} ({b.predicted_speedup:.2f}×) · {b.measured_k} ({b.measured_speedup:.2f}×)"
                 for b in study.best_k if b.batch == batch]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

"""The bench's figure: measured speed-up against K beside the predicted one (plotly, a tool's output)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.bench.methods import METHOD_NAMES
from engine.bench.report import BenchMeta
from engine.bench.results import MethodResult


def write_plot(results: Sequence[MethodResult], meta: BenchMeta, path: Path) -> Path:
    """Decode speed-up (after each run's first token, what the prediction speaks of) against K, measured (solid)
    beside predicted (dotted), one colour per method.

    A .png needs kaleido; without it the figure is written as .html next to the asked path.
    Returns the path actually written.
    """
    import importlib.util

    import plotly.graph_objects as go

    fig = go.Figure()
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
               "#17becf", "#000000", "#aec7e8", "#ffbb78")
    swept = [m for m in METHOD_NAMES if any(r.method == m and r.schedule == "constant" for r in results)]
    for colour, name in zip(palette, swept):
        rs = sorted((r for r in results if r.method == name), key=lambda r: r.k)
        ks = [r.k for r in rs]
        fig.add_scatter(x=ks, y=[r.decode_speedup for r in rs], name=f"{name} measured", mode="lines+markers",
                        line={"color": colour})
        fig.add_scatter(x=ks, y=[r.predicted_speedup for r in rs], name=f"{name} predicted", mode="lines+markers",
                        line={"color": colour, "dash": "dot"}, marker={"symbol": "circle-open"})
    for r in results:
        if r.schedule == "heuristic":
            fig.add_scatter(x=[r.mean_k], y=[r.decode_speedup], name=f"{r.method} (mean K)", mode="markers",
                            marker={"symbol": "star", "size": 12})
    fig.add_hline(y=1.0, line={"color": "grey", "dash": "dash"}, annotation_text=meta.fastest_baseline)
    fig.update_layout(title=f"Speed-up over {meta.fastest_baseline}: {meta.target} <- {meta.draft}, "
                            f"{meta.prompt_set} prompts, {meta.new_tokens} new tokens",
                      xaxis_title="K (draft tokens per round)", yaxis_title="decode speed-up (x), after the first token",
                      template="plotly_white")
    if path.suffix == ".png" and importlib.util.find_spec("kaleido") is not None:
        fig.write_image(str(path), width=1000, height=600)
        return path
    out = path.with_suffix(".html")
    fig.write_html(str(out), include_plotlyjs=True)  # self-contained: works offline
    return out


def batch_figure(study):
    """Goodput against batch size (engine.bench.batch.BatchStudy): tokens/s over all sequences on the left,
    speed-up over target-only at the same B on the right, measured (solid) beside Leviathan's prediction
    from the measured r_B(n) (dotted), the break-even line, and a cross where each method stops paying."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s, all sequences", "speed-up over target-only"),
                        horizontal_spacing=0.1)
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
    for colour, method in zip(("#555555", *palette), study.methods()):
        points = sorted((p for p in study.points if p.method == method), key=lambda p: p.batch)
        xs = [p.batch for p in points]
        fig.add_scatter(x=xs, y=[p.tokens_per_s for p in points], name=method, mode="lines+markers",
                        line={"color": colour}, legendgroup=method, row=1, col=1)
        if method == "target":
            continue
        fig.add_scatter(x=xs, y=[p.speedup for p in points], name=f"{method}", mode="lines+markers",
                        line={"color": colour}, legendgroup=method, showlegend=False, row=1, col=2)
        fig.add_scatter(x=xs, y=[p.predicted for p in points], name=f"{method} predicted", mode="lines+markers",
                        line={"color": colour, "dash": "dot"}, marker={"symbol": "circle-open"},
                        legendgroup=method, row=1, col=2)
        stop = study.crossover(method)
        if stop is not None:   # where it stops paying: a cross on its measured point
            fig.add_scatter(x=[stop], y=[study.point(stop, method).speedup], mode="markers", showlegend=False,
                            marker={"symbol": "x", "size": 14, "color": colour, "line": {"width": 1}},
                            hovertemplate=f"{method} stops paying at B={stop}<extra></extra>",
                            legendgroup=method, row=1, col=2)
    fig.add_hline(y=1.0, line={"color": "grey", "dash": "dash"}, row=1, col=2)
    for col in (1, 2):
        fig.update_xaxes(type="log", tickvals=study.batches, ticktext=[str(b) for b in study.batches],
                         title_text="batch size B", row=1, col=col)
    fig.update_layout(title=f"Goodput against batch size: {study.target}, {study.new_tokens} new tokens, "
                            f"{study.machine}", template="plotly_white", height=480,
                      legend={"orientation": "h", "y": -0.2})
    return fig


def write_batch_plot(study, path: Path) -> Path:
    """`batch_figure` as a .png (with kaleido) or a self-contained .html next to the asked path."""
    import importlib.util

    fig = batch_figure(study)
    if path.suffix == ".png" and importlib.util.find_spec("kaleido") is not None:
        fig.write_image(str(path), width=1100, height=500)
        return path
    out = path.with_suffix(".html")
    fig.write_html(str(out), include_plotlyjs=True)
    return out

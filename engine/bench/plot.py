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

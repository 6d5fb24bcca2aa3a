"""The Compare tab: two traces side by side. Works from the files alone, with no session or model."""
from __future__ import annotations

import logging

import gradio as gr

from engine.trace import TraceError, load_trace
from playground.render.charts import empty_figure
from playground.render.compare import compare_per_position, compare_table_html, compare_tokens_time
from playground.render.tokens import stream_html
from playground.view import Cursor, RunView, view_from_trace

log = logging.getLogger("specplay")


def _load(upload: str | None, example: str | None, name: str) -> RunView:
    path = upload or example
    if not path:
        raise TraceError(f"Pick or upload trace {name}.")
    return view_from_trace(load_trace(path), f"{name}: {path.rsplit('/', 1)[-1]}")


def compare(upload_a: str | None, example_a: str | None, upload_b: str | None, example_b: str | None):
    """Render the comparison; a bad file becomes a warning and leaves the outputs unchanged."""
    try:
        a, b = _load(upload_a, example_a, "A"), _load(upload_b, example_b, "B")
    except TraceError as exc:
        gr.Warning(str(exc))
        return (gr.skip(),) * 5
    except Exception as exc:  # a bug, not a bad file: log it, tell the visitor briefly, keep the tab working
        log.exception("unexpected error while comparing traces")
        gr.Warning(f"Unexpected error ({type(exc).__name__}) while reading the traces.")
        return (gr.skip(),) * 5
    return (compare_table_html(a, b), compare_tokens_time(a, b), compare_per_position(a, b),
            stream_html(a, Cursor(shown=len(a.rounds))), stream_html(b, Cursor(shown=len(b.rounds))))


def build(examples: list[tuple[str, str]]) -> None:
    """Lay out the tab and wire its one event (it needs nothing from the rest of the app)."""
    pick = {"choices": examples, "label": "…or an example trace"}
    with gr.Row():
        with gr.Column():
            upload_a = gr.File(label="Trace A (.jsonl)", type="filepath", elem_id="compare-a")
            example_a = gr.Dropdown(value=examples[0][1] if examples else None, **pick)
        with gr.Column():
            upload_b = gr.File(label="Trace B (.jsonl)", type="filepath", elem_id="compare-b")
            example_b = gr.Dropdown(value=examples[-1][1] if examples else None, **pick)
    button = gr.Button("Compare", variant="primary", elem_id="compare-btn")
    table = gr.HTML()
    with gr.Row():
        tokens_time = gr.Plot(empty_figure("Tokens against time, both runs: pick two traces and press Compare."),
                              show_label=False)
        per_position = gr.Plot(empty_figure("Per-position acceptance, both runs: pick two traces and press Compare."),
                               show_label=False)
    with gr.Row():
        stream_a = gr.HTML(label="A")
        stream_b = gr.HTML(label="B")
    button.click(compare, [upload_a, example_a, upload_b, example_b],
                 [table, tokens_time, per_position, stream_a, stream_b], api_name="compare")

"""The Traces tab: download the run as JSON Lines plus a CSV round table; upload or pick a trace to replay."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from engine.sources import ASSETS

EXAMPLES_DIR = ASSETS / "traces"


def example_label(name: str) -> str:
    """How the Example traces list names a shipped trace file ("welcome_smollm2.jsonl": "welcome smollm2")."""
    return Path(name).stem.replace("_", " ")


def example_traces(folder: Path = EXAMPLES_DIR) -> list[tuple[str, str]]:
    """(label, path) of the shipped example traces, by file name."""
    return [(example_label(p.name), str(p)) for p in sorted(folder.glob("*.jsonl"))]


@dataclass(frozen=True)
class TracesPage:
    export: gr.Button
    files: gr.File
    upload: gr.File
    example: gr.Dropdown
    load_example: gr.Button


def build(examples: list[tuple[str, str]]) -> TracesPage:
    gr.Markdown("Every run is recorded: the speculative rounds **and** the target-only rounds measured beside "
                "them. A replayed trace drives every view with no model loaded, so a CPU-only Space or a "
                "classroom can replay a GPU run step by step. **Reset** returns to live decoding.")
    with gr.Row():
        with gr.Column():
            export = gr.Button("Export this run: trace (JSON Lines) + round table (CSV)", elem_id="export-btn")
            files = gr.File(label="Downloads", file_count="multiple", interactive=False, elem_id="export-files")
        with gr.Column():
            upload = gr.File(label="Upload a trace (.jsonl) to replay", file_types=[".jsonl", ".json", ".txt"],
                             type="filepath", elem_id="trace-upload")
            example = gr.Dropdown(examples, value=examples[0][1] if examples else None, label="Example traces")
            load_example = gr.Button("Replay the example", elem_id="load-example-btn")
    return TracesPage(export, files, upload, example, load_example)

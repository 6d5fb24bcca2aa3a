"""The Round detail tab: the identity badge, one token's verification, and the headline numbers."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr


@dataclass(frozen=True)
class DetailPage:
    badge: gr.HTML
    summary: gr.HTML
    position: gr.Dropdown
    detail: gr.Plot


def build() -> DetailPage:
    with gr.Row():
        badge = gr.HTML(elem_id="identity-badge")
        position = gr.Dropdown([], label="Token of the selected round (or click a chip)", elem_id="position-pick")
    detail = gr.Plot(label="Verification at the selected token", elem_id="detail-plot")
    summary = gr.HTML(elem_id="summary")
    return DetailPage(badge, summary, position, detail)

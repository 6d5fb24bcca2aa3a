"""The Round detail tab: the identity badge, one token's verification, and the headline numbers."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from playground.render.tokens import CHIP_CLICK_JS


@dataclass(frozen=True)
class DetailPage:
    badge: gr.HTML
    summary: gr.HTML
    position: gr.Dropdown
    detail: gr.HTML
    tree: gr.HTML


def build() -> DetailPage:
    with gr.Row():
        badge = gr.HTML(elem_id="identity-badge")
        position = gr.Dropdown([], label="Token of the selected round (or click a chip)", elem_id="position-pick")
    tree = gr.HTML(elem_id="tree-view", js_on_load=CHIP_CLICK_JS)
    detail = gr.HTML(label="Verification at the selected token", elem_id="detail-plot")
    summary = gr.HTML(elem_id="summary")
    return DetailPage(badge, summary, position, detail, tree)

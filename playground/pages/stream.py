"""The stream panel above every tab: where the run stands, the token chips, and their legend."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from playground.render.tokens import CHIP_CLICK_JS, legend_html


@dataclass(frozen=True)
class StreamPanel:
    status: gr.Markdown
    stream: gr.HTML


def build() -> StreamPanel:
    status = gr.Markdown(elem_id="status")
    stream = gr.HTML(elem_id="token-stream", js_on_load=CHIP_CLICK_JS, min_height=60)
    gr.HTML(legend_html(), elem_id="legend")
    return StreamPanel(status, stream)

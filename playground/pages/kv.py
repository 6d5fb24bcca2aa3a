"""The KV cache tab: the target's and the draft's paged caches after the round, and their block tables."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr


@dataclass(frozen=True)
class KVPage:
    target: gr.Plot
    draft: gr.Plot
    table: gr.HTML


def build() -> KVPage:
    gr.Markdown("Physical blocks × slots after the last verified round. **v2** writes K+1 slots in its verify "
                "forward and rolls the rejected ones back (✗); **v1** verifies without writing and commits only "
                "accepted tokens with a second forward, so it never rolls back.")
    target = gr.Plot(label="Target KV cache", elem_id="kv-target")
    draft = gr.Plot(label="Draft KV cache", elem_id="kv-draft")
    table = gr.HTML(elem_id="kv-table")
    return KVPage(target, draft, table)

"""The Charts tab: acceptance, accepted lengths, tokens against time and speed-up, redrawn every round."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr


@dataclass(frozen=True)
class ChartsPage:
    acceptance: gr.Plot
    per_position: gr.Plot
    lengths: gr.Plot
    tokens_time: gr.Plot
    speedup: gr.Plot


def build() -> ChartsPage:
    with gr.Row():   # three to a row where each gets 260 px, else they wrap: narrower, titles and legends get cut
        acceptance = gr.Plot(elem_id="chart-acceptance", show_label=False, min_width=260)
        per_position = gr.Plot(elem_id="chart-per-position", show_label=False, min_width=260)
        lengths = gr.Plot(elem_id="chart-lengths", show_label=False, min_width=260)
    with gr.Row():
        tokens_time = gr.Plot(elem_id="chart-tokens-time", show_label=False)
        speedup = gr.Plot(elem_id="chart-speedup", show_label=False)
    gr.Markdown("Target-only decoding is really run on the same prompt, settings and hardware, interleaved with "
                "the speculative rounds; each clock counts only its own work: its forwards, drafting, verification "
                "and the KV cache's bookkeeping. The round's record, rendering, the trace file and the page are "
                "outside the clocks, and the background measurement of r(n) waits for a round to end rather than "
                "run beside it. c (draft forward / target step) is measured from this run. The speed-up chart "
                "counts decoding after each run's prefill, as the formula and the bench's decode speed-up do; the "
                "prefill, one forward over the prompt in both runs, is in the tokens-against-time chart. A browser "
                "on the same machine shares its cores: a Step's round runs while the page handles the click (a page "
                "served on loopback shows no progress timer for a Step, which it would redraw on every frame), and "
                "the target-only steps that catch up with it run once the page has drawn the round.")
    return ChartsPage(acceptance, per_position, lengths, tokens_time, speedup)

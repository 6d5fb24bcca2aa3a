"""The Theory tab's layout: the model's curves, the measured r(n), and the recommendation.

Its refresh goes through the playground's handlers (playground.ui), like every other event."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr
import plotly.graph_objects as go

from engine.bench.formats import shipped_study
from engine.clock import machine_name
from playground.render.theory import formats_figure, formats_html, r_figure, recommendation_html, theory_figure
from playground.view import RunView


@dataclass(frozen=True)
class TheoryPage:
    figure: gr.Plot
    r_curve: gr.Plot
    recommendation: gr.HTML
    formats: gr.Plot
    formats_text: gr.HTML
    refresh: gr.Button
    remeasure: gr.Button

    def outputs(self) -> list:
        return [self.figure, self.r_curve, self.recommendation, self.formats, self.formats_text]


def render(view: RunView | None) -> tuple[go.Figure, go.Figure, str, go.Figure, str]:
    """The tab's outputs for a run's verified rounds."""
    study = shipped_study()
    return (theory_figure(view), r_figure(view), recommendation_html(view), formats_figure(study),
            formats_html(study, view, machine=machine_name()))


def build() -> TheoryPage:
    """Lay the tab out in the current Blocks context."""
    gr.Markdown("Leviathan et al.'s model: each verified draft is accepted with probability α, so a round with K "
                "drafts emits E(α, K) = (1 − α^(K+1)) / (1 − α) tokens; it costs K draft forwards (c each) and one "
                "verify forward over K + 1 tokens, r(K+1) times a one-token step. α, c and r(n) are all measured "
                "(α = accepted / verified positions; r(n) by a calibration of the target when the pair loads, "
                "and at the K a run verifies, once it has three such forwards, by its own verify forwards over its "
                "target-only steps), never assumed. The curves over K read the calibration.")
    figure = gr.Plot(show_label=False, elem_id="theory-plot")
    r_curve = gr.Plot(show_label=False, elem_id="theory-r")
    recommendation = gr.HTML(elem_id="theory-recommendation")
    with gr.Row():
        refresh_button = gr.Button("↻ Update from the playground's run", size="sm", elem_id="theory-refresh")
        remeasure = gr.Button("⏱ Measure r(n) again", size="sm", elem_id="theory-remeasure")
    gr.Markdown("#### When a forward stops being memory-bound\nThe same model in each of its weight formats, its "
                "r(n) measured one after the other on one machine, and dotted, llama.cpp's own forward on the same "
                "weights' files (`python -m engine calibrate --llamacpp`; this copy ships such measurements and draws "
                "the one from a CPU of this machine's make where it has one): what a verify of K + 1 rows costs "
                "depends on what a row costs.")
    formats = gr.Plot(show_label=False, elem_id="theory-formats")
    formats_text = gr.HTML(elem_id="theory-formats-text")
    return TheoryPage(figure, r_curve, recommendation, formats, formats_text, refresh_button, remeasure)

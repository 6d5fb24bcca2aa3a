"""The Losslessness lab tab's layout: a rule, N and a seed; the verdict, the plot and the table.

Running it goes through the playground's handlers (playground.ui): the controller hands over the
selected round's rows, playground.teach.lab runs the experiment, playground.render.lab draws it."""
from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr

from playground.components import RawNumber
from playground.render.charts import empty_figure
from playground.render.lab import describe_html, fits_table_html, lab_figure, verdict_html
from playground.teach.lab import DEFAULT_TRIALS, MAX_TRIALS, LabResult
from playground.teach.losslessness import Rule

RULE_CHOICES = [("correct: accept min(1, p/q), correct from max(0, p − q), bonus from row K", Rule.CORRECT.value),
                ("wrong: discard on reject (emit nothing after a rejection)", Rule.DISCARD_ON_REJECT.value),
                ("wrong: bonus from row K − 1", Rule.BONUS_FROM_ROW_K_MINUS_1.value),
                ("wrong: correction from p instead of the residual", Rule.CORRECTION_FROM_P.value)]


@dataclass(frozen=True)
class LabPage:
    rule: gr.Radio
    trials: RawNumber
    seed: RawNumber
    auto_window: gr.Checkbox
    start: RawNumber
    length: RawNumber
    run: gr.Button
    index: gr.Dropdown
    verdict: gr.HTML
    describe: gr.HTML
    figure: gr.Plot
    table: gr.HTML
    result: gr.State

    def inputs(self) -> list:
        return [self.rule, self.trials, self.seed, self.auto_window, self.start, self.length]

    def outputs(self) -> list:
        return [self.result, self.verdict, self.describe, self.figure, self.table, self.index]


def render(result: LabResult, texts: dict[int, str]) -> tuple:
    """The outputs for a finished experiment, plotting its least consistent index."""
    index = result.worst_index()
    choices = [(f"index {i}" + (" (bonus row)" if i == result.length else ""), i) for i in range(result.length + 1)]
    return ((result, texts), verdict_html(result), describe_html(result), lab_figure(result, index, texts),
            fits_table_html(result), gr.Dropdown(choices=choices, value=index))


def blank(message: str) -> tuple:
    """The outputs when there is nothing to show, and why."""
    return (None, "", f"<p><em>{html.escape(message)}</em></p>", empty_figure(message), "",
            gr.Dropdown(choices=[], value=None))


def on_index(held: tuple[LabResult, dict[int, str]] | None, index: int | None):
    """Replot another output index of the result already held (no session needed)."""
    if held is None or index is None:
        return gr.skip()
    result, texts = held
    return lab_figure(result, int(index), texts)


def build() -> LabPage:
    """Lay the tab out in the current Blocks context; the lab uses the round selected in the playground."""
    gr.Markdown("Take the selected round's **real** p and q rows, run its verification N times with fresh random "
                "draws, and test whether the emitted tokens follow p_target (Pearson χ², one test per output "
                "index). Use temperature > 0 in the playground: greedy rows are one-hot and every rule looks fine. "
                "The same test audits a real server's sampling end to end: **Live engine** tab, *Audit its "
                "sampling* (or `python -m engine audit URL`).")
    with gr.Row():
        rule = gr.Radio(RULE_CHOICES, value=Rule.CORRECT.value, label="Verification rule", elem_id="lab-rule")
        with gr.Column():
            trials = RawNumber(DEFAULT_TRIALS, precision=0, minimum=1, maximum=MAX_TRIALS, label="N (rounds)")
            seed = RawNumber(0, precision=0, label="Seed")
    with gr.Row():
        auto = gr.Checkbox(True, label="Choose the drafts where wrong rules show most")
        start = RawNumber(1, precision=0, minimum=1, label="First draft (#)")
        length = RawNumber(1, precision=0, minimum=1, label="Drafts to verify")
    run = gr.Button("Run the lab", variant="primary", elem_id="lab-run")
    verdict = gr.HTML(elem_id="lab-verdict")
    describe = gr.HTML()
    index = gr.Dropdown([], label="Output index to plot", elem_id="lab-index")
    figure = gr.Plot(show_label=False, elem_id="lab-plot")
    table = gr.HTML(elem_id="lab-table")
    page = LabPage(rule, trials, seed, auto, start, length, run, index, verdict, describe, figure, table,
                   gr.State(None))
    index.input(on_index, [page.result, index], [figure], api_name=False)
    return page

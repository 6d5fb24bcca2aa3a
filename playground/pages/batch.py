"""The Batch tab: goodput against batch size, target-only and speculative, from a study the engine measured
(engine.bench.batch): a shipped one, or one measured here on this server's CPU or GPU.

A study here runs the same code as `python -m engine bench --batch`: B prompts decoded at once, one target
forward a round for all of them, each method at each batch size, the batched r_B(n) calibrated first. It holds
the model registry's compute gate for each run, so it is never timed beside a Step (nor a Step beside it), and
one study runs at a time on the server.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from engine.bench.batch import BatchStudy, StudyStopped, measure, read_study
from engine.bench.methods import BenchSettings, Method
from engine.bench.prompts import make_prompts
from engine.clock import machine_name
from engine.models import ModelLoadError
from engine.prompts import PromptError, has_chat_template
from engine.sources import ASSETS
from playground.controller import Context
from playground.render import batch as render
from playground.teach.batch import batch_lesson

STUDIES_DIR = ASSETS / "bench"
SIZES = (1, 2, 4, 8, 16)
DEFAULT_SIZES = (1, 2, 4, 8)
HERE = "measured here"


def shipped_studies(folder: Path = STUDIES_DIR, first: str = "") -> dict[str, Path]:
    """label -> file, for the studies kept under assets/bench (batch-*.json), those of target `first` first;
    unreadable ones are left out."""
    found = []
    for path in sorted(folder.glob("batch-*.json")):
        try:
            study = read_study(path)
        except ValueError:
            continue
        found.append((study.target != first, f"{study.target} on {study.machine} ({path.stem})", path))
    return {label: path for _, label, path in sorted(found, key=lambda f: f[0])}


@dataclass(frozen=True)
class BatchPage:
    study: gr.Dropdown
    goodput: gr.Plot
    lesson: gr.Markdown
    costs: gr.Plot
    summary: gr.Markdown
    pair: gr.Dropdown
    sizes: gr.CheckboxGroup
    new_tokens: gr.Number
    start: gr.Button
    stop: gr.Button
    state: gr.State
    handlers: "BatchHandlers"

    def outputs(self) -> list:
        return [self.goodput, self.lesson, self.costs, self.summary]


def render_study(study: BatchStudy | None) -> tuple:
    """(goodput figure, lesson, r_B(n) figure, summary) for a study."""
    lesson = "\n\n".join(batch_lesson(study)) if study is not None else \
        "Pick a measured study above, or measure one on this machine below."
    return render.study_figure(study), lesson, render.cost_figure(study), render.summary_markdown(study)


def study_methods(drafter: str | None) -> list[Method]:
    """What a study here runs: target-only, prompt lookup at K = 3, and the pair's draft model (or else its EAGLE head
    with prompt lookup) at K = 2 and 4."""
    methods = [Method("target"), Method("ngram", 3)]
    if drafter is not None:
        methods += [Method(drafter, 2), Method(drafter, 4)]
    return methods


class BatchHandlers:
    def __init__(self, ctx: Context, studies: dict[str, Path]) -> None:
        self.ctx, self.studies = ctx, studies
        self._stop: threading.Event | None = None
        self._lock = threading.Lock()

    def show(self, label: str, here: BatchStudy | None) -> tuple:
        if label == HERE:
            return render_study(here)
        path = self.studies.get(label)
        if path is None:
            return render_study(None)
        try:
            return render_study(read_study(path))
        except ValueError as exc:
            gr.Warning(str(exc))
            return render_study(None)

    def measure(self, key: str, sizes: list, new_tokens, here: BatchStudy | None,
                progress=gr.Progress()) -> tuple:
        """Measure a study on this machine; (state, study picker, the four outputs)."""
        if not self._lock.acquire(blocking=False):
            gr.Warning("A batch study is already running on this server; try again when it ends.")
            return (here, gr.skip(), *[gr.skip()] * 4)
        self._stop = threading.Event()
        try:
            study = self._measure(key, sizes, new_tokens, progress)
        except StudyStopped:
            gr.Info("The batch study was stopped; nothing was kept.")
            return (here, gr.skip(), *[gr.skip()] * 4)
        except (ModelLoadError, PromptError, ValueError) as exc:
            gr.Warning(str(exc))
            return (here, gr.skip(), *[gr.skip()] * 4)
        finally:
            self._stop = None
            self._lock.release()
        return (study, gr.Dropdown(choices=[*self.studies, HERE], value=HERE), *render_study(study))

    def _measure(self, key: str, sizes: list, new_tokens, progress) -> BatchStudy:
        batches = sorted({int(s) for s in sizes or []})
        if not batches:
            raise ValueError("Choose at least one batch size.")
        if len(batches) < 2:
            raise ValueError("Choose two batch sizes or more: the study compares them.")
        tokens = int(new_tokens or 0)
        if not 8 <= tokens <= 64:
            raise ValueError("New tokens must be from 8 to 64 here (the command line takes more).")
        preset = self.ctx.registry.resolve(key)
        progress(0.0, desc=f"loading {preset.label}")
        pair = self.ctx.registry.pair(key)
        drafter = "v2" if pair.draft is not None else ("eagle-hybrid" if pair.eagle is not None else None)
        chat = has_chat_template(pair.target.tokenizer) and preset.chat
        settings = BenchSettings(prompt_set="chat-heldout" if chat else "heldout", num_prompts=max(batches),
                                 prompt_tokens=96, new_tokens=tokens, methods=("ngram:3",))
        prompts = make_prompts(settings, pair.target)

        def report(done: int, total: int, what: str) -> None:
            progress((done, total), desc=what, unit="steps")

        return measure(pair, study_methods(drafter), prompts, batches, tokens, repeats=1, warmup=1,
                       calibration_repeats=2, progress=report, machine=self.ctx.registry.gate.run(machine_name),
                       prompt_set=settings.prompt_set, gate=self.ctx.registry.gate, stop=self._stop)

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            gr.Info("Stopping the batch study after the run in progress.")


def build(ctx: Context) -> BatchPage:
    """Lay the tab out in the current Blocks context and wire it."""
    presets = ctx.registry.presets
    studies = shipped_studies(first=presets[0].target if presets else "")
    first = next(iter(studies), None)
    gr.Markdown("### Goodput against batch size\nA server decodes many sequences at once, and a batch spends the "
                "same spare compute speculation does. Here the engine decodes B prompts together, one target "
                "forward a round over all their rows, target-only and with speculation, and shows where "
                "speculation stops paying. Measured points are solid; Leviathan's prediction is dotted, fed the "
                "measured α, the batched r_B(n), the draft time and the rest of a round (verify, commit, record).")
    study = gr.Dropdown([*studies], value=first, label="study", elem_id="batch-study")
    goodput = gr.Plot(show_label=False, elem_id="batch-goodput")
    lesson = gr.Markdown(elem_id="batch-lesson")
    with gr.Row():
        costs = gr.Plot(show_label=False, elem_id="batch-costs")
        summary = gr.Markdown(elem_id="batch-summary")
    with gr.Accordion("Measure on this machine", open=False):
        gr.Markdown("Runs target-only, prompt lookup (K = 3) and the pair's drafter (K = 2 and 4) at each batch size, "
                    "once each after a warm-up: about a minute on the built-in pair, several on SmolLM2 (2 CPU "
                    "cores). Steps on this server wait while it measures.")
        with gr.Row():
            pair = gr.Dropdown(ctx.registry.choices(), value=ctx.registry.choices()[0][1], label="model pair",
                               elem_id="batch-pair")
            sizes = gr.CheckboxGroup([str(s) for s in SIZES], value=[str(s) for s in DEFAULT_SIZES],
                                     label="batch sizes", elem_id="batch-sizes")
            new_tokens = gr.Number(24, label="new tokens per sequence", minimum=8, maximum=64, precision=0,
                                   elem_id="batch-new-tokens")
        with gr.Row():
            start = gr.Button("Measure", variant="primary", elem_id="batch-measure")
            stop = gr.Button("Stop", elem_id="batch-stop")
    state = gr.State(None)
    page = BatchPage(study, goodput, lesson, costs, summary, pair, sizes, new_tokens, start, stop, state,
                     BatchHandlers(ctx, studies))
    _wire(page)
    return page


def _wire(page: BatchPage) -> None:
    h = page.handlers
    page.study.change(h.show, [page.study, page.state], page.outputs(), api_name=False)
    page.start.click(h.measure, [page.pair, page.sizes, page.new_tokens, page.state],
                     [page.state, page.study, *page.outputs()], api_name=False, concurrency_id="batch-study",
                     concurrency_limit=1)
    page.stop.click(h.stop, None, None, api_name=False, queue=False)

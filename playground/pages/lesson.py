"""The Lesson tab: a guided walk through one speculative round on a real pair (SmolLM2 and its EAGLE
head by default, the built-in pair as a choice).

playground.teach.lesson's driver decides what each step says, shows and asks (from the real records);
this page renders it with the playground's own renderers (chips, p/q bars, residual, KV grid,
theory curves) in one shared view under a gr.Walkthrough, and wires Back/Next/Check/Reveal.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import gradio as gr
import plotly.graph_objects as go

from engine import metrics
from engine.clock import T, in_turn
from engine.models import ModelLoadError
from engine.pair import ModelPair, load_pair
from engine.records import RoundRecord
from engine.sources import BUILTIN, SMOLLM2
from playground.registry import ModelRegistry
from playground.render.bars import bars_figure
from playground.render.charts import empty_figure
from playground.render.kv_plots import kv_figure
from playground.render.palette import BASELINE_COLOUR, SPEC_COLOUR, styled_figure
from playground.render.round_plots import draft_chart, final_chart
from playground.render.theory import theory_figure
from playground.render.tokens import legend_html, stream_html
from playground.teach.lesson import (
    LessonDriver,
    LessonError,
    LessonStep,
    LessonText,
    StepId,
    View,
    cost_claim,
    load_lesson_text,
)
from playground.view import Cursor, RunView, info_for_run, view_from_run

# Steps whose question is about the round's mechanics, not its verdicts: their chips stay pending.
PENDING_STEPS = frozenset((StepId.DRAFT, StepId.VERIFY))


# -- pure renderers -------------------------------------------------------------------------------------
def driver_view(driver: LessonDriver) -> RunView:
    """The lesson run's rounds so far, as every playground renderer takes them."""
    return view_from_run(driver.run, info_for_run(driver.run, driver.target, driver.pair.draft))


def shows_verdict(step: LessonStep) -> bool:
    return step.revealed and step.id not in PENDING_STEPS


def step_stream(step: LessonStep, view: RunView) -> str:
    """The token chips up to the step's round, that round pending until its verdict may be shown."""
    cursor = Cursor(shown=step.round + 1, revealed=shows_verdict(step), round=step.round, position=step.position)
    return stream_html(view, cursor)


def cost_figure(view: RunView, upto_round: int) -> go.Figure:
    """Measured forward times, the forwards alone (the engine's RoundTimings.target_forward_ms and
    draft_forward_ms): one target-only decode step, one verify forward over K+1 tokens and one draft
    forward, medians over the rounds so far. The title states the measured ratio and what it means."""
    step = metrics.target_step_ms(view.baseline)
    rounds = [r for r in view.rounds[: upto_round + 1] if r.k]
    if step is None or not rounds:
        return empty_figure("Not measured yet.")
    k = rounds[-1].k
    verify = statistics.median(r.timings.target_forward_ms for r in rounds)
    draft = metrics.draft_forward_ms(rounds)
    bars = [("target: 1 token (target-only step)", step, BASELINE_COLOUR),
            (f"target: verify {k + 1} tokens (one forward)", verify, SPEC_COLOUR)]
    bars += [("draft: 1 token (one forward)", draft, "#E69F00")] if draft is not None else []
    fig = styled_figure([go.Bar(x=[b[0] for b in bars], y=[b[1] for b in bars], marker_color=[b[2] for b in bars],
                            text=[f"{b[1]:.2f} ms" for b in bars], textposition="outside")])
    claim = cost_claim(k + 1, verify / step)
    wrapped = (claim[0].lower() + claim[1:]).replace(": ", ":<br>", 1)   # plotly does not wrap a title
    fig.update_layout(title=dict(text=f"Measured here (medians): {wrapped}", font=dict(size=13)),
                      height=360, yaxis=dict(title="milliseconds", rangemode="tozero"),
                      margin=dict(l=50, r=20, t=70, b=40))
    return fig


def hidden_verdict_figure(record: RoundRecord, position: int) -> go.Figure:
    """The p/q bars at a drafted position with u and the verdict left out (asked before revealed)."""
    p = record.positions[position]
    chart = replace(draft_chart(record, position, revealed=True),
                    title=(f"round {record.index + 1}, draft #{position + 1}",
                           f"p={p.p_target:.3f}, q={p.q_draft:.3f}, α=min(1, p/q)={p.alpha:.3f} — u not shown yet"))
    return bars_figure(chart)


def _kv_of(record: RoundRecord, title: str) -> go.Figure:
    fig = kv_figure(next(s for s in record.kv if s.model == "target"))
    fig.update_layout(title=dict(text=title))
    return fig


def step_figure(step: LessonStep, view: RunView, v1: RoundRecord | None) -> go.Figure | None:
    """The figure of the step's view (None: the chips are the view)."""
    record = view.rounds[step.round]
    if step.view is View.COST:
        return cost_figure(view, step.round)
    if step.view is View.CHIPS:
        return None
    if step.view is View.PQ_BARS:
        return (bars_figure(draft_chart(record, step.position)) if shows_verdict(step)
                else hidden_verdict_figure(record, step.position))
    if step.view is View.RESIDUAL:
        return bars_figure(final_chart(record))
    if step.view is View.BONUS:
        return bars_figure(final_chart(record)) if step.revealed else empty_figure(
            "Answer (or press “Just show me”) to see the row.")
    if step.view is View.KV:
        return _kv_before_after(step, view)
    if step.view is View.KV_V1:
        if step.revealed and v1 is not None:
            return _kv_of(v1, f"v1: target cache after round {step.round + 1} (verified read-only, then committed)")
        return _kv_of(record, f"v2: target cache after round {step.round + 1}")
    return theory_figure(view)


def _kv_before_after(step: LessonStep, view: RunView) -> go.Figure:
    if step.revealed:
        return _kv_of(view.rounds[step.round], f"v2: target cache after round {step.round + 1}: W kept, ✗ rolled back")
    if step.round == 0:
        return empty_figure("Answer (or press “Just show me”) to see what round 1 wrote.")
    return _kv_of(view.rounds[step.round - 1], f"v2: target cache before round {step.round + 1} (after round {step.round})")


def feedback_markdown(step: LessonStep, ui) -> str:
    """What shows under the question: nothing while it is open, then right/wrong and the reveal."""
    q = step.question
    if q is None or not step.revealed:
        return ""
    if step.answered is None:
        return q.reveal
    head = ui["correct"] if step.answered == q.answer else ui["wrong"].format(answer=q.label(q.answer))
    return f"{head} {q.reveal}"


def status_markdown(driver: LessonDriver, step: LessonStep) -> str:
    ui, s = driver.text.ui, driver.plan.settings
    first_line = s.prompt_text.strip().splitlines()[0]
    return (f"**{ui['step_counter'].format(n=step.index + 1, total=step.total)}** · "
            + ui["run_label"].format(seed=driver.plan.seed, k=s.k, temperature=f"{s.temperature:g}", prompt=first_line))


@dataclass(frozen=True, slots=True)
class StepRender:
    """Everything one step puts on screen."""

    status: str
    body: str
    question: str                          # the question's prompt ("" without one), also ending the body
    choices: tuple[tuple[str, str], ...]   # (label, value)
    answered: str | None
    asks: bool                             # the question is open: show Check / Just show me
    feedback: str
    stream: str
    figure: go.Figure | None               # None: the chips are the view


def render_step(driver: LessonDriver, step: LessonStep) -> StepRender:
    """Everything the step shows. Advances the driver's engine runs if the step needs more rounds."""
    view = driver_view(driver)
    v1 = driver.v1_record(step.round) if step.view is View.KV_V1 else None
    q = step.question
    body = f"### {step.title}\n\n{step.body}" + (f"\n\n**{q.prompt}**" if q else "")
    return StepRender(status_markdown(driver, step), body, q.prompt if q else "",
                      q.choices if q else (), step.answered, q is not None and not step.revealed,
                      feedback_markdown(step, driver.text.ui), step_stream(step, view), step_figure(step, view, v1))


# -- the tab ------------------------------------------------------------------------------------------
def lesson_choices(registry: ModelRegistry | None) -> list[tuple[str, str]]:
    """(label, key) of the pairs the lesson runs on: the registry's offline pairs that have a drafter
    that samples (a draft model or an EAGLE head), the server's default first; without a registry, the
    built-in pair alone."""
    if registry is None:
        return [("Built-in pair", BUILTIN)]
    return [(p.label, p.key) for p in registry.presets if p.target in (SMOLLM2, BUILTIN) and (p.draft or p.eagle)]


def lesson_pair(registry: ModelRegistry | None, key: str | None = None) -> ModelPair:
    """The pair under `key` (None: the first of lesson_choices): the registry's shared copy, else a fresh
    load of the built-in pair (small: tens of MiB)."""
    if registry is None:
        return load_pair(BUILTIN, BUILTIN)
    keys = [k for _, k in lesson_choices(registry)]
    if not keys or (key is not None and key not in keys):
        raise ModelLoadError(f"The lesson runs on {', '.join(keys) or 'no pair of this server'}, not {key!r}.")
    return registry.pair(key or keys[0])


@dataclass(frozen=True)
class StepBlock:
    step: gr.Step
    body: gr.Markdown
    question: gr.Radio
    check: gr.Button
    reveal: gr.Button
    feedback: gr.Markdown
    back: gr.Button
    next: gr.Button


@dataclass(frozen=True)
class LessonPage:
    pair: gr.Dropdown
    start: gr.Button
    status: gr.Markdown
    walkthrough: gr.Walkthrough
    steps: tuple[StepBlock, ...]
    stream: gr.HTML
    figure: gr.Plot
    driver: gr.State


def _step_block(index: int, title: str, text: LessonText, total: int) -> StepBlock:
    ui = text.ui
    with gr.Step(title, id=index, elem_id=f"lesson-step-{index}") as step:
        body = gr.Markdown(f"### {title}\n\n{ui['not_started']}")
        question = gr.Radio([], label=ui["your_answer"], visible=False, elem_id=f"lesson-q-{index}")
        with gr.Row():
            check = gr.Button(ui["check"], size="sm", visible=False, elem_id=f"lesson-check-{index}")
            reveal = gr.Button(ui["reveal"], size="sm", visible=False, elem_id=f"lesson-reveal-{index}")
        feedback = gr.Markdown(elem_id=f"lesson-feedback-{index}")
        with gr.Row():
            back = gr.Button(ui["back"], size="sm", interactive=index > 0, elem_id=f"lesson-back-{index}")
            nxt = gr.Button(ui["next"], size="sm", variant="primary", interactive=index < total - 1,
                            elem_id=f"lesson-next-{index}")
    return StepBlock(step, body, question, check, reveal, feedback, back, nxt)


class LessonHandlers:
    """Event functions; the learner's driver lives only in the page's gr.State."""

    def __init__(self, page: LessonPage, text: LessonText, registry: ModelRegistry | None) -> None:
        self.page, self.text, self.registry = page, text, registry

    def outputs(self, index: int) -> list:
        b = self.page.steps[index]
        return [self.page.status, self.page.walkthrough, self.page.stream, self.page.figure,
                b.body, b.question, b.check, b.reveal, b.feedback]

    def _values(self, driver: LessonDriver, step: LessonStep) -> tuple:
        r = render_step(driver, step)
        radio = gr.Radio(choices=list(r.choices), value=r.answered, label=self.text.ui["your_answer"],
                         visible=bool(r.choices), interactive=r.asks)
        figure = gr.Plot(value=r.figure, visible=r.figure is not None)
        return (r.status, gr.Walkthrough(selected=step.index), r.stream, figure, r.body, radio,
                gr.Button(visible=r.asks), gr.Button(visible=r.asks), r.feedback)

    def start(self, driver: LessonDriver | None, key: str | None = None) -> tuple:
        try:
            pair = lesson_pair(self.registry, key)
            def begin() -> tuple[LessonDriver, LessonStep]:
                new = LessonDriver.start(pair, self.text)
                try:
                    return new, new.go(0)
                except BaseException:
                    new.close()
                    raise
            new, first = self._in_turn(begin)
        except (LessonError, ModelLoadError, ValueError) as exc:
            gr.Warning(str(exc))
            return (driver, *(gr.skip(),) * 9)
        if driver is not None:
            driver.close()
        return (new, *self._values(new, first))

    def _in_turn(self, work: Callable[[], T]) -> T:
        """`work()` in the cores' turn, on their compute thread (ModelRegistry.gate) for the lesson's timed runs,
        so that no calibration runs beside them; right here without a registry."""
        return in_turn(self.registry.gate if self.registry is not None else None, work)

    def go(self, index: int, driver: LessonDriver | None) -> tuple:
        if driver is None:  # the step headers work before Start; their text says to press it
            return (gr.skip(), gr.Walkthrough(selected=index), *(gr.skip(),) * 7)
        return self._show(driver, lambda: driver.go(index))

    def check(self, index: int, driver: LessonDriver | None, choice: str | None) -> tuple:
        def answer() -> LessonStep:
            driver.go(index)
            driver.answer(choice)
            return driver.current()
        return self._show(driver, answer)

    def reveal(self, index: int, driver: LessonDriver | None) -> tuple:
        def show() -> LessonStep:
            driver.go(index)
            return driver.reveal()
        return self._show(driver, show)

    def _show(self, driver: LessonDriver | None, action: Callable[[], LessonStep]) -> tuple:
        """Run a driver action and render its step; a lesson error becomes a warning, nothing changes."""
        if driver is None:
            return (gr.skip(),) * 9
        try:
            shown = self._in_turn(action)
            return self._values(driver, shown)
        except LessonError as exc:
            gr.Warning(str(exc))
            return (gr.skip(),) * 9


def _wire(page: LessonPage, handlers: LessonHandlers) -> None:
    busy = dict(api_name=False, concurrency_id="lesson", concurrency_limit=1)
    state = page.driver
    first = handlers.outputs(0)
    page.start.click(handlers.start, [state, page.pair], [state, *first], **busy)
    for i, block in enumerate(page.steps):
        out = handlers.outputs(i)
        block.step.select(partial(handlers.go, i), [state], out, **busy)
        if i > 0:
            page.steps[i - 1].next.click(partial(handlers.go, i), [state], out, **busy)
        if i + 1 < len(page.steps):
            page.steps[i + 1].back.click(partial(handlers.go, i), [state], out, **busy)
        block.check.click(partial(handlers.check, i), [state, block.question], out, **busy)
        block.reveal.click(partial(handlers.reveal, i), [state], out, **busy)


def build_lesson(registry: ModelRegistry | None = None, lang: str = "en") -> LessonPage:
    """Lay the Lesson tab out in the current Blocks context and wire its events.

    registry: the app's ModelRegistry, so the lesson shares its loaded pairs and offers them (None: load
    the built-in pair when a lesson starts). lang: which assets/lessons/<lang>.json to show.
    """
    text = load_lesson_text(lang)
    gr.Markdown(f"## {text.title}\n\n{text.intro}")
    choices = lesson_choices(registry)
    with gr.Row():
        pair = gr.Dropdown(choices, value=choices[0][1] if choices else None, label=text.ui["pair"],
                           elem_id="lesson-pair", scale=2)
        start = gr.Button(text.ui["start"], variant="primary", elem_id="lesson-start")
        status = gr.Markdown(text.ui["not_started"], elem_id="lesson-status")
    with gr.Walkthrough(selected=0, elem_id="lesson-walkthrough") as walkthrough:
        steps = tuple(_step_block(i, s.title, text, len(text.steps)) for i, s in enumerate(text.steps))
    stream = gr.HTML(elem_id="lesson-stream", min_height=40)
    figure = gr.Plot(empty_figure(text.ui["figure_idle"]), show_label=False, elem_id="lesson-plot")
    gr.HTML(legend_html())
    driver = gr.State(None, delete_callback=lambda d: d.close() if d is not None else None)
    page = LessonPage(pair, start, status, walkthrough, steps, stream, figure, driver)
    _wire(page, LessonHandlers(page, text, registry))
    return page

"""The Losslessness lab: re-verify a real round N times with fresh draws, under the correct rule or a
deliberately wrong one, and test the emitted tokens against p_target.

The round's full-vocabulary rows come from playground.teach.lesson.round_rows (its forwards re-run on fresh
caches); the Monte-Carlo and the chi-square test are playground.teach.losslessness's. Pure pieces
(`run_lab`, `lab_figure`, `fits_table_html`, `verdict_html`) need no Gradio.
"""
from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import gradio as gr
import plotly.graph_objects as go
import torch
from torch import Tensor

from playground.render.charts import empty_figure
from playground.render.palette import BLUE, ORANGE, VERMILLION
from playground.render.tokens import visible
from playground.teach.lesson import RoundRows, RuleOutput, best_window, round_rows, rule_output, window
from playground.teach.losslessness import MIN_SAMPLES, FitResult, Rule, goodness_of_fit, simulate

ALPHA_LEVEL = 1e-3     # each index's test rejects "counts ~ p_target" below this p-value
DEFAULT_TRIALS = 10_000
MAX_TRIALS = 1_000_000
TOP_TOKENS = 8         # per source: the most likely tokens under p_target, the rule and the sample


@dataclass(frozen=True, slots=True)
class LabResult:
    """N re-verifications of drafts start..start+length-1 of one round under one rule."""

    round: int
    rule: Rule
    trials: int
    seed: int
    start: int
    length: int
    counts: Tensor           # [length+1, V] long: emitted token counts per output index
    p_target: Tensor         # [length+1, V]: the distribution each index must follow
    limit: RuleOutput        # what this rule converges to (exactly), per index
    fits: tuple[FitResult, ...]

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.fits)

    def worst_index(self) -> int:
        """The tested index with the smallest p-value (the one to plot)."""
        return min(self.fits, key=lambda f: (f.p_value, f.index)).index if self.fits else 0


def run_lab(rows: RoundRows, rule: Rule | str, trials: int, seed: int,
            start: int | None = None, length: int | None = None) -> LabResult:
    """Simulate `trials` rounds on the fixed rows (playground.teach.losslessness.simulate) and test every
    output index with at least MIN_SAMPLES tokens against p_target. start/length None: the window
    where the wrong rules show most (playground.teach.lesson.best_window)."""
    if not 1 <= trials <= MAX_TRIALS:
        raise ValueError(f"N must be between 1 and {MAX_TRIALS:,}, got {trials}")
    if start is None or length is None:
        start, length = best_window(rows)
    q, p = window(rows, start, length)
    rule = Rule(rule)
    counts = simulate(q, p, rule, trials, torch.Generator().manual_seed(seed))
    fits = tuple(goodness_of_fit(counts[i], p[i], alpha_level=ALPHA_LEVEL, index=i)
                 for i in range(counts.shape[0]) if int(counts[i].sum()) >= MIN_SAMPLES)
    return LabResult(rows.round, rule, trials, seed, start, length, counts, p.double(), rule_output(q, p, rule), fits)


def _top_tokens(result: LabResult, index: int) -> list[int]:
    p, limit = result.p_target[index], result.limit.dist[index]
    n = result.counts[index].double()
    empirical = n / n.sum().clamp(min=1)
    ids: list[int] = []
    for row in (p, limit, empirical):
        ids += [t for t in torch.topk(row, min(TOP_TOKENS, row.numel())).indices.tolist() if t not in ids]
    return sorted(ids, key=lambda t: -float(p[t]))


def lab_figure(result: LabResult, index: int, texts: Mapping[int, str]) -> go.Figure:
    """Empirical frequencies of the emitted token at one output index beside p_target and the
    rule's exact limit, over the most likely tokens. texts: token id -> text for the axis."""
    n = int(result.counts[index].sum())
    if n == 0:
        return empty_figure(f"Output index {index} never emitted a token in {result.trials:,} rounds.")
    ids = _top_tokens(result, index)
    labels = [f"{visible(texts.get(t, str(t)))} #{t}" for t in ids]
    freq = result.counts[index].double() / n
    fig = go.Figure([
        go.Bar(name=f"empirical ({n:,} tokens)", x=labels, y=[float(freq[t]) for t in ids], marker_color=BLUE),
        go.Scatter(name="p_target (what the target would sample)", x=labels,
                   y=[float(result.p_target[index][t]) for t in ids], mode="markers",
                   marker=dict(symbol="line-ew-open", size=28, color="#000", line=dict(width=3, color="#000"))),
        go.Scatter(name=f"limit under “{result.rule.value}”", x=labels,
                   y=[float(result.limit.dist[index][t]) for t in ids], mode="markers",
                   marker=dict(symbol="x", size=9, color=VERMILLION if result.rule is not Rule.CORRECT else ORANGE)),
    ])
    fit = next((f for f in result.fits if f.index == index), None)
    verdict = "not tested (too few tokens)" if fit is None else (
        f"χ² = {fit.statistic:.1f}, dof = {fit.dof}, p-value = {fit.p_value:.3g} → "
        + ("consistent with p_target" if fit.passed else "REJECTED: not distributed as p_target"))
    row = result.start + index
    fig.update_layout(title=dict(text=f"output index {index}: p row {row} of round {result.round + 1}"
                                      f"{' (the bonus row)' if index == result.length else ''}<br>{verdict}",
                                 font=dict(size=14)),
                      xaxis=dict(type="category"),
                      height=380, template="plotly_white", margin=dict(l=50, r=20, t=70, b=90),
                      yaxis=dict(title="probability", rangemode="tozero"), legend=dict(orientation="h", y=-0.35))
    return fig


def fits_table_html(result: LabResult) -> str:
    """One row per output index: tokens emitted, chi-square, dof, p-value, verdict."""
    rows = []
    for i in range(result.counts.shape[0]):
        n = int(result.counts[i].sum())
        fit = next((f for f in result.fits if f.index == i), None)
        cells = [str(i), f"{n:,}"] + (["—", "—", "—", f"not tested (< {MIN_SAMPLES} tokens)"] if fit is None else [
            f"{fit.statistic:.1f}", str(fit.dof), f"{fit.p_value:.3g}", "✓ pass" if fit.passed else "✗ FAIL"])
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("output index", "tokens", "χ²", "dof", "p-value",
                                              f"at level {ALPHA_LEVEL:g}"))
    return f'<table class="kv-table"><tr>{head}</tr>{"".join(rows)}</table>'


def verdict_html(result: LabResult) -> str:
    if not result.fits:
        return '<span class="badge na">no output index had enough tokens to test: raise N</span>'
    if result.passed:
        return (f'<span class="badge ok">✓ “{html.escape(result.rule.value)}”: every tested index is consistent with '
                f'p_target ({result.trials:,} rounds)</span>')
    failed = ", ".join(str(f.index) for f in result.fits if not f.passed)
    return (f'<span class="badge bad">✗ “{html.escape(result.rule.value)}”: index {failed} is not distributed as '
            f'p_target ({result.trials:,} rounds) — this rule is not lossless</span>')


def describe_html(result: LabResult) -> str:
    last = result.start + result.length
    given = "" if result.start == 0 else f", from the moment its first {result.start} draft(s) were accepted"
    return (f"<p>Round {result.round + 1}: verifying drafts #{result.start + 1}–#{last} with q rows "
            f"{result.start}–{last - 1} and p rows {result.start}–{last} (row {last} is their bonus row). The rows "
            "are held fixed and the drafts are re-drawn from q every time, as if the round were run "
            f"{result.trials:,} times{given}.</p>")


# -- the tab --------------------------------------------------------------------------------------------
RULE_CHOICES = [("correct: accept min(1, p/q), correct from max(0, p − q), bonus from row K", Rule.CORRECT.value),
                ("wrong: discard on reject (emit nothing after a rejection)", Rule.DISCARD_ON_REJECT.value),
                ("wrong: bonus from row K − 1", Rule.BONUS_FROM_ROW_K_MINUS_1.value),
                ("wrong: correction from p instead of the residual", Rule.CORRECTION_FROM_P.value)]


@dataclass(frozen=True)
class LabPage:
    rule: gr.Radio
    trials: gr.Number
    seed: gr.Number
    auto_window: gr.Checkbox
    start: gr.Number
    length: gr.Number
    run: gr.Button
    index: gr.Dropdown
    verdict: gr.HTML
    describe: gr.HTML
    figure: gr.Plot
    table: gr.HTML
    result: gr.State

    def outputs(self) -> list:
        return [self.result, self.verdict, self.describe, self.figure, self.table, self.index]


def session_rows(session) -> RoundRows | str:
    """The rows of the round selected in a playground Session, or a message saying why there are
    none. Holds the session's lock while it reads the run."""
    if session is None:
        return "No run yet: step the playground at least once (the lab uses the round selected there)."
    with session.lock:
        view = session.view()
        selection = session.cursor.selection(view) if view is not None else None
        if selection is None:
            return "No round shown yet: step the playground at least once (the lab uses the round selected there)."
        if not session.live:
            return "The lab re-runs the round's forwards, so it needs a live run, not a replayed trace."
        spec = session.run.spec
        return round_rows(spec.target, spec.draft, spec.prompt, spec.rounds, selection[0], spec.config)


def token_texts(result: LabResult, decode: Callable[[int], str]) -> dict[int, str]:
    """Texts of every token any index's plot shows (so replotting needs no tokenizer)."""
    ids = {t for i in range(result.counts.shape[0]) for t in _top_tokens(result, i)}
    return {t: decode(t) for t in sorted(ids)}


def _int(name: str, value: float | None) -> int:
    if value is None or float(value) != int(float(value)):
        raise ValueError(f"{name} must be a whole number, got {value}")
    return int(float(value))


def on_run(session, rule: str, trials: float, seed: float, auto: bool, start: float, length: float) -> tuple:
    try:
        rows = session_rows(session)
        if isinstance(rows, str):
            gr.Warning(rows)
            return (None,) + _blank(rows)
        window_ = (None, None) if auto else (_int("First draft", start) - 1, _int("Drafts", length))
        result = run_lab(rows, rule, _int("N", trials), _int("Seed", seed), *window_)
    except ValueError as exc:
        gr.Warning(str(exc))
        return (gr.skip(),) * 6
    texts = token_texts(result, lambda t: session.run.spec.target.tokenizer.decode([t]))
    index = result.worst_index()
    choices = [(f"index {i}" + (" (bonus row)" if i == result.length else ""), i) for i in range(result.length + 1)]
    return ((result, texts), verdict_html(result), describe_html(result), lab_figure(result, index, texts),
            fits_table_html(result), gr.Dropdown(choices=choices, value=index))


def _blank(message: str) -> tuple:
    return ("", f"<p><em>{html.escape(message)}</em></p>", empty_figure(message), "", gr.Dropdown(choices=[], value=None))


def on_index(held, index: int | None) -> go.Figure:
    if held is None or index is None:
        return gr.skip()
    result, texts = held
    return lab_figure(result, int(index), texts)


def build_lab(state: gr.State) -> LabPage:
    """Lay the tab out in the current Blocks context. `state` is the playground's per-visitor
    gr.State holding its Session; the lab uses the round selected there."""
    gr.Markdown("Take the selected round's **real** p and q rows, run its verification N times with fresh random "
                "draws, and test whether the emitted tokens follow p_target (Pearson χ², one test per output "
                "index). Use temperature > 0 in the playground: greedy rows are one-hot and every rule looks fine.")
    with gr.Row():
        rule = gr.Radio(RULE_CHOICES, value=Rule.CORRECT.value, label="Verification rule", elem_id="lab-rule")
        with gr.Column():
            trials = gr.Number(DEFAULT_TRIALS, precision=0, minimum=1, maximum=MAX_TRIALS, label="N (rounds)")
            seed = gr.Number(0, precision=0, label="Seed")
    with gr.Row():
        auto = gr.Checkbox(True, label="Choose the drafts where wrong rules show most")
        start = gr.Number(1, precision=0, minimum=1, label="First draft (#)")
        length = gr.Number(1, precision=0, minimum=1, label="Drafts to verify")
    run = gr.Button("Run the lab", variant="primary", elem_id="lab-run")
    verdict = gr.HTML(elem_id="lab-verdict")
    describe = gr.HTML()
    index = gr.Dropdown([], label="Output index to plot", elem_id="lab-index")
    figure = gr.Plot(show_label=False, elem_id="lab-plot")
    table = gr.HTML(elem_id="lab-table")
    page = LabPage(rule, trials, seed, auto, start, length, run, index, verdict, describe, figure, table,
                   gr.State(None))
    run.click(on_run, [state, rule, trials, seed, auto, start, length], page.outputs(), api_name=False,
              concurrency_id="lab", concurrency_limit=1)
    index.input(on_index, [page.result, index], [figure], api_name=False)
    return page

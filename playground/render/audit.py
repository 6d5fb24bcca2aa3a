"""The audit's verdict on the Live engine page: a paragraph (the verdict, p per depth, N, power, time) and the
observed against the expected counts of the outcomes, from an `engine.audit.run.AuditReport`."""
from __future__ import annotations

import html
import math

import plotly.graph_objects as go

from engine.audit.run import AuditReport, format_p
from engine.audit.verdict import TAIL
from playground.render.charts import chart_figure, empty_figure
from playground.render.palette import BASELINE_COLOUR, SPEC_COLOUR, VERMILLION
from playground.render.tokens import visible

BARS = 14    # outcomes drawn: the likeliest, then any the model never samples


def verdict_markdown(report: AuditReport | None) -> str:
    if report is None:
        return ("No audit yet. An audit asks the server for many short completions at a temperature above 0 and "
                "tests their distribution against the model's own (or against the same model served without "
                "speculation): a lossless speculative sampler cannot be told apart from plain sampling.")
    a, p = report.analysis, report.plan
    against = f"the reference server {report.reference}" if report.reference else \
        f"the exact distribution computed here from `{report.exact_model}`"
    verdict = ("**Consistent with lossless sampling**" if a.passed else
               "**Not lossless**: the tokens are not distributed as the model samples them")
    lines = [f"{verdict} (p = {format_p(a.p_value)}, {len(a.tests)} tests adjusted, level {p.level:g}).",
             "",
             f"{a.n} completions of the first {p.m} tokens from `{report.url}` ({html.escape(report.model)})"
             + (f" and {a.reference_n} from the reference" if a.reference_n else "")
             + f", against {against}; T = {p.params.temperature:g}, top-k {p.params.top_k or 'off'}, "
               f"top-p {p.params.top_p:g}; {report.requests} requests in {report.seconds:.1f} s.",
             "",
             "| tokens tested | chi-square | degrees of freedom | p |", "|---|---|---|---|"]
    lines += [f"| 1..{t.depth} | {t.fit.statistic:.1f} | {t.fit.dof} | {format_p(t.fit.p_value)} |" for t in a.tests]
    if a.outside:
        lines += ["", f"**{a.outside} completions the model never produces with these settings** (probability 0)."]
    if a.power is not None:
        moved = f" (about {a.power.moved_pp:.1f} points of probability moved between the two likeliest outcomes)" \
            if math.isfinite(a.power.moved_pp) else ""
        lines += ["", f"Power: {a.n} completions detect a deviation of Cohen's w ≥ {a.power.w:.3f}{moved} 90% of "
                      "the time; a smaller one could pass unseen."]
    if report.cut_short:
        lines += ["", f"Collection ended early: {report.cut_short}."]
    if report.fragile:
        lines += ["", f"Caution: a top-k or top-p edge lies within {report.margin:.1e} of a token's probability; a "
                      "server computing in another precision may keep another set there."]
    return "\n".join(lines)


def counts_figure(report: AuditReport | None) -> go.Figure:
    if report is None:
        return empty_figure("Observed against expected counts appear here after an audit.")
    a = report.analysis
    likely = [c for c in a.cells if c.expected > 0][:BARS]
    never = [c for c in a.cells if c.expected <= 0 and c.observed][:max(3, BARS - len(likely))]
    cells = likely + never
    labels = [_short(c.label) for c in cells]
    expected_name = "the reference (scaled)" if report.reference else "expected (exact)"
    traces = [go.Bar(x=labels, y=[c.expected for c in cells], name=expected_name, marker_color=BASELINE_COLOUR,
                     hovertemplate="%{x}: %{y:.1f} expected<extra></extra>"),
              go.Bar(x=labels, y=[c.observed for c in cells], name="observed (the server)",
                     marker_color=[SPEC_COLOUR if c.expected > 0 else VERMILLION for c in cells],
                     hovertemplate="%{x}: %{y} observed<extra></extra>")]
    title = f"{'passes' if a.passed else 'fails'}: p = {format_p(a.p_value)}, N = {a.n}"
    figure = chart_figure(traces, title, "the first tokens (· space, ↵ newline; red: never sampled by the model)",
                          "completions", barmode="group")
    return figure.update_xaxes(tickangle=-30, automargin=True, tickfont=dict(family="monospace"))


def _short(label: str, width: int = 14) -> str:
    """A bar's label: the tail as "(the rest)", else the text with its whitespace made visible, cut to width."""
    text = "(the rest)" if label == TAIL else visible(label)
    return text if len(text) <= width else text[: width - 1] + "…"

"""The Theory tab's pictures: E(alpha, K) and the predicted speed-up over K for the run's measured alpha,
c and r(n), the measured points on top, the recommended K, and the measured r(n) curve itself.

Pure functions of a RunView; every number comes from engine.metrics and the run's calibration.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine import metrics
from engine.bench.formats import PEER_FORMATS, FormatCurves, curve_of, draft_share, vendor
from engine.calibration import RCurve
from engine.config import K_BOUND
from engine.metrics import NotMeasured, Prediction
from playground.render.charts import empty_figure, r_text, verdict
from playground.render.palette import BASELINE_COLOUR, GREY, PREDICTED_COLOUR, SPEC_COLOUR, styled_figure
from playground.view import RunView


@dataclass(frozen=True, slots=True)
class MeasuredPoint:
    """Rounds that drafted k tokens: how many tokens they emitted on average."""

    k: int
    rounds: int
    tokens_per_round: float


@dataclass(frozen=True, slots=True)
class TheoryCurves:
    """The model over K = 1..k_max for one alpha, c and r(n)."""

    ks: tuple[int, ...]
    expected: tuple[float, ...]        # E(alpha, K) = sum_{i<=K} alpha^i
    expected_rates: tuple[float, ...]  # E from the measured per-position rates
    r: tuple[float, ...]               # r(K + 1), calibrated
    speedup: tuple[float, ...]         # E(alpha, K) / (cK + r(K + 1)), + r(E) for v1 (`metrics.formula_text`)
    best_k: int                        # metrics.best_k

    @property
    def best_speedup(self) -> float:
        return self.speedup[self.ks.index(self.best_k)]


V1_NOTE = ("; v1 verifies without writing, then commits the round's E tokens in a second forward, r(E) of a "
           "step more")


def theory_curves(pred: Prediction, curve: RCurve, k_max: int = K_BOUND) -> TheoryCurves:
    ks = tuple(range(1, k_max + 1))
    return TheoryCurves(
        ks, tuple(metrics.expected_tokens_per_round(pred.alpha, k) for k in ks),
        tuple(metrics.expected_tokens_from_rates(pred.rates, k) for k in ks),
        tuple(curve.at(k + 1) for k in ks),
        tuple(metrics.speedup_curve(pred.alpha, pred.c, curve.at, k_max, pred.commit)),
        metrics.best_k(pred.alpha, pred.c, curve.at, k_max, pred.commit))


def measured_points(view: RunView) -> tuple[MeasuredPoint, ...]:
    by_k: dict[int, list[int]] = {}
    for r in metrics.drafted_rounds(metrics.decode_rounds(view.rounds)):
        by_k.setdefault(r.k, []).append(len(r.emitted))
    return tuple(MeasuredPoint(k, len(n), sum(n) / len(n)) for k, n in sorted(by_k.items()))


def inputs(view: RunView | None) -> tuple[Prediction, RCurve] | NotMeasured:
    """The run's prediction and calibration, or why the curves cannot be drawn yet."""
    if view is None or not view.rounds:
        return NotMeasured("Not measured yet: step at least one speculative round in the playground.")
    pred = view.prediction()
    if isinstance(pred, NotMeasured):
        return pred
    return pred, view.calibration


def theory_figure(view: RunView | None, k_max: int = K_BOUND) -> go.Figure:
    """Two panels over K: E with the measured tokens per round, and the predicted speed-up with the
    measured one; the recommended K marked on both."""
    got = inputs(view)
    if isinstance(got, NotMeasured):
        return empty_figure(got.reason)
    pred, curve = got
    curves = theory_curves(pred, curve, k_max)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, figure=styled_figure(), subplot_titles=(
        f"tokens per round, α = {pred.alpha:.3f}", f"predicted speed-up, c = {pred.c:.3f}"))
    ks = list(curves.ks)
    points = measured_points(view)
    fig.add_trace(go.Scatter(x=ks, y=list(curves.expected), mode="lines+markers", name="E(α, K), i.i.d.",
                             line=dict(color=PREDICTED_COLOUR)), row=1, col=1)
    fig.add_trace(go.Scatter(x=ks, y=list(curves.expected_rates), mode="lines", name="E from per-position rates",
                             line=dict(color=PREDICTED_COLOUR, dash="dash")), row=1, col=1)
    fig.add_trace(go.Scatter(x=[p.k for p in points], y=[p.tokens_per_round for p in points], mode="markers",
                             name="measured, by the round's drafts", marker=dict(color=SPEC_COLOUR, size=12,
                                                                                  symbol="diamond"),
                             text=[f"{p.rounds} rounds that drafted {p.k}" for p in points]), row=1, col=1)
    fig.add_trace(go.Scatter(x=ks, y=list(curves.speedup), mode="lines+markers", name=metrics.formula_text(pred.commit),
                             line=dict(color=PREDICTED_COLOUR, dash="dot")), row=1, col=2)
    measured = metrics.decode_speedup(view.rounds, view.baseline)
    if measured is not None:
        fig.add_trace(go.Scatter(x=[pred.k], y=[measured], mode="markers",
                                 name="measured speed-up after the prefill (mean K)",
                                 marker=dict(color=SPEC_COLOUR, size=12, symbol="star")), row=1, col=2)
    fig.add_hline(y=1.0, line=dict(color=GREY, width=1), row=1, col=2)
    for col in (1, 2):
        fig.add_vline(x=curves.best_k, line=dict(color="#000", dash="dash", width=1), row=1, col=col)
    fig.update_xaxes(title_text="K (drafts per round)", dtick=2)
    fig.update_layout(height=400, margin=dict(l=50, r=20, t=60, b=40),
                      legend=dict(orientation="h", y=-0.22), autosize=True)
    return fig


def r_figure(view: RunView | None) -> go.Figure:
    """The measured r(n): the target's forward over n tokens relative to one, beside r = 1, the
    memory-bound picture Leviathan's formula assumes; the run's own verify forwards on top."""
    curve = view.calibration if view is not None else None
    if curve is None:
        return empty_figure("r(n) not measured yet: the calibration runs in the background when a pair loads.")
    fig = styled_figure()
    fig.add_trace(go.Scatter(x=curve.ns, y=[m / curve.step_ms for m in curve.ms], mode="markers",
                             name="median forward / one-token forward", marker=dict(color=BASELINE_COLOUR, size=7)))
    fig.add_trace(go.Scatter(x=curve.ns, y=curve.r, mode="lines", name="r(n), made non-decreasing",
                             line=dict(color=SPEC_COLOUR, width=3)))
    fig.add_trace(go.Scatter(x=[1, curve.ns[-1]], y=[1, 1], mode="lines", name="r = 1: memory-bound (a GPU at batch 1)",
                             line=dict(color=GREY, dash="dash")))
    own = _run_verify_points(view)
    if own:
        fig.add_trace(go.Scatter(x=[n for n, _ in own], y=[r for _, r in own], mode="markers",
                                 name="this run's verify forwards (median per K+1)",
                                 marker=dict(color=PREDICTED_COLOUR, size=11, symbol="diamond")))
    fig.update_layout(title=dict(text=f"r(n) of {curve.model} on {curve.device} ({curve.dtype}), "
                                      f"{curve.context} tokens of context, one-token forward {curve.step_ms:.2f} ms",
                                 font=dict(size=13)),
                      xaxis_title="n: tokens in one target forward (K + 1 for a verify)",
                      yaxis_title="cost relative to n = 1", height=340,
                      margin=dict(l=50, r=20, t=50, b=40), legend=dict(orientation="h", y=-0.3), autosize=True)
    return fig


def _run_verify_points(view: RunView) -> list[tuple[int, float]]:
    step = metrics.target_step_ms(view.baseline)
    if not step:
        return []
    by_n: dict[int, list[float]] = {}
    for r in metrics.drafted_rounds(metrics.decode_rounds(view.rounds)):
        by_n.setdefault(r.k + 1, []).append(r.timings.target_forward_ms)
    return [(n, metrics.median(ms) / step) for n, ms in sorted(by_n.items())]


def tree_rows(view: RunView, pred: Prediction) -> list[tuple[str, str]]:
    """For a tree run: its tokens per round predicted from the measured per-depth acceptance, and its
    cost from the measured r at its width, beside the same tree on a memory-bound device (r = 1)."""
    spec = view.info.config.tree
    if spec is None:
        return []
    flat = metrics.predict(view.rounds, view.baseline, lambda n: 1.0)
    width = spec.nodes + 1
    out = [(f"tree {spec.label()}: {spec.nodes} nodes, verify width {width}, up to {spec.max_depth} deep",
            f"acceptance by depth {', '.join('—' if r != r else f'{r:.2f}' for r in pred.rates)}"),
           ("tree tokens per round: measured / from the per-depth rates",
            f"{pred.tokens_measured:.2f} / {pred.tokens_rates:.2f}"),
           (f"r({width}) measured here", f"{view.calibration.at(width):.2f}")]
    if not isinstance(flat, NotMeasured):
        out.append(("predicted speed-up: with r measured here / on a memory-bound device (r = 1)",
                    f"{pred.speedup_rates:.2f}× / {flat.speedup_rates:.2f}×"))
    return out


def recommendation_html(view: RunView | None, k_max: int = K_BOUND) -> str:
    """The recommended K and whether speculation is predicted to pay, with where each number comes from."""
    got = inputs(view)
    if isinstance(got, NotMeasured):
        return f'<p class="theory-note"><em>{html.escape(got.reason)}</em></p>'
    pred, curve = got
    curves = theory_curves(pred, curve, k_max)
    measured = metrics.decode_speedup(view.rounds, view.baseline)
    rows = [("recommended K", f"{curves.best_k} (the maximum of {metrics.formula_text(pred.commit)} over K = "
                              f"1..{k_max}{V1_NOTE if pred.commit else ''})"),
            ("verdict", verdict(pred, curve.at, k_max)),
            ("α: accepted / verified positions (the formula's input)", f"{pred.alpha:.3f}"),
            ("draft acceptance rate: accepted / drafted (for comparison)", f"{pred.draft_acceptance:.3f}"),
            ("c (measured: draft forward / target-only step)", f"{pred.c:.3f}"),
            (f"r(K+1) at the run's mean K = {pred.k}", r_text(pred)),
            ("tokens per round: measured / E(α, K) / from per-position rates",
             f"{pred.tokens_measured:.2f} / {pred.tokens_iid:.2f} / {pred.tokens_rates:.2f}"),
            ("speed-up after the prefill: measured / predicted", ("—" if measured is None else f"{measured:.2f}×")
             + f" / {pred.speedup_iid:.2f}×")]
    rows += tree_rows(view, pred)
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv-table">{body}</table>'


# -- r(n) by weight format: a shipped measurement (engine.bench.formats) ---------------------------------------
FORMAT_COLOURS = (SPEC_COLOUR, PREDICTED_COLOUR, BASELINE_COLOUR)
FORMATS_SHOWN = 17   # the widest forward the formats plot opens on (its data go on; zoom out for them)
EXAMPLE_ALPHA, EXAMPLE_C = 0.45, 0.05     # SmolLM2's EAGLE-3 head drafts about this well, at about this cost


def formats_figure(study: FormatCurves | None) -> go.Figure:
    """One target's r(n) in each weight format, measured one after the other on one machine."""
    if study is None:
        return empty_figure("No weight-format measurement ships with this copy (python -m engine calibrate).")
    fig = styled_figure()
    colours = {}
    for curve, colour in zip(study.curves, FORMAT_COLOURS):
        colours[curve.dtype] = colour
        fig.add_trace(go.Scatter(x=curve.ns, y=curve.r, mode="lines+markers", line=dict(color=colour, width=3),
                                 marker=dict(size=6), name=f"{curve.dtype} weights (one-token step "
                                                           f"{curve.step_ms:.1f} ms)"))
    for curve in study.peer:   # llama.cpp on the same weights: dotted, in the colour of the format it reads
        colour = colours.get(PEER_FORMATS.get(curve.dtype, ""), GREY)
        fig.add_trace(go.Scatter(x=curve.ns, y=curve.r, mode="lines", line=dict(color=colour, width=2, dash="dot"),
                                 name=f"{curve.dtype} (step {curve.step_ms:.1f} ms)"))
    every = study.curves + study.peer
    last = max(c.ns[-1] for c in every)
    fig.add_trace(go.Scatter(x=[1, last], y=[1, 1], mode="lines", name="r = 1: memory-bound",
                             line=dict(color=GREY, dash="dash")))
    # opened on the verifies a chain or a small tree makes (K + 1 up to FORMATS_SHOWN); the rest is a zoom away
    shown = min(last, FORMATS_SHOWN)
    top = max(c.at(n) for c in every for n in range(1, shown + 1))
    fig.update_xaxes(range=[0.5, shown + 0.5])
    fig.update_yaxes(range=[0.8, top * 1.08])
    fig.update_layout(title=dict(text=f"r(n) of {study.curves[0].model} by weight format: {study.machine}, "
                                      f"{study.date}", font=dict(size=13)),
                      xaxis_title="n: tokens in one target forward (K + 1 for a verify)",
                      yaxis_title="cost relative to n = 1", height=320, margin=dict(l=50, r=20, t=50, b=40),
                      legend=dict(orientation="h", y=-0.3), autosize=True)
    return fig


def _beside(peer: RCurve, study: FormatCurves) -> str:
    """'; on the F32 file its step 18.3 ms against specplay's 32.6 ms, r(3) 1.26 against 1.01'."""
    own = curve_of(study, PEER_FORMATS.get(peer.dtype, ""))
    if own is None:
        return ""
    return (f"; on the {peer.dtype.removeprefix('llama.cpp ')} file its step {peer.step_ms:.1f} ms against "
            f"specplay's {own.step_ms:.1f} ms ({own.dtype}), r(3) {peer.at(3):.2f} against {own.at(3):.2f}")


def formats_html(study: FormatCurves | None, view: RunView | None, k_max: int = K_BOUND,
                 machine: str | None = None) -> str:
    """What each format's r(n) means for K: the best K and its predicted speed-up under each curve, at this run's
    α and c when the run decodes the measured model, else at an example α and c (said so). `machine`: the one
    serving the page (`engine.clock.machine_name`); a study from another maker's CPU says so."""
    if study is None:
        return ""
    got = inputs(view)
    model = study.curves[0].model
    own = not isinstance(got, NotMeasured) and got[1].model == model
    alpha, c = (got[0].alpha, got[0].c) if own else (EXAMPLE_ALPHA, EXAMPLE_C)
    commit = own and got[0].commit        # a v1 run's rounds pay their commit forward on every curve too
    measured_on = got[1].dtype if own else "float32"     # the example's c is a share of an fp32 step
    why = "this run's α, c and r(n) are not all measured yet" if isinstance(got, NotMeasured) else \
        f"this run does not decode {model}"
    where = f"this run's α {alpha:.2f} and c {c:.3f} (of its {measured_on} step)" if own else \
        f"α {alpha:.2f} and c {c:.2f} of a float32 step (an example: {why})"
    rows = []
    for curve, name in [(x, f"{x.dtype} weights") for x in study.curves] + \
            [(x, f"{x.dtype} (its own forward)") for x in study.peer]:
        share = draft_share(study, c, measured_on, curve)
        best = metrics.best_k(alpha, share, curve.at, k_max, commit)
        speedup = metrics.predicted_speedup(alpha, best, share, curve.at(best + 1),
                                            metrics.commit_cost(alpha, best, curve.at, commit))
        rows.append((name, f"best K = {best}: r({best + 1}) {curve.at(best + 1):.2f}, c {share:.3f}, predicted "
                     f"{speedup:.2f}× over its own target-only"))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    lesson = ("A forward that only reads its weights costs about the same for a few rows as for one (r near 1): "
              "the weights are read once either way. Weights that spend work on every row (int8: each input row "
              "is rounded to int8 with its own scale, and integer products cost more per row; int4: each row is "
              "rounded to 8-bit codes too, and each group of 32 products is summed, converted and scaled for every "
              "row) make a "
              "verify of K + 1 rows cost more target steps, so the best K falls and speculation gains less over a "
              "target step that got cheaper. SmolLM2's float32 weights are read from its file's own codes where "
              "the CPU allows (the same weights, a quarter of the memory): each group of 32 is rebuilt once per "
              "forward and then multiplied for every row, so its one-row step is cheaper and each further row "
              "costs its multiply-adds. c is the same draft's milliseconds over "
              "each curve's own step: the cheaper the step, the more a draft weighs.")
    if study.peer:
        lesson += (" Dotted: llama.cpp's own forward on the same files, timed by its llama-bench in the same sitting "
                   "(its logits for the last row only, so its verify costs at least this)"
                   + "".join(_beside(p, study) for p in study.peer) + ".")
    return (_elsewhere(study, machine) + f'<p class="theory-note">At {html.escape(where)}, on the curves above:</p>'
            f'<table class="kv-table">{body}</table><p class="theory-note">{html.escape(lesson)}</p>')


def _elsewhere(study: FormatCurves, machine: str | None) -> str:
    """A warning where the study was measured on another maker's CPU than the one serving the page."""
    mine, theirs = (vendor(machine) if machine else None), vendor(study.machine)
    if mine is None or mine == theirs:
        return ""
    command = f"python -m engine calibrate --json assets/bench/rn-smollm2-formats-{mine.lower()}.json"
    text = html.escape(f"These curves were measured on {study.machine}, and this machine is {machine}: no study "
                       f"from an {mine} CPU ships with this copy, and a verify's cost depends on the CPU. ")
    return (f'<p class="theory-note warn">{text}<code>{html.escape(command)}</code> measures this one (a few '
            "minutes), and the page draws it from the next start.</p>")


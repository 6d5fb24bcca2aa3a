"""The theory panel: curves from Leviathan's formulas, a recommendation equal to a brute-force search
over K, inputs measured from the run's own records, and a clear "not measured yet" state."""
from __future__ import annotations

from dataclasses import replace

import gradio as gr
import pytest

from engine.compared import ComparedRun
from engine.config import K_BOUND, Mode, SpecConfig
from engine.metrics import best_k
from engine.sampling import SamplingParams
from playground import measure
from playground.pages import theory as page_theory
from playground.pages.theory import TIE_RTOL, NotMeasured, TheoryInputs, theory_curves, theory_inputs
from playground.sessions import Session
from playground.view import Cursor, info_for_run, view_from_run

PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n"


def brute_force_best_k(alpha: float, c: float, r: float, k_max: int) -> int:
    """Independent of the module: the closed form E = (1 - a^(K+1)) / (1 - a) (K+1 at a = 1) at every
    K, then the smallest K within rounding (TIE_RTOL) of the best."""
    values = [((k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)) / (c * k + r)
              for k in range(1, k_max + 1)]
    return 1 + next(i for i, v in enumerate(values) if v >= max(values) * (1 - TIE_RTOL))


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.35, 0.6, 0.8, 0.9, 0.97, 1.0])
@pytest.mark.parametrize("c", [0.0, 0.02, 0.1, 0.3, 1.0])
def test_recommendation_equals_brute_force_over_k(alpha, c):
    curves = theory_curves(alpha, c, 1.0, K_BOUND)
    assert curves.best_k == brute_force_best_k(alpha, c, 1.0, K_BOUND)
    if c > 0:  # no near-ties: the engine's exact argmax agrees too
        assert curves.best_k == best_k(alpha, c, 1.0, K_BOUND)
    assert curves.ks == tuple(range(1, K_BOUND + 1))
    assert curves.best_speedup == pytest.approx(max(curves.speedup), rel=TIE_RTOL)


def test_curves_follow_the_formulas():
    curves = theory_curves(0.5, 0.1, 1.0, 4)
    assert curves.expected == pytest.approx((1.5, 1.75, 1.875, 1.9375))
    assert curves.speedup == pytest.approx(tuple(e / (0.1 * k + 1) for e, k in zip(curves.expected, curves.ks)))
    assert theory_curves(1.0, 0.0, 1.0, 16).best_k == 16       # free, perfect drafts: draft as many as allowed
    assert theory_curves(0.0, 0.5, 1.0, 16).best_speedup < 1   # useless drafts never pay


@pytest.fixture(scope="module")
def live_view(builtin_pair):
    draft, target = builtin_pair
    config = SpecConfig(k=3, sampling=SamplingParams(temperature=1.0), seed=1, max_new_tokens=20, stop_at_eos=False)
    run = ComparedRun(target, draft, PROMPT, config)
    run.run_to_end()
    view = view_from_run(run, info_for_run(run, target, draft))
    run.close()
    return view


def test_inputs_are_measured_from_the_runs_own_records(live_view):
    inputs = theory_inputs(live_view)
    assert isinstance(inputs, TheoryInputs)
    drafted = [r for r in live_view.rounds if r.k]
    assert inputs.alpha == sum(r.accepted for r in drafted) / sum(r.k for r in drafted)
    assert inputs.c == measure.cost_ratio(live_view).c > 0
    assert inputs.measured_speedup == measure.measured_speedup(live_view)
    assert sum(p.rounds for p in inputs.points) == len(drafted)
    for p in inputs.points:
        at_k = [len(r.emitted) for r in drafted if r.k == p.k]
        assert p.tokens_per_round == pytest.approx(sum(at_k) / len(at_k))


def test_the_figure_overlays_measured_points_and_marks_the_recommended_k(live_view):
    inputs = theory_inputs(live_view)
    curves = page_theory.curves_for(inputs)
    fig = page_theory.theory_figure(live_view)
    names = [t.name for t in fig.data]
    assert "measured tokens per round" in names and "predicted speed-up" in names
    assert list(fig.data[names.index("predicted speed-up")].y) == pytest.approx(list(curves.speedup))
    assert {s.x0 for s in fig.layout.shapes if s.x0 == s.x1} == {curves.best_k}
    html = page_theory.recommendation_html(live_view)
    assert f"<td>{curves.best_k} (the curve" in html and f"{inputs.c:.3f}" in html


def test_not_measured_before_any_round_and_without_a_baseline(live_view):
    assert isinstance(theory_inputs(None), NotMeasured)
    assert isinstance(theory_inputs(live_view.upto(0)), NotMeasured)
    no_baseline = replace(live_view, baseline=())
    assert "c not measured" in theory_inputs(no_baseline).reason
    target_only = replace(live_view, info=replace(live_view.info, config=replace(live_view.info.config, mode=Mode.TARGET)),
                          rounds=tuple(replace(r, k=0, accepted=0, positions=[]) for r in live_view.rounds))
    assert "no round has drafted" in theory_inputs(target_only).reason
    assert "Not measured yet" in page_theory.recommendation_html(None)
    assert page_theory.theory_figure(None).layout.annotations[0].text.startswith("Not measured yet")


def test_the_theory_page_builds_and_refreshes_from_a_session(builtin_pair, tmp_path):
    draft, target = builtin_pair
    with gr.Blocks() as demo:
        page = page_theory.build_theory(gr.State(None))
    for name in page.__dataclass_fields__:
        assert getattr(page, name)._id in demo.blocks, name
    assert "Not measured yet" in page_theory.refresh(None)[1]
    session = Session("test", tmp_path)
    session.run = ComparedRun(target, draft, PROMPT, SpecConfig(k=2, sampling=SamplingParams(temperature=1.0)))
    session.info = info_for_run(session.run, target, draft)
    try:
        for _ in range(3):
            session.run.step()
        session.cursor = Cursor(shown=3)
        figure, html = page_theory.refresh(session)
        assert "recommended K" in html and len(figure.data) >= 3
    finally:
        session.drop_run()

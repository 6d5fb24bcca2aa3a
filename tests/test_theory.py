"""The Theory tab: curves from Leviathan's formulas with the measured r(n), a recommendation equal to a
brute-force search over K, inputs measured from the run's own records, and a clear "not measured" state."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine import metrics
from engine.calibration import RCurve
from engine.compared import ComparedRun
from engine.config import K_BOUND, Mode, SpecConfig
from engine.metrics import NotMeasured
from engine.pair import ModelPair
from engine.sampling import SamplingParams
from playground import controller
from playground.pages import theory as page_theory
from playground.render import theory
from playground.sessions import Session
from playground.view import Cursor, info_for_run, view_from_run

PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n"
# A CPU-like curve: r grows with the tokens in the forward.
CURVE = RCurve("t", "cpu", "float32", 64, [1, 2, 5, 9, 17, 33], [2.0, 2.6, 3.4, 4.2, 6.0, 9.0],
               [1.0, 1.3, 1.7, 2.1, 3.0, 4.5], 2.0, 3)
FLAT = RCurve("t", "cuda:0", "bfloat16", 64, [1, 33], [2.0, 2.0], [1.0, 1.0], 2.0, 3)


def brute_force_best_k(alpha: float, c: float, r, k_max: int) -> int:
    """Independent of the module: the closed form E = (1 - a^(K+1)) / (1 - a) (K+1 at a = 1) at every
    K, then the smallest K within the engine's documented tie tolerance of the best."""
    values = [((k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)) / (c * k + r(k + 1))
              for k in range(1, k_max + 1)]
    return 1 + next(i for i, v in enumerate(values) if v >= max(values) * (1 - metrics.TIE_RTOL))


@pytest.fixture(scope="module")
def live_view(builtin_pair):
    draft, target = builtin_pair
    config = SpecConfig(k=3, sampling=SamplingParams(temperature=1.0), seed=1, max_new_tokens=20, stop_at_eos=False)
    run = ComparedRun(ModelPair(target, draft), PROMPT, config)
    run.run_to_end()
    view = view_from_run(run, info_for_run(run, target, draft))
    run.close()
    return replace(view, calibration=CURVE)


@pytest.mark.parametrize("alpha", [0.0, 0.35, 0.6, 0.8, 0.97, 1.0])
@pytest.mark.parametrize("c", [0.0, 0.02, 0.3])
@pytest.mark.parametrize("curve", [CURVE, FLAT])
def test_recommendation_equals_brute_force_over_k(alpha, c, curve):
    pred = metrics.Prediction(alpha, alpha, [alpha], c, 2, curve.at(3), 0, 0, 0, 0, 0, 1, 1)
    curves = theory.theory_curves(pred, curve, K_BOUND)
    assert curves.best_k == brute_force_best_k(alpha, c, curve.at, K_BOUND)
    assert curves.r == tuple(curve.at(k + 1) for k in range(1, K_BOUND + 1))
    assert curves.best_speedup == pytest.approx(max(curves.speedup), rel=1e-9)


def test_a_cpu_like_r_pulls_the_recommended_k_below_the_memory_bound_one():
    assert metrics.best_k(0.8, 0.05, CURVE.at) < metrics.best_k(0.8, 0.05, FLAT.at)


def test_curves_follow_the_formulas():
    pred = metrics.Prediction(0.5, 0.5, [0.5], 0.1, 2, 1.3, 0, 0, 0, 0, 0, 1, 1)
    curves = theory.theory_curves(pred, CURVE, 4)
    assert curves.expected == pytest.approx((1.5, 1.75, 1.875, 1.9375))
    assert curves.expected_rates == pytest.approx(curves.expected)  # one rate: the i.i.d. case
    assert curves.speedup == pytest.approx(tuple(e / (0.1 * k + CURVE.at(k + 1))
                                                 for e, k in zip(curves.expected, curves.ks)))


def test_inputs_are_measured_from_the_runs_own_records(live_view):
    pred, curve = theory.inputs(live_view)
    drafted = [r for r in live_view.rounds if r.k]
    verified = sum(1 for r in drafted for p in r.positions if p.verified)
    assert pred.alpha == sum(r.accepted for r in drafted) / verified
    assert pred.draft_acceptance == sum(r.accepted for r in drafted) / sum(r.k for r in drafted)
    assert pred.c == metrics.cost_ratio(live_view.rounds, live_view.baseline) > 0 and curve is CURVE
    points = theory.measured_points(live_view)
    assert sum(p.rounds for p in points) == len(drafted)
    for p in points:
        at_k = [len(r.emitted) for r in drafted if r.k == p.k]
        assert p.tokens_per_round == pytest.approx(sum(at_k) / len(at_k))


def test_the_figures_overlay_measured_points_and_mark_the_recommended_k(live_view):
    pred, curve = theory.inputs(live_view)
    curves = theory.theory_curves(pred, curve)
    fig = theory.theory_figure(live_view)
    names = [t.name for t in fig.data]
    assert "measured, by the round's drafts" in names and "E(α, K) / (cK + r(K+1))" in names
    assert list(fig.data[names.index("E(α, K) / (cK + r(K+1))")].y) == pytest.approx(list(curves.speedup))
    assert {s.x0 for s in fig.layout.shapes if s.x0 == s.x1} == {curves.best_k}
    html = theory.recommendation_html(live_view)
    assert f"<td>{curves.best_k} (the maximum" in html and f"{pred.c:.3f}" in html and f"{pred.alpha:.3f}" in html
    r_fig = theory.r_figure(live_view)
    by_name = {t.name: t for t in r_fig.data}
    assert list(by_name["r(n), made non-decreasing"].y) == CURVE.r
    assert list(by_name["r = 1: memory-bound (a GPU at batch 1)"].y) == [1, 1]
    own = by_name["this run's verify forwards (median per K+1)"]
    assert set(own.x) <= {2, 3, 4}  # K + 1 for the run's K = 3 (fewer when the budget caps the last round)


def test_not_measured_before_any_round_without_a_baseline_and_without_a_calibration(live_view):
    assert isinstance(theory.inputs(None), NotMeasured)
    assert isinstance(theory.inputs(live_view.upto(0)), NotMeasured)
    assert "c not measured" in theory.inputs(replace(live_view, baseline=())).reason
    assert "r(n) not measured" in theory.inputs(replace(live_view, calibration=None)).reason
    assert "r(n) not measured" in theory.r_figure(replace(live_view, calibration=None)).layout.annotations[0].text
    target_only = replace(live_view, info=replace(live_view.info, config=replace(live_view.info.config, mode=Mode.TARGET)),
                          rounds=tuple(replace(r, k=0, accepted=0, positions=[]) for r in live_view.rounds))
    assert "no round has drafted" in theory.inputs(target_only).reason
    assert "Not measured yet" in theory.recommendation_html(None)
    assert theory.theory_figure(None).layout.annotations[0].text.startswith("Not measured yet")


def test_the_theory_tab_renders_only_verified_rounds_of_a_session(builtin_pair, tmp_path):
    draft, target = builtin_pair
    session = Session("test", tmp_path)
    session.run = ComparedRun(ModelPair(target, draft), PROMPT, SpecConfig(k=2, sampling=SamplingParams(temperature=1.0)))
    session.info = info_for_run(session.run, target, draft)
    try:
        for _ in range(3):
            session.run.step()
        session.cursor = Cursor(shown=3, revealed=False)
        assert len(controller.verified_view(session).rounds) == 2    # the pending round's verdict stays hidden
        session.cursor = Cursor(shown=3)
        assert len(controller.verified_view(session).rounds) == 3
        session.run.set_calibration(CURVE)
        figure, r_figure, html, formats, formats_text = page_theory.render(controller.verified_view(session))
        assert "recommended K" in html and len(figure.data) >= 3 and len(r_figure.data) >= 3
        # the shipped SmolLM2 study: this built-in run's α is not SmolLM2's, so an example α and c, said so
        from engine.bench.formats import shipped_study

        study = shipped_study()   # fp32, int8, int4, r = 1, and llama.cpp's F32 and Q4_1 files dotted
        assert len(formats.data) == len(study.curves) + 1 + len(study.peer) == 6
        assert "this run does not decode smollm2" in formats_text
    finally:
        session.run.close()


def _curve(dtype: str, r: list[float], model: str = "smollm2") -> RCurve:
    ns = list(range(1, len(r) + 1))
    return RCurve(model, "cpu", dtype, 128, ns, [10.0 * x for x in r], r, 10.0, 3)


def test_the_study_drawn_is_the_one_from_a_cpu_of_this_machines_make_and_another_makes_is_flagged(tmp_path):
    """A verify's cost depends on the CPU, so each kind's study ships as its own file; the page draws the one
    measured on this machine's make where there is one, else the first shipped, and says when that is another
    make's (with the command that measures this one)."""
    from engine.bench import formats
    from playground.render.theory import formats_html

    amd = formats.FormatCurves("Linux AMD EPYC, 2 torch threads", "d", "c", [_curve("float32", [1.0] * 9)])
    intel = formats.FormatCurves("Linux Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, 2 torch threads", "d", "c",
                                 [_curve("float32", [1.0 + 0.1 * (n - 1) for n in range(1, 10)])])
    for name, study in (("rn-smollm2-formats-amd.json", amd), ("rn-smollm2-formats-intel.json", intel)):
        formats.write_curves(study, tmp_path / name)
    (tmp_path / "rn-smollm2-formats-broken.json").write_text("{")          # a study that does not read is passed by
    shipped = formats._shipped(tmp_path)
    assert [s.machine for s in shipped] == [amd.machine, intel.machine]
    assert formats.study_for("Linux Intel(R) Xeon(R) CPU @ 2.20GHz, 2 torch threads", shipped) == intel
    assert formats.study_for("Linux AMD EPYC 9B14, 2 torch threads", shipped) == amd
    assert formats.study_for("Darwin arm, 8 torch threads", shipped) == amd       # no maker named: the first
    assert formats.study_for("Linux AMD EPYC", ()) is None
    assert formats.study_for("Linux Intel(R) Xeon(R)", (amd,)) == amd
    genoa = formats.FormatCurves("Linux AMD EPYC 9B14, 2 torch threads", "d", "c", amd.curves)
    assert formats.study_for(genoa.machine, (amd, genoa)) == genoa                  # this very machine first
    assert formats.study_for("Linux AMD EPYC 7B13, 2 torch threads", (amd, genoa)) == amd   # else its maker's first
    away = formats_html(amd, None, machine="Linux Intel(R) Xeon(R) CPU, 2 torch threads")
    assert 'class="theory-note warn"' in away and "rn-smollm2-formats-intel.json" in away
    assert "warn" not in formats_html(amd, None, machine="Linux AMD EPYC 7B13, 2 torch threads")
    assert "warn" not in formats_html(amd, None)


def test_a_format_whose_rows_cost_more_gets_a_smaller_best_k_and_the_tab_says_which_alpha_it_used():
    from engine.bench.formats import FormatCurves
    from playground.render.theory import EXAMPLE_ALPHA, EXAMPLE_C, formats_figure, formats_html

    flat = _curve("float32", [1.0] * 9)                                   # memory-bound: rows are free
    steep = _curve("int8", [1.0 + 0.15 * (n - 1) for n in range(1, 10)])  # each row costs 0.15 of a step
    study = FormatCurves("Some CPU", "2026-12-06", "python -m engine calibrate", [flat, steep])
    text = formats_html(study, None)
    best = [metrics.best_k(EXAMPLE_ALPHA, EXAMPLE_C, c.at) for c in (flat, steep)]
    assert best[1] < best[0]
    assert f"float32 weights</th><td>best K = {best[0]}:" in text
    assert f"int8 weights</th><td>best K = {best[1]}:" in text
    assert "an example: this run&#x27;s α, c and r(n) are not all measured yet" in text
    assert [t.name.split(" ")[0] for t in formats_figure(study).data[:2]] == ["float32", "int8"]
    assert "No weight-format measurement" in formats_figure(None).layout.annotations[0].text


def test_llamacpps_own_curves_are_drawn_dotted_in_their_formats_colour_and_compared_in_words(tmp_path):
    from engine.bench.formats import FormatCurves, format_curves, read_curves, write_curves
    from playground.render.theory import formats_figure, formats_html

    flat, steep = _curve("float32", [1.0] * 9), _curve("int4", [1.0 + 0.2 * (n - 1) for n in range(1, 10)])
    f32 = RCurve("smollm2", "cpu", "llama.cpp F32", 128, [1, 3, 9], [5.0, 6.5, 9.0], [1.0, 1.3, 1.8], 5.0, 3)
    q4 = RCurve("smollm2", "cpu", "llama.cpp Q4_1", 128, [1, 3, 9], [2.0, 4.0, 9.0], [1.0, 2.0, 4.5], 2.0, 3)
    study = FormatCurves("Some CPU", "2026-12-06", "python -m engine calibrate --llamacpp", [flat, steep], [f32, q4])
    traces = formats_figure(study).data
    ours = {t.name.split(" ")[0]: t.line.color for t in traces[:2]}
    dotted = [t for t in traces if t.line.dash == "dot"]
    assert [t.name for t in dotted] == ["llama.cpp F32 (step 5.0 ms)", "llama.cpp Q4_1 (step 2.0 ms)"]
    assert [t.line.color for t in dotted] == [ours["float32"], ours["int4"]]
    layout = formats_figure(study).layout     # opens on n = 1..9 here (all these curves have), y up to Q4_1's r(9)
    assert tuple(layout.xaxis.range) == (0.5, 9.5) and layout.yaxis.range[1] == pytest.approx(4.5 * 1.08)
    text = formats_html(study, None)
    assert "llama.cpp Q4_1 (its own forward)</th><td>best K = 1:" in text
    # the example's draft costs the same milliseconds on every curve: its c is a share of each curve's own step
    assert "float32 weights</th><td>best K = " in text and ", c 0.050, predicted" in text        # 10 ms: the fp32 step
    assert "llama.cpp F32 (its own forward)</th><td>best K = 1: r(2) 1.15, c 0.100," in text     # a 5 ms step
    assert "llama.cpp Q4_1 (its own forward)</th><td>best K = 1: r(2) 1.50, c 0.250," in text    # a 2 ms step
    assert "on the F32 file its step 5.0 ms against specplay&#x27;s 10.0 ms (float32), r(3) 1.30 against 1.00" in text
    assert "on the Q4_1 file its step 2.0 ms against specplay&#x27;s 10.0 ms (int4), r(3) 2.00 against 1.40" in text
    assert "llama.cpp" not in formats_html(FormatCurves("Some CPU", "d", "c", [flat, steep]), None)
    printed = format_curves(study)
    assert "llama.cpp Q4_1 r(n)" in printed and "llama.cpp Q4_1 2.00 ms" in printed and "a lower bound" in printed
    path = tmp_path / "study.json"   # a study kept before llama.cpp's curves were measured beside still reads
    write_curves(FormatCurves("Some CPU", "d", "c", [flat]), path)
    path.write_text(path.read_text().replace(',\n "peer": []', ""))
    assert '"peer"' not in path.read_text() and read_curves(path).peer == []


def test_a_draft_weighs_more_against_a_cheaper_step():
    """c is a draft's milliseconds over the target's step: carried from the format it was measured on to another
    curve by the ratio of their steps, as read from the one study."""
    from engine.bench.formats import FormatCurves, draft_share

    fp32 = RCurve("smollm2", "cpu", "float32", 128, [1, 2], [30.0, 31.0], [1.0, 1.03], 30.0, 3)
    int4 = RCurve("smollm2", "cpu", "int4", 128, [1, 2], [15.0, 18.0], [1.0, 1.2], 15.0, 3)
    study = FormatCurves("Some CPU", "d", "c", [fp32, int4])
    assert draft_share(study, 0.05, "float32", int4) == pytest.approx(0.10)
    assert draft_share(study, 0.10, "int4", fp32) == pytest.approx(0.05)
    assert draft_share(study, 0.05, "float32", fp32) == 0.05
    assert draft_share(study, 0.05, "bfloat16", int4) == 0.05        # no step to carry it from: c as measured


def test_llamacpps_curves_are_only_for_smollm2s_files_and_refused_before_measuring(capsys):
    from engine.bench.formats import main

    assert main(["--target", "builtin", "--llamacpp"]) == 2
    assert "--llamacpp times llama.cpp on SmolLM2's GGUF: use --target smollm2" in capsys.readouterr().err


def test_the_calibrate_command_measures_each_format_and_keeps_what_it_printed(tmp_path, capsys):
    from engine.bench.formats import main, read_curves

    out = tmp_path / "formats.json"
    assert main(["--target", "builtin", "--context", "16", "--repeats", "1", "--json", str(out)]) == 0
    study = read_curves(out)
    assert [c.dtype for c in study.curves] == ["float32", "int8", "int4"] and all(c.r[0] == 1.0 for c in study.curves)
    printed = capsys.readouterr().out
    assert (f"one-token step: float32 {study.curves[0].step_ms:.2f} ms, int8 {study.curves[1].step_ms:.2f} ms, "
            f"int4 {study.curves[2].step_ms:.2f} ms") in printed
    out.write_text(out.read_text().replace('"curves"', '"kurves"'))
    with pytest.raises(ValueError, match="is not a weight-format study"):
        read_curves(out)
    assert main(["--dtypes", "int2"]) == 2


def test_a_v1_run_is_priced_with_its_commit_forward_on_every_format_curve():
    """The formats table prices the run's own α and c on each curve; a v1 run's rounds also pay their commit
    forward there, as in the run's own prediction (metrics.commit_rows)."""
    import re
    from dataclasses import replace

    from engine.bench.formats import FormatCurves
    from engine.config import Mode
    from engine.trace import load_trace
    from playground.pages.traces import EXAMPLES_DIR
    from playground.render.theory import formats_html
    from playground.view import view_from_trace

    v1 = view_from_trace(load_trace(EXAMPLES_DIR / "v1_k4_sampled.jsonl"), "v1")
    model = v1.calibration.model
    study = FormatCurves("Some CPU", "d", "c", [_curve("float32", [1.0 + 0.05 * (n - 1) for n in range(1, 34)], model)])
    as_v2 = replace(v1, rounds=tuple(replace(r, mode=Mode.V2) for r in v1.rounds))
    assert v1.prediction().commit and not as_v2.prediction().commit
    speedups = [float(re.search(r"predicted ([0-9.]+)×", formats_html(study, v)).group(1)) for v in (v1, as_v2)]
    assert "this run&#x27;s α" in formats_html(study, v1) and speedups[0] < speedups[1]

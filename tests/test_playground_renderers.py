"""Renderers on real round records from the built-in pair: chip classes, figure traces, KV grids, charts."""
from __future__ import annotations

import html
import math
import re
import statistics
from pathlib import Path

import plotly.graph_objects as go
import pytest

from engine import metrics
from engine.calibration import RCurve
from engine.compared import ComparedRun
from engine.config import DrafterKind, Mode, SpecConfig
from engine.pair import ModelPair
from engine.records import Outcome, RoundRecord
from engine.sampling import SamplingParams
from engine.trace import load_trace
from playground.render import charts
from playground.render.bars import LABEL_CHARS, LABEL_PX, SLANT, BarChart, BarSeries, bars_figure, bars_html
from playground.render.frame import render_frame
from playground.render.kv_plots import kv_figure, kv_table_html, slot_states
from playground.render.palette import OUTCOME_STYLES, SLOT_COLOURS, SlotState, chip_class
from playground.render.round_plots import position_chart, position_choices
from playground.render.tokens import legend_html, round_chips, stream_html, visible
from playground.view import Cursor, Panel, RunView, info_for_run, view_from_run, view_from_trace

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _run(pair, tmp_path_factory, mode: Mode, temperature: float, max_new: int = 48,
         stop_at_eos: bool = True) -> tuple[RunView, str]:
    draft, target = pair
    path = tmp_path_factory.mktemp("traces") / f"{mode.value}-{temperature}.jsonl"
    config = SpecConfig(mode=mode, k=4, sampling=SamplingParams(temperature=temperature), seed=3,
                        max_new_tokens=max_new, stop_at_eos=stop_at_eos)
    run = ComparedRun(ModelPair(target, draft), PROMPT, config, trace_path=path)
    info = info_for_run(run, target, draft)
    run.run_to_end()
    view = view_from_run(run, info)
    run.close()
    return view, str(path)


@pytest.fixture(scope="module")
def sampled(builtin_pair, tmp_path_factory) -> tuple[RunView, str]:
    return _run(builtin_pair, tmp_path_factory, Mode.V2, 1.0)


@pytest.fixture(scope="module")
def sampled_v1(builtin_pair, tmp_path_factory) -> tuple[RunView, str]:
    return _run(builtin_pair, tmp_path_factory, Mode.V1, 1.0, max_new=24)


@pytest.fixture(scope="module")
def greedy(builtin_pair, tmp_path_factory) -> tuple[RunView, str]:
    return _run(builtin_pair, tmp_path_factory, Mode.V2, 0.0, max_new=16)


def _first(view: RunView, pred) -> RoundRecord:
    found = [r for r in view.rounds if pred(r)]
    assert found, "the fixture run lacks a round of the kind this test needs; pick another seed"
    return found[0]


def _rejected(r: RoundRecord) -> bool:
    return r.final.outcome is Outcome.CORRECTED


def _bonus(r: RoundRecord) -> bool:
    return r.final.outcome is Outcome.BONUS and r.k > 0 and len(r.emitted) == r.k + 1


# -- token chips ---------------------------------------------------------------------------------

def test_chips_follow_each_rounds_outcomes(sampled):
    view, _ = sampled
    for r in view.rounds:
        chips = round_chips(r)
        accepted = [c for c in chips if c.outcome is Outcome.ACCEPTED]
        assert len(accepted) == r.accepted
        assert [c.outcome for c in chips if c.position == r.k] == ([r.final.outcome] if len(r.emitted) > r.accepted else [])
        rejected = [c for c in chips if c.outcome is Outcome.REJECTED]
        unchecked = [c for c in chips if c.outcome is Outcome.UNCHECKED]
        assert len(rejected) == (1 if _rejected(r) else 0)
        assert len(unchecked) == (r.k - r.accepted - 1 if _rejected(r) else 0)
        assert [c.outcome for c in chips[: r.k]] == [p.outcome for p in r.positions]


def test_chip_titles_say_who_drafted(sampled):
    from dataclasses import replace

    view, _ = sampled
    r = next(r for r in view.rounds if r.k and r.draft_forwards)
    titles = lambda rec: [c.title for c in round_chips(rec) if c.position < rec.k]  # noqa: E731
    assert all("(from the draft model)" in t for t in titles(r))
    copied = replace(r, drafter=DrafterKind.HYBRID, proposer=DrafterKind.NGRAM, draft_forwards=0)
    assert all("(copied by prompt lookup)" in t for t in titles(copied))
    assert all("(from the draft model)" in t for t in titles(replace(r, drafter=DrafterKind.HYBRID)))
    assert all("(copied by prompt lookup)" in t for t in titles(replace(r, drafter=DrafterKind.NGRAM,
                                                                        proposer=DrafterKind.NGRAM)))


def test_stream_html_has_every_outcome_class_and_hover_values(sampled):
    view, _ = sampled
    page = stream_html(view, Cursor(shown=len(view.rounds)))
    for outcome in (Outcome.ACCEPTED, Outcome.REJECTED, Outcome.UNCHECKED, Outcome.CORRECTED, Outcome.BONUS):
        assert f'class="chip {chip_class(outcome)}' in page
    r = _first(view, _rejected)
    rejected = next(p for p in r.positions if p.outcome is Outcome.REJECTED)
    assert f"α=min(1,p/q)={rejected.alpha:.3g} u={rejected.u:.3g}" in page
    assert page.count('class="round-sep"') == len(view.rounds)


def test_unrevealed_round_shows_its_drafts_as_pending(sampled):
    view, _ = sampled
    r = view.rounds[2]
    chips = round_chips(r, revealed=False)
    assert [c.outcome for c in chips] == [Outcome.PENDING] * r.k
    page = stream_html(view, Cursor(shown=3, revealed=False))
    assert page.count(chip_class(Outcome.PENDING)) == r.k
    # The earlier rounds stay verified.
    assert page.count('class="round-sep"') == 3


def test_whitespace_is_visible():
    assert visible("  x\n\ty") == "··x↵→y"
    assert visible("") == "∅"


def test_legend_names_every_outcome_with_its_icon():
    legend = legend_html()
    for outcome, style in OUTCOME_STYLES.items():
        assert chip_class(outcome) in legend and outcome.value in legend
    assert len({s.colour for s in OUTCOME_STYLES.values()}) == len(OUTCOME_STYLES)
    assert len({s.icon for s in OUTCOME_STYLES.values()}) == len(OUTCOME_STYLES)


# -- round detail ----------------------------------------------------------------------------------

def test_draft_chart_groups_p_and_q_and_outlines_the_draft(sampled):
    view, _ = sampled
    r = _first(view, _rejected)
    pos = next(p for p in r.positions if p.outcome is Outcome.REJECTED)
    chart = position_chart(r, pos.index)
    assert [s.name for s in chart.series] == ["p_target", "q_draft"]
    assert list(chart.series[0].values) == [c.p_target for c in pos.candidates]
    assert list(chart.series[1].values) == [c.q_draft for c in pos.candidates]
    assert chart.outlined == [c.token for c in pos.candidates].index(pos.token) and chart.mark == "drafted"
    title = " ".join(chart.title)
    assert f"α=min(1, p/q)={pos.alpha:.3f}" in title and f"u={pos.u:.3f}" in title and "REJECTED" in title
    fig = bars_figure(chart)   # the lesson's drawing of the same record
    assert list(fig.data[0].y) == list(chart.series[0].values)
    widths = list(fig.data[0].marker.line.width)
    assert widths.count(max(widths)) == 1 and widths.index(max(widths)) == chart.outlined


def test_correction_chart_marks_the_sampled_token_on_the_residual(sampled):
    view, _ = sampled
    r = _first(view, _rejected)
    chart = position_chart(r, r.k)
    assert chart.series[2].name.startswith("residual")
    residual = list(chart.series[2].values)
    assert all(v >= 0 for v in residual) and sum(residual) <= 1 + 1e-6
    tokens = [c.token for c in r.final.candidates]
    assert r.final.token in tokens
    assert residual[tokens.index(r.final.token)] > 0  # the correction comes from the residual's support
    assert "CORRECTED" in chart.title[0] and chart.mark.startswith("correction")
    assert chart.outlined == tokens.index(r.final.token)
    assert [s.outlines for s in chart.series] == [False, False, True]   # the residual's bar is the one outlined


def test_bonus_chart_shows_the_bonus_row(sampled):
    view, _ = sampled
    r = _first(view, _bonus)
    chart = position_chart(r, r.k)
    assert len(chart.series) == 1 and chart.series[0].name == f"p_target row {r.k} (bonus row)"
    assert chart.series[0].colour == OUTCOME_STYLES[Outcome.BONUS].colour
    assert "BONUS" in chart.title[0]
    assert [v for _, v in position_choices(r)] == list(range(r.k + 1))


def test_unchecked_and_pending_positions_explain_themselves(sampled):
    view, _ = sampled
    r = _first(view, lambda r: any(p.outcome is Outcome.UNCHECKED for p in r.positions))
    unchecked = next(p for p in r.positions if p.outcome is Outcome.UNCHECKED)
    chart = position_chart(r, unchecked.index)
    assert not chart.series and "never checked" in chart.title[0]
    assert "never checked" in bars_html(chart) and "<svg" not in bars_html(chart)
    pending = position_chart(r, 0, revealed=False)
    assert "pending" in pending.title[0]
    with pytest.raises(ValueError):
        position_chart(r, r.k + 1)


def _svg_bars(page: str) -> list[tuple[float, float, str, bool]]:
    """(x, height, colour, outlined) of each bar in a bars_html drawing."""
    found = re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="[\d.]+" height="([\d.]+)" fill="(#\w+)"'
                       r' fill-opacity="[\d.]+"( stroke="#000")?[^>]*>', page)
    return [(float(x), float(h), colour, bool(edge)) for x, h, colour, edge in found]


def test_the_svg_draws_each_value_to_scale_and_outlines_only_the_marked_token(sampled):
    view, _ = sampled
    r = _first(view, _rejected)
    chart = position_chart(r, r.k)     # a correction: three series
    page = bars_html(chart)
    bars = _svg_bars(page)
    n = len(chart.labels)
    assert len(bars) == n * len(chart.series)
    tallest = max(v for s in chart.series for v in s.values)
    unit = max(h for _, h, _, _ in bars) / tallest                 # pixels per unit of probability
    for c in range(n):
        for g, s in enumerate(chart.series):
            x, h, colour, edge = bars[c * len(chart.series) + g]
            assert h == pytest.approx(s.values[c] * unit, abs=0.11) and colour == s.colour
            assert edge == (c == chart.outlined and s.outlines)
    xs = [x for x, *_ in bars]
    assert xs == sorted(xs)                                        # left to right, in the candidates' order
    assert all(html.escape(line) in page for line in chart.title)  # the title as text, above the drawing
    assert all(f"{s.name} of " in html.unescape(page) for s in chart.series)   # every bar's tooltip


def test_the_svg_slants_long_labels_and_keeps_them_inside_the_drawing():
    labels = tuple(f"token number {i} is long" for i in range(16))
    chart = BarChart(("long labels",), labels, (BarSeries("p_target", tuple(0.05 for _ in labels), "#0072B2"),), 0,
                     "drafted")
    page = bars_html(chart)
    assert page.count(f"rotate(-{SLANT})") == len(labels)
    first = float(re.search(rf'translate\(([\d.]+),[\d.]+\) rotate\(-{SLANT}\)', page).group(1))
    assert first >= (LABEL_CHARS * LABEL_PX) * math.cos(math.radians(SLANT)) - 0.5   # its text ends right of 0
    with pytest.raises(ValueError):
        BarChart(("x",), ("a", "b"), (BarSeries("p", (0.1,), "#000"),))


# -- KV grids ------------------------------------------------------------------------------------------

def _count(kv, state: SlotState) -> int:
    return sum(row.count(state) for row in slot_states(kv))


def test_v2_rolls_back_rejected_slots_and_v1_never_does(sampled, sampled_v1):
    v2, _ = sampled
    v1, _ = sampled_v1
    for view, rolls in ((v2, True), (v1, False)):
        for r in [r for r in view.rounds[1:] if not r.finished]:
            target = next(k for k in r.kv if k.model == "target")
            rolled = _count(target, SlotState.ROLLED_BACK)
            if rolls:
                assert rolled == r.k - r.accepted  # K+1 written, rejected ones rolled back
                assert _count(target, SlotState.WRITTEN) == r.accepted + 1
            else:
                assert rolled == 0 and target.rolled_back == []
                assert _count(target, SlotState.WRITTEN) == len(target.written)
            used = sum(_count(target, s) for s in (SlotState.PROMPT, SlotState.COMMITTED, SlotState.WRITTEN))
            assert used == target.length


def test_kv_figure_is_a_heatmap_with_a_legend_of_states(sampled):
    view, _ = sampled
    r = _first(view, _rejected)
    target = next(k for k in r.kv if k.model == "target")
    fig = kv_figure(target)
    assert isinstance(fig.data[0], go.Heatmap)
    assert len(fig.data[0].z) == target.num_blocks and len(fig.data[0].z[0]) == target.block_size
    assert [t.marker.color for t in fig.data[1:]] == [SLOT_COLOURS[s] for s in SlotState]
    assert "✗" in {m for row in fig.data[0].text for m in row}
    table = kv_table_html(r.kv)
    assert target.device in table and "block table" in table and "draft cache" in table


# -- charts ------------------------------------------------------------------------------------------------

def test_acceptance_chart_matches_the_records(sampled):
    view, _ = sampled
    fig = charts.acceptance_figure(view)
    assert [t.name.split(":")[0] for t in fig.data] == ["this round (accepted / drafted)", "draft acceptance rate", "α"]
    assert list(fig.data[0].y) == [r.accepted / r.k if r.k else None for r in view.rounds]
    accepted = sum(r.accepted for r in view.rounds)
    assert fig.data[1].y[-1] == pytest.approx(accepted / sum(r.k for r in view.rounds))
    verified = sum(1 for r in view.rounds for p in r.positions if p.outcome in (Outcome.ACCEPTED, Outcome.REJECTED))
    assert fig.data[2].y[-1] == pytest.approx(accepted / verified) and fig.data[2].y[-1] > fig.data[1].y[-1]
    lengths = charts.accepted_length_figure(view)
    assert sum(lengths.data[0].y) == len([r for r in view.rounds if r.k]) < len(view.rounds)  # the prefill drafts nothing
    per_pos = charts.per_position_figure(view)
    assert len(per_pos.data[0].y) == 4 and per_pos.data[0].y[0] == pytest.approx(metrics.position_rates(view.rounds)[0])
    assert per_pos.layout.xaxis.dtick == lengths.layout.xaxis.dtick == 1   # positions are whole numbers, ticked so
    assert lengths.layout.yaxis.dtick == (1 if max(lengths.data[0].y) <= 10 else None)    # and so are round counts


def test_time_and_speedup_charts_use_both_measured_streams(sampled):
    view, _ = sampled
    fig = charts.tokens_time_figure(view)
    assert len(fig.data) == 2
    assert fig.data[0].y[-1] == view.rounds[-1].tokens_total and fig.data[1].y[-1] == view.baseline[-1].tokens_total
    assert list(fig.data[1].x[1:]) == [b.elapsed_s for b in view.baseline]
    speed = charts.speedup_figure(view)
    assert [t.name for t in speed.data][0] == "measured" and speed.data[1].name.startswith("predicted")
    assert speed.layout.xaxis.dtick == (1 if len(view.rounds) <= 12 else None)
    assert speed.data[3].fill == "tonexty" and all(lo <= p <= hi for lo, p, hi in zip(speed.data[3].y, speed.data[1].y,
                                                                                      speed.data[2].y) if p is not None)
    def after_prefill(rounds):   # tokens and seconds after each run's round 0, by hand
        return (rounds[-1].tokens_total - rounds[0].tokens_total) / (rounds[-1].elapsed_s - rounds[0].elapsed_s)
    assert view.rounds[0].is_prefill and view.baseline[0].is_prefill
    assert speed.data[0].y[0] is None                  # the prefill round alone has no decode to compare
    assert speed.data[0].y[-1] == pytest.approx(after_prefill(view.rounds) / after_prefill(view.baseline))


def r_by_hand(rounds, baseline, curve):
    """r(n) as a prediction reads it, written out: a run's median verify forward of n rows over its median
    target-only step where it has three or more, else the calibration's."""
    step = statistics.median(b.timings.target_forward_ms for b in baseline[1:])
    def r(n):
        ms = [x.timings.target_forward_ms for x in rounds[1:] if x.k and x.k + 1 == n]
        return statistics.median(ms) / step if len(ms) >= 3 else curve.at(n)
    return r


def test_cost_ratio_and_prediction_come_from_the_runs_own_timings_and_the_calibration(sampled):
    from dataclasses import replace

    view, _ = sampled
    draft_ms = statistics.median(ms for r in view.rounds[1:] for ms in r.timings.draft_forward_ms)
    target_ms = statistics.median(b.timings.target_forward_ms for b in view.baseline[1:])  # not the prefill round
    assert metrics.target_step_ms(view.baseline) == pytest.approx(target_ms)
    c = metrics.cost_ratio(view.rounds, view.baseline)
    assert c == pytest.approx(draft_ms / target_ms)
    assert isinstance(view.prediction(), metrics.NotMeasured)  # no calibration yet: r is never assumed
    curve = RCurve("t", "cpu", "float32", 64, [1, 5, 9], [2.0, 3.0, 4.0], [1.0, 1.5, 2.0], 2.0, 1)
    pred = replace(view, calibration=curve).prediction()
    alpha = metrics.alpha(view.rounds)
    r = r_by_hand(view.rounds, view.baseline, curve)
    assert pred.alpha == pytest.approx(alpha) and pred.r == pytest.approx(r(pred.k + 1))
    assert pred.r_calibrated == pytest.approx(curve.at(pred.k + 1)) and pred.r_forwards >= 3   # the run's own
    steps = view.rounds[1:]   # the prefill round is no decode step
    e = lambda k: (1 - alpha ** (k + 1)) / (1 - alpha) if k else 1.0  # noqa: E731
    cost = sum(c * x.draft_forwards + (r(x.k + 1) if x.k else 1.0) for x in steps)
    assert pred.speedup_iid == pytest.approx(sum(e(r.k) for r in steps) / cost)
    assert {r.k for r in steps if r.k} <= {1, 2, 3, 4}


def test_identity_badge(greedy, sampled):
    view, _ = greedy
    assert view.identical_to_baseline() is True
    assert "identical to target-only" in charts.identity_badge(view) and 'badge ok' in charts.identity_badge(view)
    assert "not expected" in charts.identity_badge(sampled[0])


def test_a_speculative_runs_charts_before_its_first_draft_say_why_there_is_none(sampled):
    from dataclasses import replace

    view, _ = sampled
    assert view.rounds[0].k == 0 and view.rounds[1].k > 0        # the first round is the prompt's prefill
    first = charts.per_position_figure(replace(view, rounds=view.rounds[:1])).layout.annotations[0].text
    assert "the first round reads the prompt" in first
    unmatched = replace(view, rounds=(view.rounds[0], replace(view.rounds[1], k=0, positions=())))
    assert metrics.drafted_rounds(unmatched.rounds) == [] and \
        "once the text repeats" in charts.accepted_length_figure(unmatched).layout.annotations[0].text
    assert charts.acceptance_figure(view).layout.annotations == ()               # drafts: a chart, no message


def test_target_only_charts_say_nothing_was_drafted(builtin_pair, tmp_path_factory):
    view, _ = _run(builtin_pair, tmp_path_factory, Mode.TARGET, 1.0, max_new=6, stop_at_eos=False)
    assert all(r.k == 0 and r.final.outcome is Outcome.BONUS for r in view.rounds)
    assert "nothing is drafted" in charts.acceptance_figure(view).layout.annotations[0].text
    assert stream_html(view, Cursor(shown=len(view.rounds))).count(chip_class(Outcome.BONUS)) == 6


# -- replay from a trace -----------------------------------------------------------------------------------

def test_a_trace_replays_exactly_what_the_live_run_showed(sampled):
    live, path = sampled
    replay = view_from_trace(load_trace(path), "example.jsonl")
    assert replay.rounds == live.rounds and replay.baseline == live.baseline
    for shown in (1, len(live.rounds)):
        a, b = render_frame(live, Cursor(shown=shown)), render_frame(replay, Cursor(shown=shown))
        assert a.stream.stream == b.stream.stream
        assert a.charts.acceptance.to_json() == b.charts.acceptance.to_json()
        assert a.kv.target.to_json() == b.kv.target.to_json()


def test_a_prefix_holds_the_baseline_rounds_run_by_then(sampled):
    view, _ = sampled
    for n in range(len(view.rounds) + 1):
        tokens = view.rounds[n - 1].tokens_total if n else 0
        assert view.upto(n).baseline == tuple(b for b in view.baseline if b.tokens_total <= tokens)
        assert view.baseline_by(tokens) == len(view.upto(n).baseline)


@pytest.mark.parametrize("fixture", ["sampled", "sampled_v1"])
def test_the_speedup_series_in_one_pass_equals_reading_every_prefix(fixture, request):
    from dataclasses import replace

    curve = RCurve("t", "cpu", "float32", 64, [1, 5, 9], [2.0, 3.0, 4.0], [1.0, 1.5, 2.0], 2.0, 1)
    view = replace(request.getfixturevalue(fixture)[0], calibration=curve)
    xs, measured, predicted, band = charts.speedup_series(view)
    assert xs == list(range(1, len(view.rounds) + 1))
    for n in xs:
        sub = view.upto(n)
        assert measured[n - 1] == pytest.approx(metrics.decode_speedup(sub.rounds, sub.baseline))
        pred = metrics.predict(sub.rounds, sub.baseline, curve.at)
        assert predicted[n - 1] == (None if isinstance(pred, metrics.NotMeasured) else pytest.approx(pred.speedup_iid))
        if not isinstance(pred, metrics.NotMeasured):  # by hand, as Leviathan writes it
            steps = sub.rounds[1:]
            e = lambda k: sum(pred.alpha**i for i in range(k + 1)) if k else 1.0  # noqa: E731
            e_at = lambda a, k: sum(a**i for i in range(k + 1)) if k else 1.0  # noqa: E731

            used = r_by_hand(sub.rounds, sub.baseline, curve)

            def cost(a: float) -> float:   # v1 commits each round's E tokens in a second forward (commit_rows)
                return sum(pred.c * r.draft_forwards + (used(r.k + 1) if r.k else 1.0)
                           + (used(max(1, round(e_at(a, r.k)))) if r.mode is Mode.V1 else 0.0) for r in steps)

            assert predicted[n - 1] == pytest.approx(sum(e(r.k) for r in steps) / cost(pred.alpha))
            lo, hi = band[n - 1]          # the same formula at the ends of α's Wilson interval
            a_lo, a_hi = metrics.wilson_interval(sum(r.accepted for r in steps if r.k),
                                                 sum(r.verified for r in steps if r.k))
            assert a_lo <= pred.alpha <= a_hi and lo <= predicted[n - 1] <= hi
            assert (lo, hi) == pytest.approx((sum(e_at(a_lo, r.k) for r in steps) / cost(a_lo),
                                              sum(e_at(a_hi, r.k) for r in steps) / cost(a_hi)))
        else:
            assert band[n - 1] is None
    assert sum(p is not None for p in predicted) >= len(xs) - 2   # the prediction appears once c is measured


def test_a_frame_renders_the_tabs_asked_for(sampled):
    view, _ = sampled
    cursor = Cursor(shown=len(view.rounds))
    everything = render_frame(view, cursor)
    assert everything.detail and everything.kv and everything.charts
    for panel in Panel:
        f = render_frame(view, cursor, (panel,))
        assert (f.detail is not None, f.kv is not None, f.charts is not None) == (
            panel is Panel.DETAIL, panel is Panel.KV, panel is Panel.CHARTS)
        assert f.stream == everything.stream
    charts_only = render_frame(view, cursor, (Panel.CHARTS,)).charts
    assert charts_only.speedup.to_json() == everything.charts.speedup.to_json()


def test_a_failed_action_heads_the_status_line(sampled):
    view, _ = sampled
    cursor = Cursor(shown=2)
    plain = render_frame(view, cursor).stream.status
    failed = render_frame(view, cursor, (), failure="Reset failed: The prompt is empty.").stream.status
    assert plain.startswith("**Round 2 of")
    assert failed == f"**⚠ Reset failed: The prompt is empty.** Showing the previous run: {plain}"
    nothing = render_frame(None, Cursor(), (), failure="Reset failed: The playground is full").stream.status
    assert nothing.startswith("**⚠ Reset failed: The playground is full.** No run yet")


def test_frame_for_a_pending_round_hides_its_verdict(sampled):
    view, _ = sampled
    pending = render_frame(view, Cursor(shown=3, revealed=False))
    verified = render_frame(view, Cursor(shown=2))
    assert pending.kv.target.to_json() == verified.kv.target.to_json()
    assert pending.charts.acceptance.to_json() == verified.charts.acceptance.to_json()
    assert "pending" in pending.stream.status
    assert render_frame(view, Cursor(shown=len(view.rounds))).stream.rounds_total == len(view.rounds)


def test_the_tree_view_gives_every_node_its_own_place_and_the_final_token_the_paths_row(builtin_pair):
    """On real hybrid tree rounds (greedy and sampled): one chip per node at a distinct place, the final
    token one column right of the path's end and in its row (not on top of a rejected child), the
    accepted path bold, and copies marked."""
    import re

    from engine.config import TreeSpec
    from playground.render.tree import tree_html

    draft, target = builtin_pair
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    seen = {"corrected": 0, "bonus": 0, "copied": 0}
    for temperature in (0.0, 0.8):
        config = SpecConfig(drafter=DrafterKind.HYBRID, tree=TreeSpec(budget=12, depth=5), max_new_tokens=40,
                            sampling=SamplingParams(temperature=temperature), seed=1)
        run = ComparedRun(ModelPair(target, draft), code, config, compare=False)
        rounds = [r for r in run.run_to_end() if r.tree is not None]
        run.close()
        for r in rounds:
            page = tree_html(r)
            chips = {int(m["pos"]): (int(m["left"]), int(m["top"]), m["cls"]) for m in re.finditer(
                r'class="chip (?P<cls>[^"]*)" data-round="\d+" data-pos="(?P<pos>\d+)" data-outcome="\w+" '
                r'style="left:(?P<left>\d+)px;top:(?P<top>\d+)px;width:\d+px"', page)}
            assert sorted(chips) == list(range(len(r.tree.nodes) + 1))          # node chips, and 0: the final
            assert len({(x, y) for x, y, _ in chips.values()}) == len(chips)     # no chip on top of another
            end = r.tree.path[-1] if r.tree.path else None
            if end is not None:
                (ex, ey, _), (fx, fy, _) = chips[end], chips[0]
                assert fy == ey and fx > ex
            for n in r.tree.nodes:
                cls = chips[n.index][2].split()
                assert ("on-path" in cls) == (n.index in r.tree.path) and ("copied" in cls) == n.copied
            seen[r.final.outcome.value if r.final.outcome.value in seen else "bonus"] += 1
            seen["copied"] += sum(n.copied for n in r.tree.nodes)
    assert seen["corrected"] and seen["copied"], seen


def test_the_verdict_says_whether_speculation_pays_here_and_if_not_why():
    from types import SimpleNamespace

    flat = lambda n: 1.0                         # noqa: E731  a memory-bound verify: r(n) = 1
    steep = lambda n: 1.0 + 0.2 * (n - 1)        # noqa: E731  a CPU whose verify of n rows costs more
    assert charts.verdict(SimpleNamespace(alpha=0.8, c=0.05, commit=False), flat).startswith("predicted to pay: ")
    low = charts.verdict(SimpleNamespace(alpha=0.3, c=0.067, commit=False), steep)
    # at α 0.3 the best K is 1: E = 1.3 tokens for c + r(2) = 0.067 + 1.2 steps, 1.03×; at c = 0.2 it cannot pay
    assert low.startswith("predicted to pay: 1.03× at K = 1")
    worse = charts.verdict(SimpleNamespace(alpha=0.3, c=0.2, commit=False), steep)
    assert worse.startswith("not predicted to pay: even the best K (1) gives 0.93×")
    assert "1.30 tokens for the time of 1.40 target steps (α 0.30, c 0.200, r(2) 1.20" in worse
    v1 = charts.verdict(SimpleNamespace(alpha=0.3, c=0.067, commit=True), steep)   # v1 pays r(1) = 1 more a round
    assert v1.startswith("not predicted to pay: even the best K (1) gives 0.57×") and "v1's commit forward 1.00" in v1


def test_wilson_interval_covers_the_proportion_and_narrows_with_trials():
    lo, hi = metrics.wilson_interval(3, 10)
    assert (lo, hi) == pytest.approx((0.1078, 0.6032), abs=1e-4)      # Wilson 1927, z = 1.96
    assert metrics.wilson_interval(30, 100)[1] - metrics.wilson_interval(30, 100)[0] < hi - lo
    assert metrics.wilson_interval(0, 0) == (0.0, 1.0) and metrics.wilson_interval(5, 5)[1] == 1.0


def test_the_compare_table_names_each_traces_machine_where_it_was_recorded():
    """Timings differ between machines, so two traces compared side by side say what each ran on (traces from
    version 4 on record it; older ones say it was not recorded)."""
    from engine.trace import load_trace
    from playground.pages.traces import EXAMPLES_DIR
    from playground.render.compare import ROW_NAMES, compare_table_html
    from playground.view import view_from_trace

    data = Path(__file__).parent / "data"
    welcome, older = load_trace(EXAMPLES_DIR / "welcome_smollm2.jsonl"), load_trace(data / "trace_v1.jsonl")
    assert welcome.header.machine and older.header.version < 4 and older.header.machine is None
    table = compare_table_html(view_from_trace(welcome, "a"), view_from_trace(older, "b"))
    assert len(ROW_NAMES) + 1 == table.count("<tr>")     # a heading row, then one per name
    assert f"<tr><th>machine</th><td>{welcome.header.machine}</td><td>— (not recorded)</td></tr>" in table
    # the welcome run drafted with an EAGLE head, the older trace with the built-in draft model: each is named
    assert f"<tr><th>draft model / EAGLE head</th><td>{welcome.header.eagle}</td><td>{older.header.draft}</td></tr>" \
        in table and welcome.header.eagle and welcome.header.draft is None

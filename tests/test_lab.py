"""The losslessness lab: a round's real rows, the exact law of each rule, and the chi-square verdicts
(correct rule passes, each wrong rule fails) with fixed seeds on the built-in pair."""
from __future__ import annotations

import gradio as gr
import pytest
import torch

from engine.compared import ComparedRun
from engine.config import DrafterKind, SpecConfig
from engine.pair import ModelPair
from engine.prompts import encode_prompt
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeEngine
from engine.stats import goodness_of_fit
from playground import controller
from playground.pages import lab as page_lab
from playground.render import lab as render_lab
from playground.render.tokens import chip_text
from playground.sessions import Session
from playground.teach import lab
from playground.teach.lesson import WRONG_RULES, RoundRows, best_window, round_rows, rule_output, separation, window
from playground.teach.losslessness import Rule, simulate
from playground.view import Cursor, info_for_run

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
TOL = 1e-4  # the rows are recomputed on fresh caches: same ops, float32 rounding at most


def sampled(k: int = 4, drafter: DrafterKind = DrafterKind.MODEL) -> SpecConfig:
    return SpecConfig(k=k, drafter=drafter, sampling=SamplingParams(temperature=1.0), seed=3, max_new_tokens=24)


@pytest.fixture(scope="module")
def run(builtin_pair):
    draft, target = builtin_pair
    ids = encode_prompt(target.tokenizer, PROMPT)
    engine = SpeculativeEngine(ModelPair(target, draft), ids, sampled())
    rounds = engine.run()
    engine.close()
    return target, draft, ids, rounds


@pytest.fixture(scope="module")
def rows(run) -> RoundRows:
    target, draft, ids, rounds = run
    index = next(r.index for r in rounds if r.k == 4)
    return round_rows(target, draft, ids, rounds, index, sampled())


def test_recomputed_rows_match_every_value_the_record_holds(run):
    target, draft, ids, rounds = run
    assert rounds[0].k == 0 and all(r.k > 0 for r in rounds[1:-1])  # the prefill round drafts nothing
    for r in rounds[1:]:
        rows = round_rows(target, draft, ids, rounds, r.index, sampled())
        assert rows.q_draft.shape == (r.k, target.vocab_size) and rows.p_target.shape == (r.k + 1, target.vocab_size)
        assert torch.allclose(rows.p_target.sum(-1), torch.ones(r.k + 1), atol=1e-5)
        for p in r.positions:
            assert rows.q_draft[p.index, p.token] == pytest.approx(p.q_draft, abs=TOL)
            if p.verified:
                assert rows.p_target[p.index, p.token] == pytest.approx(p.p_target, abs=TOL)
                for c in p.candidates:
                    assert (float(rows.p_target[p.index, c.token]), float(rows.q_draft[p.index, c.token])) == \
                        pytest.approx((c.p_target, c.q_draft), abs=TOL)
        assert rows.p_target[r.final.row, r.final.token] == pytest.approx(r.final.p_target, abs=TOL)


def test_ngram_rows_are_one_hot_on_the_drafts(builtin_pair):
    draft, target = builtin_pair
    ids = encode_prompt(target.tokenizer, PROMPT * 3)
    engine = SpeculativeEngine(ModelPair(target, None), ids, sampled(drafter=DrafterKind.NGRAM))
    while not engine.rounds or engine.rounds[-1].k == 0:
        engine.step()
    r = engine.rounds[-1]
    rows = round_rows(target, None, ids, engine.rounds, r.index, sampled(drafter=DrafterKind.NGRAM))
    engine.close()
    assert r.k > 0 and rows.q_draft.sum().item() == r.k
    assert [int(rows.q_draft[i].argmax()) for i in range(r.k)] == [p.token for p in r.positions]


def test_a_round_without_drafts_has_no_rows(builtin_pair):
    draft, target = builtin_pair
    ids = encode_prompt(target.tokenizer, "zzqx")
    engine = SpeculativeEngine(ModelPair(target, None), ids, sampled(drafter=DrafterKind.NGRAM))
    engine.step()
    with pytest.raises(ValueError, match="drafted nothing .the prefill round"):
        round_rows(target, None, ids, engine.rounds, 0, sampled(drafter=DrafterKind.NGRAM))
    engine.step()
    assert engine.rounds[1].k == 0  # "zzqx" plus one token: no earlier n-gram to copy
    with pytest.raises(ValueError, match="drafted nothing .target-only, or no n-gram match"):
        round_rows(target, None, ids, engine.rounds, 1, sampled(drafter=DrafterKind.NGRAM))
    engine.close()


# -- the verdicts ---------------------------------------------------------------------------------------
def test_correct_rule_passes_and_each_wrong_rule_fails_on_real_rows(rows):
    results = {rule: lab.run_lab(rows, rule, 10_000, seed=0) for rule in Rule}
    assert results[Rule.CORRECT].passed and results[Rule.CORRECT].fits
    for rule in WRONG_RULES:
        assert not results[rule].passed, rule
        assert min(f.p_value for f in results[rule].fits) < lab.ALPHA_LEVEL, rule


@pytest.mark.parametrize("rule", WRONG_RULES)
def test_each_wrong_rule_fails_even_alone_on_its_own_best_window(rows, rule):
    start, length = best_window(rows, (rule,))
    result = lab.run_lab(rows, rule, 10_000, seed=1, start=start, length=length)
    assert not result.passed
    assert lab.run_lab(rows, Rule.CORRECT, 10_000, seed=1, start=start, length=length).passed


@pytest.mark.parametrize("rule", list(Rule))
def test_the_exact_law_of_each_rule_matches_the_monte_carlo(rows, rule):
    """rule_output (used to pick the window and draw each rule's limit) is what simulate converges to."""
    q, p = window(rows, 0, 2)
    law = rule_output(q, p, rule)
    trials = 20_000
    counts = simulate(q, p, rule, trials, torch.Generator().manual_seed(5))
    for i in range(3):
        n = int(counts[i].sum())
        reach = float(law.reach[i])
        assert n / trials == pytest.approx(reach, abs=5 * (reach / trials) ** 0.5 + 1e-3)
        if n >= 50:
            assert goodness_of_fit(counts[i], law.dist[i]).passed, (rule, i)


def test_separation_is_zero_only_for_the_correct_rule_and_the_window_maximises_it(rows):
    for start in range(4):
        for length in range(1, 5 - start):
            q, p = window(rows, start, length)
            assert separation(q, p, Rule.CORRECT) == pytest.approx(0.0, abs=1e-12)
            assert all(separation(q, p, r) > 0 for r in WRONG_RULES)
    best = best_window(rows)
    score = min(separation(*window(rows, *best), r) for r in WRONG_RULES)
    assert all(min(separation(*window(rows, s, n), r) for r in WRONG_RULES) <= score
               for s in range(4) for n in range(1, 5 - s))
    with pytest.raises(ValueError, match="does not fit"):
        window(rows, 3, 2)


def test_discard_on_reject_is_caught_by_its_exact_law_on_a_tiny_example():
    q = torch.tensor([[0.5, 0.5, 0.0]])
    p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    law = rule_output(q, p, Rule.DISCARD_ON_REJECT)
    # Index 0 emits only the accepted draft: token 0 with probability beta = 0.5, then p_1 at index 1.
    assert law.reach.tolist() == [0.5, 0.5] and law.dist[0].tolist() == [1.0, 0.0, 0.0]
    assert rule_output(q, p, Rule.BONUS_FROM_ROW_K_MINUS_1).dist[1].tolist() == [1.0, 0.0, 0.0]
    assert separation(q, p, Rule.BONUS_FROM_ROW_K_MINUS_1) == float("inf")  # emits a token p forbids


# -- rendering and the tab ------------------------------------------------------------------------------
def test_renderers_show_the_sample_the_target_and_the_verdict(rows):
    result = lab.run_lab(rows, Rule.BONUS_FROM_ROW_K_MINUS_1, 5_000, seed=2, start=0, length=1)
    assert result.worst_index() == 1
    fig = render_lab.lab_figure(result, 1, {})
    assert [t.name.split(" ")[0] for t in fig.data] == ["empirical", "p_target", "limit"]
    assert "REJECTED" in fig.layout.title.text and "bonus row" in fig.layout.title.text
    table = render_lab.fits_table_html(result)
    assert table.count("<tr>") == 3 and "✗ FAIL" in table
    assert "not lossless" in render_lab.verdict_html(result)
    with pytest.raises(ValueError, match="N must be"):
        lab.run_lab(rows, Rule.CORRECT, 0, seed=0)


def test_the_lab_page_builds_and_runs_on_a_playground_session(builtin_pair, tmp_path):
    draft, target = builtin_pair
    with gr.Blocks() as demo:
        page = page_lab.build()
    for name in page.__dataclass_fields__:
        assert getattr(page, name)._id in demo.blocks, name
    session = Session("test", tmp_path)
    with pytest.raises(ValueError, match="No round shown yet"):
        controller.lab_rows(session)
    session.run = ComparedRun(ModelPair(target, draft), PROMPT, sampled(k=2))
    session.info = info_for_run(session.run, target, draft)
    try:
        session.run.step()
        session.cursor = Cursor(shown=1)
        with pytest.raises(ValueError, match="the prefill round"):
            controller.lab_rows(session)
        session.run.step()
        session.cursor = Cursor(shown=2)
        rows, decode = controller.lab_rows(session)
        first = session.run.spec.rounds[1].positions[0]        # read by the recorder after the same context
        assert decode(first.token) == chip_text(first.text, first.pending)
        lead = target.tokenizer.convert_tokens_to_ids("Ã")     # byte 0xc3 alone: the start of a character
        assert decode(lead) == "‹c3›"
        result = lab.run_lab(rows, Rule.CORRECT, 4000, 0)
        out = page_lab.render(result, lab.token_texts(result, decode))
        held, verdict = out[0], out[1]
        assert "✓" in verdict and held[0].round == 1 and isinstance(held[1], dict)
        result = lab.run_lab(rows, Rule.BONUS_FROM_ROW_K_MINUS_1, 4000, 0, 0, 1)
        out = page_lab.render(result, lab.token_texts(result, decode))
        assert "✗" in out[1] and out[0][0].start == 0 and out[0][0].length == 1
        assert page_lab.on_index(out[0], 0).layout.title.text.startswith("output index 0")
    finally:
        session.drop_run()

"""The lesson: its text as validated data, the seed search, and a headless walk through every step
on the built-in pair (driver and page renderers), checked against the real records."""
from __future__ import annotations

import copy
import json

import gradio as gr
import pytest

from engine.pair import ModelPair
from engine.records import Outcome
from engine.sources import SMOLLM2_PIP, smollm2_gguf
from playground.pages import lesson as page_lesson
from playground.teach.lesson import (
    LESSONS_DIR,
    NO,
    STEP_SPECS,
    YES,
    LessonDriver,
    LessonError,
    LessonSettings,
    StepId,
    View,
    find_plan,
    is_bonus_round,
    is_reject_round,
    load_lesson_text,
    parse_lesson_text,
    placeholders,
)


@pytest.fixture(scope="module")
def text():
    return load_lesson_text("en")


@pytest.fixture(scope="module")
def raw():
    return json.loads((LESSONS_DIR / "en.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def builtin_plan(builtin_pair):
    """The seed search on the built-in pair, run once for the module (it is deterministic: tested below)."""
    draft, target = builtin_pair
    pair = ModelPair(target, draft)
    return pair, find_plan(pair)


@pytest.fixture()
def driver(builtin_plan, text):
    pair, plan = builtin_plan
    d = LessonDriver(pair, text, plan)   # a fresh learner's driver over the searched plan
    yield d
    d.close()


# -- the text ---------------------------------------------------------------------------------------
def test_english_text_covers_every_step_in_order(text):
    assert [s.id for s in text.steps] == list(StepId)
    assert 8 <= len(text.steps) <= 12
    for s in text.steps:
        spec = STEP_SPECS[s.id]
        assert (s.question is None) == (spec.question is None), s.id
        assert placeholders(s.body) <= spec.facts, s.id


def _broken(raw, change):
    data = copy.deepcopy(raw)
    change(data)
    return data


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(schema="other"), "schema"),
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d["ui"].pop("next"), "next"),
    (lambda d: d["steps"].reverse(), "in order"),
    (lambda d: d["steps"][0].update(body="{nonsense}"), "nonsense"),
    # u gives the verdict away: only the reveal text may use it, never the body or the prompt.
    (lambda d: d["steps"][3].update(body="u = {u}"), "'u'"),
    (lambda d: d["steps"][3]["question"].update(prompt="u = {u}?"), "'u'"),
    (lambda d: d["steps"][3].update(question=None), "needs a question"),
    (lambda d: d["steps"][0].update(title=""), "title"),
], ids=["schema", "version", "ui-key", "order", "unknown-fact", "secret-in-body", "secret-in-prompt",
        "missing-question", "empty-title"])
def test_bad_lesson_text_is_refused_with_a_reason(raw, change, message):
    with pytest.raises(LessonError, match=message):
        parse_lesson_text(_broken(raw, change))


def test_a_translation_is_one_more_file(tmp_path, raw):
    data = _broken(raw, lambda d: d.update(lang="xx", title="Lección"))
    (tmp_path / "xx.json").write_text(json.dumps(data), encoding="utf-8")
    assert load_lesson_text("xx", tmp_path).title == "Lección"
    with pytest.raises(LessonError, match="available: xx"):
        load_lesson_text("fr", tmp_path)


# -- the search -------------------------------------------------------------------------------------
def test_seed_search_is_deterministic_and_finds_every_case(builtin_plan):
    pair, plan = builtin_plan
    assert plan == find_plan(pair)
    assert plan.reject_round < plan.settings.max_rounds and plan.bonus_round < plan.settings.max_rounds


def test_seed_search_says_when_nothing_fits(builtin_pair):
    draft, target = builtin_pair
    with pytest.raises(LessonError, match="No seed"):
        find_plan(ModelPair(target, draft), LessonSettings(k=16, seeds=1, max_rounds=2))


# -- the walk through ---------------------------------------------------------------------------------
def test_the_lesson_advances_through_every_step_on_the_builtin_pair(driver):
    seen = []
    step = driver.go(0)
    while True:
        seen.append(step.id)
        assert step.index == len(seen) - 1 and step.total == len(StepId)
        assert "{" not in step.body and step.title
        assert step.view is STEP_SPECS[step.id].view
        if step.question is not None:
            assert not step.revealed
            assert step.question.answer in {v for _, v in step.question.choices}
            check = driver.answer(step.question.answer)
            assert check.correct and driver.current().revealed and driver.current().answered == step.question.answer
        if step.index == step.total - 1:
            break
        step = driver.next()
    assert seen == list(StepId)
    assert driver.next().id is StepId.PAYS  # clamped at the end
    assert driver.go(0).id is StepId.MEMORY_BOUND


def _step(driver, step_id):
    return driver.go(list(StepId).index(step_id))


def test_answers_are_read_off_the_real_records(driver):
    plan, k = driver.plan, driver.plan.settings.k
    reject, bonus = driver.record(plan.reject_round), driver.record(plan.bonus_round)
    assert is_reject_round(reject, k) and is_bonus_round(bonus, k)

    accept = _step(driver, StepId.ACCEPT)
    assert reject.positions[accept.position].outcome is Outcome.ACCEPTED and accept.question.answer == YES
    rejected = _step(driver, StepId.REJECT)
    assert rejected.position == reject.accepted and reject.positions[rejected.position].outcome is Outcome.REJECTED
    assert rejected.question.answer == NO and "u" not in placeholders(rejected.body)
    assert _step(driver, StepId.RESIDUAL).question.answer == NO  # a rejected draft has p < q: zero residual
    bonus_step = _step(driver, StepId.BONUS)
    assert bonus_step.round == plan.bonus_round and bonus_step.question.answer == str(k) == str(bonus.final.row)
    kv = _step(driver, StepId.KV)
    target_kv = next(s for s in reject.kv if s.model == "target")
    assert kv.question.answer == str(len(target_kv.rolled_back)) == str(k - reject.accepted)
    assert (kv.facts["written"], kv.facts["kept"]) == (str(k + 1), str(reject.accepted + 1))
    assert _step(driver, StepId.DRAFT).question.answer == str(k)
    assert _step(driver, StepId.VERIFY).question.answer == "1"
    assert _step(driver, StepId.V1_V2).question.answer == "2"
    v1 = driver.v1_record(plan.reject_round)
    assert v1.emitted == reject.emitted and v1.target_forwards == 2  # same draws, one more forward
    assert _step(driver, StepId.PAYS).question.answer == NO


def test_a_wrong_answer_is_marked_wrong_and_reveals(driver):
    step = _step(driver, StepId.REJECT)
    check = driver.answer(YES)
    assert not check.correct and check.answer == "No" and "No" in check.feedback
    assert driver.current().revealed and driver.current().answered == YES
    assert step.facts["u"] in driver.current().question.reveal
    _step(driver, StepId.KV)
    with pytest.raises(LessonError, match="Pick an answer"):
        driver.answer(None)
    assert not driver.current().revealed


# -- the page -----------------------------------------------------------------------------------------
def test_every_step_renders_headlessly_with_its_view(driver):
    for i in range(driver.total):
        step = driver.go(i)
        before = page_lesson.render_step(driver, step)
        assert before.body.startswith("### ") and 'class="stream"' in before.stream
        assert (before.figure is None) == (step.view is View.CHIPS)
        assert before.asks == (step.question is not None) and before.feedback == ""
        if step.id in (StepId.ACCEPT, StepId.REJECT):
            title = before.figure.layout.title.text
            assert "u not shown yet" in title and "ACCEPTED" not in title and "REJECTED" not in title
            assert "chip-pending" in before.stream
        if step.question is not None:
            after = page_lesson.render_step(driver, driver.reveal())
            assert not after.asks and after.feedback == step.question.reveal
            if step.id is StepId.ACCEPT:
                assert "ACCEPTED" in after.figure.layout.title.text
                # The "drafted" arrow points at the outlined (drafted) bar, whatever its label looks like.
                arrow = next(a for a in after.figure.layout.annotations if a.text == "drafted")
                assert after.figure.data[0].marker.line.width[arrow.x] == max(after.figure.data[0].marker.line.width)
            if step.id is StepId.REJECT:
                assert "REJECTED" in after.figure.layout.title.text and "chip-rejected" in after.stream
    assert "chip-pending" in page_lesson.render_step(driver, _step(driver, StepId.DRAFT)).stream


def test_the_lesson_page_builds_and_its_handlers_run_headlessly(builtin_pair):
    with gr.Blocks() as demo:
        page = page_lesson.build_lesson()
    assert len(page.steps) == len(StepId) and page.walkthrough._id in demo.blocks
    for block in page.steps:
        for name in block.__dataclass_fields__:
            assert getattr(block, name)._id in demo.blocks, name
    handlers = page_lesson.LessonHandlers(page, load_lesson_text(), None)
    out = handlers.start(None)
    driver = out[0]
    try:
        assert isinstance(driver, LessonDriver) and len(out) == 1 + len(handlers.outputs(0))
        accept = list(StepId).index(StepId.ACCEPT)
        shown = handlers.go(accept, driver)
        assert shown[1].selected == accept and "α" in shown[4]
        checked = handlers.check(accept, driver, YES)
        assert checked[-1].startswith("✓")
    finally:
        driver.close()


def test_the_cost_claims_agree_with_the_bars_beside_them(driver):
    """The memory-bound step's chart title and its text state the ratio of the bars they stand beside, and
    say "about one step" only where the run measured about one step."""
    import re

    step = _step(driver, StepId.MEMORY_BOUND)
    shown = page_lesson.render_step(driver, step)
    step_bar, verify_bar = shown.figure.data[0].y[:2]
    ratio = verify_bar / step_bar
    title = shown.figure.layout.title.text
    stated = float(re.search(r"costs ([\d.]+)× one step", title).group(1))
    assert stated == pytest.approx(ratio, abs=0.051)
    assert f"costs {stated:.1f}× one step" in shown.body                         # the text says the same
    assert ("about one step" in title) == (0.8 <= ratio <= 1.3)
    assert ("less than one step" in title) == (ratio < 0.8)
    assert ("compute-bound" in title) == (ratio > 1.3) and ("not about 1×" in shown.body) == (ratio > 1.3)
    from playground.teach.lesson import cost_claim
    assert "about one step" in cost_claim(5, 1.1) and "compute-bound" in cost_claim(5, 2.9)
    assert "less than one step" in cost_claim(5, 0.5) and "about one step" not in cost_claim(5, 0.5)


# -- the real model ------------------------------------------------------------------------------------
needs_smol = pytest.mark.skipif(smollm2_gguf() is None, reason=f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")


@pytest.fixture(scope="module")
def smol_driver(smol, text):
    from engine.drafters.eagle import load_eagle
    from engine.sources import SMOLLM2

    d = LessonDriver.start(ModelPair(smol, None, load_eagle(SMOLLM2, smol)), text)
    yield d
    d.close()


@needs_smol
def test_on_smollm2_the_lesson_asks_a_chat_question_drafted_by_its_eagle_head(smol_driver):
    from engine.config import DrafterKind
    from engine.prompts import ChatPrompt

    d = smol_driver
    s = d.plan.settings
    assert s.drafter is DrafterKind.EAGLE and isinstance(s.prompt, ChatPrompt) and s.temperature < 1
    assert s.prompt_ids(d.target.tokenizer)[-3:] == d.target.tokenizer.encode("<|im_start|>assistant\n")[-3:]
    seen = []
    for i in range(d.total):
        step = d.go(i)
        seen.append(step.id)
        assert "{" not in step.body and "draft model" not in step.body
        if step.question is not None:
            assert d.answer(step.question.answer).correct
    assert seen == list(StepId)
    draft = _step(d, StepId.DRAFT)
    assert "EAGLE head" in draft.body
    head_mib = float(draft.facts["drafter_mib"])
    assert head_mib == pytest.approx(d.pair.eagle.weight_bytes / 2**20, abs=0.05) and head_mib < float(draft.facts["target_mib"])
    reject = d.record(d.plan.reject_round)
    assert draft.question.answer == str(reject.draft_forwards) and is_reject_round(reject, s.k)
    text = d.target.tokenizer.decode(d.run.spec.generated)
    assert "sky" in text.lower() or "blue" in text.lower()   # an answer to the question, not gibberish


@needs_smol
def test_the_lesson_offers_the_real_model_first(smol):
    from engine.sources import BUILTIN, SMOLLM2
    from playground.registry import ModelRegistry

    registry = ModelRegistry(None, SMOLLM2)
    try:
        keys = [k for _, k in page_lesson.lesson_choices(registry)]
        assert registry.resolve(keys[0]).target == SMOLLM2 and registry.resolve(keys[-1]).target == BUILTIN
        # the Hub pairs are not offered: a lesson never starts a download
        assert all(registry.resolve(k).target in (SMOLLM2, BUILTIN) for k in keys) and "qwen-0.5b-1.5b" not in keys
        with pytest.raises(Exception, match="runs on"):
            page_lesson.lesson_pair(registry, "qwen-0.5b-1.5b")
    finally:
        registry.close()


def test_the_pays_step_says_what_the_weight_format_does_to_the_best_k(monkeypatch):
    """Its reveal reads the shipped r(n) study: a verify of K + 1 tokens in each format, and the best K under each
    curve at the run's α and c (a format whose rows cost more gets the smaller K); without a study, dashes."""
    from engine.bench import formats
    from playground.teach.lesson import format_facts
    from tests.test_theory import _curve

    flat, steep = _curve("float32", [1.0] * 9), _curve("int8", [1.0 + 0.15 * (n - 1) for n in range(1, 10)])
    steeper = _curve("int4", [1.0 + 0.3 * (n - 1) for n in range(1, 10)])
    monkeypatch.setattr(formats, "shipped_study",
                        lambda: formats.FormatCurves("Some CPU", "d", "c", [flat, steep, steeper]))
    facts = format_facts(0.45, 0.05, 3)
    assert (facts["formats_machine"], facts["k1"]) == ("Some CPU", "4")
    assert (facts["fp32_r"], facts["int8_r"], facts["int4_r"]) == ("1.00", "1.45", "1.90")   # r(4) on each curve
    assert int(facts["best_int4"]) <= int(facts["best_int8"]) < int(facts["best_fp32"])
    assert (facts["llamacpp_q4_r"], facts["llamacpp_q4_step"]) == ("—", "—")   # a study without llama.cpp's curves
    llama = _curve("llama.cpp Q4_1", [1.0 + 0.5 * (n - 1) for n in range(1, 10)])
    llama = formats.RCurve(llama.model, "cpu", llama.dtype, 128, llama.ns, llama.ms, llama.r, 6.5, 3)
    monkeypatch.setattr(formats, "shipped_study",
                        lambda: formats.FormatCurves("Some CPU", "d", "c", [flat, steep, steeper], [llama]))
    facts = format_facts(0.45, 0.05, 3)
    assert (facts["llamacpp_q4_r"], facts["llamacpp_q4_step"], facts["int4_step"]) == ("2.50", "6.5", "10.0")
    assert int(facts["best_llamacpp_q4"]) <= int(facts["best_int4"])
    monkeypatch.setattr(formats, "shipped_study", lambda: formats.FormatCurves("Some CPU", "d", "c", [flat, steep]))
    assert format_facts(0.45, 0.05, 3)["int4_r"] == "—"                    # an older study without int4
    monkeypatch.setattr(formats, "shipped_study", lambda: None)
    assert format_facts(0.45, 0.05, 3)["int8_r"] == "—"

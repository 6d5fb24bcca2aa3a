"""engine.compared: the baseline keeps pace with the speculative run, chat turns go through the
template, the KV budget a server reserves is what the run allocates, and traces carry the chat turn."""
from __future__ import annotations

from engine.compared import ComparedRun, kv_bytes_needed
from engine.config import SpecConfig
from engine.pair import ModelPair
from engine.prompts import ChatPrompt
from engine.trace import load_trace

PROMPT = "def f(x):\n    return x\n"


def test_the_baseline_keeps_pace_and_matches_greedily(builtin_pair):
    draft, target = builtin_pair
    run = ComparedRun(ModelPair(target, draft), PROMPT, SpecConfig(k=3, max_new_tokens=20))
    while not run.finished:
        run.step()
        assert len(run.baseline.generated) >= min(len(run.spec.generated), 20) or run.baseline.finished
    assert run.identical_to_baseline() is True
    spec, base = run.summaries()
    assert spec.tokens == base.tokens == len(run.spec.generated)
    run.close()


def test_a_baseline_left_behind_catches_up_with_the_same_tokens_and_trace(builtin_pair, tmp_path):
    """step(catch_up=False), as the app's Step runs it: the speculative run goes on alone, catch_up() (or the
    next step) brings the target-only run level, and the run ends as one that never fell behind: the same
    tokens, the baseline's every round in the trace, and both summaries after the last catch-up."""
    draft, target = builtin_pair
    pair, config = ModelPair(target, draft), SpecConfig(k=3, max_new_tokens=20)
    level = ComparedRun(pair, PROMPT, config, trace_path=tmp_path / "level.jsonl")
    level.run_to_end()
    later = ComparedRun(pair, PROMPT, config, trace_path=tmp_path / "later.jsonl")
    rounds = 0
    while not later.finished:
        before = len(later.baseline.generated)
        later.step(catch_up=False)
        rounds += 1
        assert len(later.baseline.generated) >= before    # the step first caught up what an earlier one left
        assert later.behind == (len(later.baseline.generated) < len(later.spec.generated))
        if rounds % 2 and not later.finished:             # every other round: left for the next step
            assert later.catch_up() > 0 or not later.behind
            assert not later.behind
    assert later.behind and later.writer is not None      # the last round's baseline, and the summaries, wait
    assert later.catch_up() > 0 and not later.behind and later.writer is None and later.catch_up() == 0
    assert later.spec.generated == level.spec.generated and later.baseline.generated == level.baseline.generated
    traces = [load_trace(tmp_path / name) for name in ("level.jsonl", "later.jsonl")]
    assert [r.emitted for r in traces[0].rounds] == [r.emitted for r in traces[1].rounds]
    assert [r.emitted for r in traces[0].baseline] == [r.emitted for r in traces[1].baseline]
    assert traces[1].complete and traces[1].baseline_summary.tokens == traces[0].baseline_summary.tokens
    level.close()
    later.close()


def test_kv_bytes_needed_is_what_the_run_allocates(builtin_pair):
    draft, target = builtin_pair
    pair = ModelPair(target, draft)
    for config in (SpecConfig(k=4, max_new_tokens=30), SpecConfig(mode="target", max_new_tokens=30),
                   SpecConfig(drafter="ngram", max_new_tokens=30)):
        run = ComparedRun(pair, PROMPT, config)
        pools = [run.spec.target_runner.pool.nbytes] + [c.cache.pool.nbytes for c in run.spec._draft_caches()]
        if run.baseline is not None:
            pools.append(run.baseline.target_runner.pool.nbytes)
        assert kv_bytes_needed(pair, len(run.spec.prompt), config) == sum(pools)
        run.close()


def test_a_chat_turn_is_templated_and_traced(builtin_pair, tmp_path):
    """The built-in tokenizer has no chat template, so a chat turn is refused with a clear message; the
    SmolLM2 tests run the real template."""
    import pytest

    from engine.prompts import PromptError

    draft, target = builtin_pair
    with pytest.raises(PromptError, match="no chat template"):
        ComparedRun(ModelPair(target, draft), ChatPrompt("hello"), SpecConfig())
    path = tmp_path / "t.jsonl"
    run = ComparedRun(ModelPair(target, draft), PROMPT, SpecConfig(max_new_tokens=4), trace_path=path)
    run.run_to_end()
    run.close()
    assert load_trace(path).header.chat is None

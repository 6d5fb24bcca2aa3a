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

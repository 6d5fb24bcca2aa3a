"""SpeculativeEngine: greedy parity, KV correctness, pool hygiene, reproducibility, K schedule, errors."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import DynamicCache

from engine.block_manager import KVPoolExhausted
from engine.config import K_BOUND, SpecConfig
from engine.drafters.hybrid import HybridDrafter
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.kv_cache import PagedCache
from engine.models import LoadedModel, ModelLoadError, load_model
from engine.pair import ModelPair
from engine.prompts import PromptError, encode_prompt
from engine.records import Outcome
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeEngine
from tests.conftest import hf_greedy, tiny_model

CODE = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "for i in range(10):\n    print(i, fibonacci(i))\n")
TINY_NEW = 24
BUILTIN_NEW = 32
KV_TOL = 1e-4


# ---------------------------------------------------------------------------- helpers

def decode(target: LoadedModel, draft: LoadedModel | None, prompt_ids: list[int], **config) -> list[int]:
    """Generated ids of a whole run; the engine is closed afterwards."""
    engine = SpeculativeEngine(ModelPair(target, draft), prompt_ids, SpecConfig(**config))
    try:
        engine.run()
        return engine.generated
    finally:
        engine.close()


def assert_cache_holds(loaded: LoadedModel, cache: PagedCache, tokens: list[int]) -> None:
    """The cache's K/V (gathered from the pool through its block table) equals a fresh prefill of `tokens`."""
    assert cache.table.length == len(tokens)
    ref = DynamicCache(config=loaded.model.config)
    with torch.inference_mode():
        loaded.model(torch.tensor([tokens], device=loaded.device), cache=ref, use_cache=True)
    slots = torch.tensor([cache.pool.manager.slot(cache.table, i) for i in range(len(tokens))], device=loaded.device)
    for layer in range(loaded.kv_shape.layers):
        for pool, mine in ((cache.pool.keys, ref.layers[layer].keys), (cache.pool.values, ref.layers[layer].values)):
            diff = (pool[layer][:, slots].float() - mine[0].float()).abs().max().item()
            assert diff < KV_TOL, f"layer {layer}: K/V differs from a fresh prefill by {diff}"


@pytest.fixture(scope="module")
def tiny_prompt(builtin_tokenizer) -> list[int]:
    return encode_prompt(builtin_tokenizer, CODE)


@pytest.fixture(scope="module")
def tiny_reference(tiny_pair, tiny_prompt) -> list[int]:
    """Greedy continuation of the tiny target by Hugging Face generate."""
    return hf_greedy(tiny_pair[1], tiny_prompt, TINY_NEW)


@pytest.fixture(scope="module")
def builtin_prompt(builtin_pair) -> list[int]:
    return encode_prompt(builtin_pair[1].tokenizer, CODE)


@pytest.fixture(scope="module")
def builtin_reference(builtin_pair, builtin_prompt) -> list[int]:
    """Greedy continuation of the built-in target: HF generate, checked against the engine's target-only mode."""
    reference = hf_greedy(builtin_pair[1], builtin_prompt, BUILTIN_NEW)
    assert decode(builtin_pair[1], None, builtin_prompt, mode="target", max_new_tokens=BUILTIN_NEW) == reference
    return reference


# ---------------------------------------------------------------------------- greedy parity

def test_target_only_matches_hf_generate(tiny_pair, tiny_prompt, tiny_reference) -> None:
    assert len(tiny_reference) == TINY_NEW
    assert decode(tiny_pair[1], None, tiny_prompt, mode="target", max_new_tokens=TINY_NEW) == tiny_reference


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_greedy_parity_tiny(tiny_pair, tiny_prompt, tiny_reference, mode: str, drafter: str, k: int) -> None:
    draft, target = tiny_pair
    out = decode(target, draft, tiny_prompt, mode=mode, drafter=drafter, k=k, max_new_tokens=TINY_NEW)
    assert out == tiny_reference


@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_greedy_parity_self_draft_accepts_everything(tiny_pair, tiny_prompt, tiny_reference, mode: str) -> None:
    """Drafting with the target itself: every draft is accepted and each round ends with a bonus."""
    target = tiny_pair[1]
    engine = SpeculativeEngine(ModelPair(target, target), tiny_prompt, SpecConfig(mode=mode, k=3, max_new_tokens=TINY_NEW))
    engine.run()
    engine.close()
    assert engine.generated == tiny_reference
    assert all(r.accepted == r.k and r.final.outcome is Outcome.BONUS for r in engine.rounds)
    assert len(engine.rounds) == 1 + -(-(TINY_NEW - 1) // 4)  # the prefill round's token, then K+1 a round


@pytest.mark.parametrize("mode, drafter, k", [("v2", "model", 1), ("v2", "model", 4), ("v1", "model", 2),
                                              ("v1", "model", 8), ("v2", "ngram", 4), ("v1", "ngram", 2),
                                              ("v2", "hybrid", 2), ("v1", "hybrid", 3)])
def test_greedy_parity_builtin(builtin_pair, builtin_prompt, builtin_reference, mode: str, drafter: str,
                               k: int) -> None:
    draft, target = builtin_pair
    out = decode(target, draft, builtin_prompt, mode=mode, drafter=drafter, k=k, max_new_tokens=BUILTIN_NEW)
    assert out == builtin_reference  # == target-only, checked by the fixture


# ---------------------------------------------------------------------------- KV correctness

@pytest.mark.parametrize("drafter", ["model", "hybrid"])
@pytest.mark.parametrize("self_draft", [False, True], ids=["random-draft", "self-draft"])
@pytest.mark.parametrize("mode", ["v2", "v1"])
def test_kv_equals_fresh_prefill_after_every_round(tiny_pair, tiny_prompt, mode: str, self_draft: bool,
                                                   drafter: str) -> None:
    draft, target = tiny_pair
    config = SpecConfig(mode=mode, drafter=drafter, k=4, max_new_tokens=16, block_size=4, record=False)
    engine = SpeculativeEngine(ModelPair(target, target if self_draft else draft), tiny_prompt, config)
    assert isinstance(engine.drafter, ModelDrafter if drafter == "model" else HybridDrafter)
    while not engine.finished:
        engine.step()
        # Invariant: the target cache holds every committed token but the last.
        assert engine.target_cache.tokens == engine.tokens[:-1]
        assert_cache_holds(target, engine.target_cache, engine.tokens[:-1])
        (held,) = engine.drafter.caches()
        dcache = held.cache
        assert held.name == "draft" and held.weight_bytes == engine.pair.draft.weight_bytes
        assert dcache.tokens == engine.tokens[: len(dcache.tokens)] and len(dcache.tokens) < len(engine.tokens)
        assert_cache_holds(engine.pair.draft, dcache, dcache.tokens)
    engine.close()


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
def test_block_pools_return_to_start_after_close(tiny_pair, tiny_prompt, drafter: str) -> None:
    draft, target = tiny_pair
    engine = SpeculativeEngine(ModelPair(target, draft), tiny_prompt, SpecConfig(drafter=drafter, max_new_tokens=12, block_size=4))
    pools = [engine.target_runner.pool] + [c.cache.pool for c in engine.drafter.caches()]
    assert len(pools) == (1 if drafter == "ngram" else 2)
    start = [p.manager.free_blocks for p in pools]
    engine.run()
    assert engine.target_runner.pool.manager.free_blocks < start[0]
    engine.close()
    for pool, free in zip(pools, start):
        assert pool.manager.free_blocks == free == pool.num_blocks
        pool.manager.check()


# ---------------------------------------------------------------------------- sampling reproducibility

SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
def test_sampled_runs_reproduce_with_seed(tiny_pair, tiny_prompt, drafter: str) -> None:
    draft, target = tiny_pair
    run = lambda mode, seed: decode(target, draft, tiny_prompt, mode=mode, drafter=drafter, sampling=SAMPLED,
                                    seed=seed, max_new_tokens=12, record=False)
    first = run("v2", 1)
    assert run("v2", 1) == first
    assert run("v1", 1) == first          # v1 and v2 consume the same draws in the same order
    assert run("v2", 2) != first


# ---------------------------------------------------------------------------- K schedule

@pytest.mark.parametrize("self_draft", [True, False], ids=["all-accepted", "random-draft"])
def test_heuristic_k_schedule(tiny_pair, tiny_prompt, self_draft: bool) -> None:
    draft, target = tiny_pair
    config = SpecConfig(k=2, k_schedule="heuristic", k_min=1, k_max=6, max_new_tokens=40, record=False)
    engine = SpeculativeEngine(ModelPair(target, target if self_draft else draft), tiny_prompt, config)
    rounds = engine.run()
    engine.close()
    assert rounds[0].k == 0 and len(rounds[0].emitted) == 1  # the prefill round
    k, made = 2, 1
    for r in rounds[1:]:
        assert r.k == min(k, config.max_new_tokens - made - 1)   # the last rounds are cut by max_new_tokens
        k = min(6, k + 2) if r.accepted == r.k else max(1, k - 1)
        made = r.tokens_total
    ks = [r.k for r in rounds]
    if self_draft:
        assert ks[:5] == [0, 2, 4, 6, 6]
    else:
        assert ks.count(1) > 0 and any(r.accepted < r.k for r in rounds)  # fell back to the lower bound


# ---------------------------------------------------------------------------- hybrid drafter

def scan(tokens: list[int], ngram_max: int, min_n: int, k: int) -> tuple[int, list[int]]:
    """Prompt lookup by brute force: the longest suffix (ngram_max..min_n) with an earlier occurrence,
    and up to k tokens after its latest one."""
    for n in range(min(ngram_max, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return n, tokens[start + n:start + n + k]
    return 0, []


def test_prompt_lookup_finds_what_a_scan_would_copy() -> None:
    """The n-gram drafter's index (read once per token as the run grows) against a brute-force scan,
    on every prefix of repetitive random sequences: `match` for the context itself, `follower` for a
    context that runs past the indexed tokens (a tree node's path)."""
    g = torch.Generator().manual_seed(5)
    for trial in range(20):
        seq = torch.randint(0, 6, (80,), generator=g).tolist()
        lookup = NgramDrafter(4, 1, 10, torch.device("cpu"))
        lookup.prefill(seq[:2])
        for end in range(2, len(seq)):
            lookup.index(seq[:end])
            for min_n in (1, 2, 3):
                n, copied = scan(seq[:end], 4, min_n, 5)
                assert lookup.follower(seq[max(0, end - 4):end], min_n) == (copied[0] if n else None)
            assert lookup.match(seq[:end], 5) == scan(seq[:end], 4, 1, 5), (trial, end)
            x = seq[end]   # a node's path off the committed text: 7 never occurs, so only [x] can match
            earlier = [j for j in range(end - 1) if seq[j] == x]
            assert lookup.follower([*seq[max(0, end - 2):end], 7, x], 1) == (seq[earlier[-1] + 1] if earlier else None)
            assert lookup.follower([*seq[max(0, end - 2):end], 7, x], 2) is None
        assert lookup.match(seq[5:40], 3) == scan(seq[5:40], 4, 1, 3)   # another sequence: indexed afresh


def test_hybrid_copies_repeats_and_drafts_the_rest(builtin_pair, builtin_tokenizer) -> None:
    """Each hybrid round either copies (no draft forward, up to 2K tokens, after a repeated
    n-gram of at least hybrid_min_n tokens) or runs the draft model for exactly K tokens."""
    draft, target = builtin_pair
    prompt = builtin_tokenizer("class Stack:\n    def __init__(self):\n        self.items = []\n")["input_ids"]
    config = SpecConfig(drafter="hybrid", k=3, max_new_tokens=60, stop_at_eos=False, record=False, hybrid_min_n=2)
    engine = SpeculativeEngine(ModelPair(target, draft), prompt, config)
    lookup = NgramDrafter(config.ngram_max, config.ngram_min, target.vocab_size, target.device)
    sources = []
    while not engine.finished:
        before = list(engine.tokens)
        r = engine.step()
        if r.index == 0:
            continue
        n, copied = lookup.match(before, 6)
        remaining = config.max_new_tokens - (len(before) - len(prompt))
        if n >= 2 and copied:
            sources.append("copy")
            assert r.draft_forwards == 0 and [p.token for p in r.positions] == copied[: len(r.positions)]
            assert r.k == min(len(copied), remaining - 1)
        else:
            sources.append("model")
            assert r.draft_forwards == r.k == min(3, remaining - 1)
    engine.close()
    assert "copy" in sources and "model" in sources, sources
    assert engine.generated == decode(target, None, prompt, mode="target", max_new_tokens=60, stop_at_eos=False)


def test_hybrid_min_n_is_validated() -> None:
    with pytest.raises(ValueError, match="hybrid_min_n"):
        SpecConfig(drafter="hybrid", hybrid_min_n=5, ngram_max=4)


# ---------------------------------------------------------------------------- mixed pairs

def test_draft_with_fewer_vocabulary_rows(builtin_tokenizer, tiny_pair, tiny_prompt) -> None:
    target = tiny_pair[1]
    draft = tiny_model(builtin_tokenizer, layers=1, seed=5, vocab=4000)
    # An id the draft has no embedding for, in the prompt and hence in the draft's prefill.
    prompt = tiny_prompt[:3] + [4050] + tiny_prompt[3:]
    expected = hf_greedy(target, prompt, 16)
    engine = SpeculativeEngine(ModelPair(target, draft), prompt, SpecConfig(k=4, max_new_tokens=16))
    engine.run()
    engine.close()
    assert engine.generated == expected
    assert all(t < 4000 for r in engine.rounds for t in (p.token for p in r.positions))


def test_bf16_draft_with_fp32_target(builtin_tokenizer, tiny_pair, tiny_prompt, tiny_reference) -> None:
    draft = tiny_model(builtin_tokenizer, layers=1, seed=1, dtype=torch.bfloat16)
    for mode in ("v2", "v1"):
        assert decode(tiny_pair[1], draft, tiny_prompt, mode=mode, k=4, max_new_tokens=12) == tiny_reference[:12]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_draft_and_target_on_separate_devices(builtin_tokenizer, tiny_prompt) -> None:
    def on(device: str, layers: int, seed: int) -> LoadedModel:
        m = tiny_model(builtin_tokenizer, layers=layers, seed=seed)
        m.model.to(device)
        return dataclasses.replace(m, device=torch.device(device))

    draft, target = on("cuda:0", 1, 1), on("cuda:1", 2, 0)
    expected = decode(target, None, tiny_prompt, mode="target", max_new_tokens=TINY_NEW)
    for mode in ("v2", "v1"):
        assert decode(target, draft, tiny_prompt, mode=mode, k=4, max_new_tokens=TINY_NEW) == expected


# ---------------------------------------------------------------------------- clear errors

@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_empty_prompt_text(builtin_tokenizer, text: str) -> None:
    with pytest.raises(PromptError, match="empty"):
        encode_prompt(builtin_tokenizer, text)


def test_an_engine_refuses_an_empty_prompt(tiny_pair) -> None:
    with pytest.raises(PromptError, match="empty"):
        SpeculativeEngine(ModelPair(tiny_pair[1], tiny_pair[0]), [], SpecConfig())


def test_prompt_longer_than_context(builtin_tokenizer, tiny_pair) -> None:
    short = tiny_model(builtin_tokenizer, layers=1, seed=0, max_positions=32)
    with pytest.raises(PromptError, match=r"30 tokens .* exceed the target's context of 32"):
        SpeculativeEngine(ModelPair(short, tiny_pair[0]), list(range(1, 31)), SpecConfig(max_new_tokens=8))


@pytest.mark.parametrize("k", [0, -1, K_BOUND + 1])
def test_k_out_of_bounds(k: int) -> None:
    with pytest.raises(ValueError, match=f"K must be an integer between 1 and {K_BOUND}"):
        SpecConfig(k=k)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "Temperature must be finite and >= 0"),
    ({"temperature": float("nan")}, "Temperature must be finite"),
    ({"top_p": 0.0}, r"Top-p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"Top-p must be in \(0, 1\]"),
    ({"top_k": -1}, "Top-k must be >= 0"),
])
def test_bad_sampling_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("source", ["specplay-tests/no-such-model", "/no/such/model/dir"])
def test_unknown_model_fails_fast_offline(monkeypatch, source: str) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once at import
    with pytest.raises(ModelLoadError, match=f"Could not load target model '{source}'"):
        load_model(source, "target")


def other_tokenizer():
    """A byte-level BPE trained on a few lines: a real tokenizer that is not the built-in one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CODE, "return the values in reverse order\n"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_mismatched_tokenizers_name_both_models(tiny_pair, tiny_prompt) -> None:
    draft, target = tiny_pair
    stranger = dataclasses.replace(draft, name="stranger-draft", tokenizer=other_tokenizer())
    with pytest.raises(ModelLoadError, match=r"do not match: draft 'stranger-draft' .* target 'tiny-2x64-seed0'"):
        ModelPair(target, stranger)
    fresh = dataclasses.replace(draft, tokenizer=copy.deepcopy(draft.tokenizer))   # another object, same ids
    assert fresh.tokenizer is not target.tokenizer and ModelPair(target, fresh).draft is fresh   # it passes


def test_exhausted_kv_pool(tiny_pair, tiny_prompt) -> None:
    assert len(tiny_prompt) > 17
    engine = SpeculativeEngine(ModelPair(tiny_pair[1], tiny_pair[0]), tiny_prompt, SpecConfig(block_size=16), kv_blocks=1)
    with pytest.raises(KVPoolExhausted, match="only 1 of 1 blocks"):
        engine.step()

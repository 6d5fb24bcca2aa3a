"""The fused forward computes what the transformers forward computes, over the same paged cache."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import Mode, SpecConfig
from engine.fused_llama import BLOCKED_MIN_ROWS, FusedLlama, blocked_min_rows, one_copy_reason
from engine.models import LoadedModel
from engine.pair import ModelPair
from engine.runner import ModelRunner
from engine.speculative import SpeculativeEngine

TOL = 1e-5
VOCAB = 512


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A small random model of one Llama family member: GQA, and Qwen2's Q/K/V biases."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    extra = {"mistral": {"sliding_window": None}}.get(family, {})
    model = model_cls(config_cls(**{**common, **extra, **overrides})).eval()
    if family == "qwen2":  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def close(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal to float rounding, relative to the logits' scale (the blocked matrices sum in another order)."""
    return bool((x - y).abs().max() < TOL * max(1.0, float(y.abs().max())))


def loaded(model: torch.nn.Module) -> LoadedModel:
    return LoadedModel.of("test", model, SimpleNamespace(eos_token_id=0), max_context=256)


def script(runner: ModelRunner, cache, gen: torch.Generator) -> list[torch.Tensor]:
    """Prefill, decodes, a K+1 verify, rollbacks, a read-only forward and last-only logits."""
    out = []
    ids = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    out.append(runner.forward(cache, ids(21)))
    out.append(runner.forward(cache, ids(1)))
    out.append(runner.forward(cache, ids(5)))
    cache.rollback(3)
    out.append(runner.forward(cache, ids(1)))
    with cache.read_only():
        out.append(runner.forward(cache, ids(4)))
    out.append(runner.forward(cache, ids(9), last_only=True))
    cache.rollback(7)
    out.append(runner.forward(cache, ids(2)))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_logits_match_the_transformers_forward(family: str) -> None:
    model = loaded(build(family))
    fused = ModelRunner(model, 64, block_size=4, fused=True)
    plain = ModelRunner(model, 64, block_size=4, fused=False)
    assert (fused.forward_path, plain.forward_path) == ("fused", "transformers")
    a = script(fused, fused.new_sequence(), torch.Generator().manual_seed(1))
    b = script(plain, plain.new_sequence(), torch.Generator().manual_seed(1))
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, i
        assert close(x, y), (family, i, (x - y).abs().max())


def test_builtin_pair_logits_are_the_transformers_logits(builtin_pair) -> None:
    for model in builtin_pair:
        fused = ModelRunner(model, 64, fused=True)
        plain = ModelRunner(model, 64, fused=False)
        a = script(fused, fused.new_sequence(), torch.Generator().manual_seed(2))
        b = script(plain, plain.new_sequence(), torch.Generator().manual_seed(2))
        for x, y in zip(a, b):
            assert close(x, y), (x - y).abs().max()


def test_fusing_keeps_the_model_and_costs_no_memory() -> None:
    model = build("qwen2", seed=4)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = model(ids).logits
    params = sum(p.numel() for p in model.parameters())
    fast = FusedLlama(model)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == fast.layers[0].qkv[fast.layers[0].q_size:].data_ptr()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)
    assert sum(p.numel() for p in model.parameters()) == params


def test_blocked_matrices_multiply_as_the_dense_ones(monkeypatch) -> None:
    monkeypatch.setattr("engine.fused_llama.BLOCKED_MIN_ELEMENTS", 0)   # copies of this small model's matrices too
    fast = loaded(build("qwen2", seed=5)).fused
    assert fast.blocked is not None and fast.blocked_reason is None
    layer, gen = fast.layers[0], torch.Generator().manual_seed(5)
    for rows in (1, 4, 9, 17):
        for weight, bias in ((layer.qkv, layer.qkv_bias), (layer.down, None), (fast.lm_head, None)):
            x = torch.randn(1, rows, weight.shape[1], generator=gen)
            dense = torch.nn.functional.linear(x, weight, bias)
            assert (fast.blocked.linear(x, weight, bias) - dense).abs().max() < 1e-5 * dense.abs().max()
    stranger = torch.randn(8, 64)  # a matrix the model does not own is multiplied as it is
    assert torch.equal(fast.blocked.linear(torch.ones(1, 64), stranger), torch.ones(1, 64) @ stranger.T)


def test_the_cpu_decides_from_how_many_rows_the_blocked_matrices_serve(monkeypatch) -> None:
    monkeypatch.delenv("SPECPLAY_BLOCKED_MIN_ROWS", raising=False)
    assert blocked_min_rows("AuthenticAMD") == 1 and blocked_min_rows("GenuineIntel") == BLOCKED_MIN_ROWS == 4
    assert blocked_min_rows("") == 4
    monkeypatch.setenv("SPECPLAY_BLOCKED_MIN_ROWS", "2")
    assert blocked_min_rows("AuthenticAMD") == blocked_min_rows("GenuineIntel") == 2
    assert FusedLlama(build("llama", seed=7)).blocked_rows == 2
    monkeypatch.setenv("SPECPLAY_BLOCKED_MIN_ROWS", "zero")   # not a whole number >= 1: the CPU decides
    assert blocked_min_rows("AuthenticAMD") == 1


def test_forwards_of_four_rows_or_more_use_the_blocked_matrices(monkeypatch) -> None:
    monkeypatch.setattr("engine.fused_llama.BLOCKED_MIN_ELEMENTS", 0)
    model = loaded(build("llama", seed=7))
    model.fused.blocked_rows = 4   # as on an Intel CPU
    native, model.fused.native = model.fused.native, None     # the Python loop, whose every product shows here
    calls = []
    real = model.fused.blocked.linear
    monkeypatch.setattr(model.fused.blocked, "linear", lambda *a: calls.append(a[0].shape[-2]) or real(*a))
    runner = ModelRunner(model, 64, block_size=4)
    cache = runner.new_sequence()
    runner.forward(cache, [1, 2, 3])
    runner.forward(cache, [4])
    assert calls == []
    runner.forward(cache, [5, 6, 7, 8])
    assert calls and set(calls) == {4}
    calls.clear()
    runner.forward(cache, [9, 10, 11, 12, 13], last_only=True)   # the head reads one row: the dense matrix
    assert len(calls) == 4 * 2 and set(calls) == {5}
    if native is not None:          # the C++ loop (engine.native) is handed the same choice
        told = []
        model.fused.native = type("Spy", (), {"run": lambda self, *a: told.append((a[1].shape[1], a[5])) or
                                              native.run(*a)})()
        runner.forward(cache, [14])
        runner.forward(cache, [15, 16, 17, 18])
        assert told == [(1, False), (4, True)]


def test_blocked_copies_are_made_only_where_they_pay(monkeypatch) -> None:
    double = FusedLlama(build("llama", seed=8).to(torch.float64))
    assert double.blocked is None and "fp32" in double.blocked_reason
    assert FusedLlama(build("llama", seed=8), blocked=False).blocked_reason == "turned off"
    monkeypatch.setattr("engine.fused_llama.BLOCKED_LIMIT_BYTES", 1 << 10)
    big = FusedLlama(build("llama", seed=8))
    assert big.blocked is None and "MiB limit" in big.blocked_reason


def test_a_small_model_keeps_one_copy_where_the_row_rule_would_switch_between_two(monkeypatch) -> None:
    monkeypatch.delenv("SPECPLAY_BLOCKED_MIN_ROWS", raising=False)
    monkeypatch.setattr("engine.fused_llama.BLOCKED_MIN_ELEMENTS", 0)
    monkeypatch.setattr("engine.fused_llama.ONE_COPY_BELOW_BYTES", 128 << 20)
    assert "keeps one copy" in one_copy_reason(54 << 20, 4)
    assert one_copy_reason(540 << 20, 4) is None      # SmolLM2's size: both copies
    assert one_copy_reason(54 << 20, 1) is None       # the blocked copy serves every forward: one copy anyway
    monkeypatch.setattr("engine.fused_llama.blocked_min_rows", lambda: 4)   # as on an Intel CPU
    small = FusedLlama(build("llama", seed=9))
    assert small.blocked is None and "keeps one copy" in small.blocked_reason
    monkeypatch.setattr("engine.fused_llama.blocked_min_rows", lambda: 1)   # as on an AMD CPU
    assert FusedLlama(build("llama", seed=9)).blocked is not None
    monkeypatch.setattr("engine.fused_llama.blocked_min_rows", lambda: 4)
    monkeypatch.setenv("SPECPLAY_BLOCKED_MIN_ROWS", "4")     # asked for: both copies, to measure them
    assert FusedLlama(build("llama", seed=9)).blocked is not None


def test_the_fused_forward_is_built_when_the_model_is_loaded_in_its_dtype() -> None:
    model = build("llama", seed=6).to(torch.float64)
    wrapped = loaded(model)
    assert wrapped.dtype == torch.float64 and wrapped.fused is not None
    assert wrapped.fused.layers[0].qkv.dtype == torch.float64
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == wrapped.fused.layers[0].qkv.data_ptr()
    runner = ModelRunner(wrapped, 64, block_size=4)
    plain = ModelRunner(wrapped, 64, block_size=4, fused=False)
    a = script(runner, runner.new_sequence(), torch.Generator().manual_seed(3))
    b = script(plain, plain.new_sequence(), torch.Generator().manual_seed(3))
    assert all((x - y).abs().max() < 1e-10 for x, y in zip(a, b))
    unfused = LoadedModel.of("training", build("llama", seed=6), SimpleNamespace(eos_token_id=0), fuse=False)
    assert unfused.fused is None and ModelRunner(unfused, 16).forward_path == "transformers"


@pytest.mark.parametrize("fused", [True, False])
def test_features_are_the_post_norm_hidden_states_the_head_reads(fused: bool) -> None:
    model = loaded(build("qwen2", seed=7))
    runner = ModelRunner(model, 64, block_size=4, fused=fused)
    cache = runner.new_sequence()
    ids = torch.randint(1, VOCAB, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    logits_a, feats_a = runner.forward_features(cache, ids[:9])
    logits_b, feats_b = runner.forward_features(cache, ids[9:])
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]
        assert torch.allclose(torch.cat([feats_a, feats_b]), hidden, atol=TOL)
        assert torch.allclose(torch.cat([logits_a, logits_b]), model.model.lm_head(hidden).float(), atol=TOL)


def test_unsupported_models_say_why_and_run_the_transformers_forward(builtin_tokenizer) -> None:
    import transformers

    sliding = build("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding" in FusedLlama.unsupported(sliding)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=4096, n_embd=64, n_layer=2, n_head=4, n_positions=256,
        eos_token_id=builtin_tokenizer.eos_token_id)).eval()
    assert "gpt2" in FusedLlama.unsupported(gpt2)
    assert loaded(gpt2).fused is None
    with pytest.raises(ValueError, match="does not support"):
        FusedLlama(gpt2)
    # The engine still decodes it, through the transformers forward, token for token like generate.
    target = LoadedModel.of("gpt2", gpt2, builtin_tokenizer, max_context=256)
    prompt = builtin_tokenizer("import os\ndef main():")["input_ids"]
    engine = SpeculativeEngine(ModelPair(target, None), prompt, SpecConfig(mode=Mode.TARGET, max_new_tokens=12,
                                                               stop_at_eos=False, record=False))
    assert engine.target_runner.forward_path == "transformers"
    engine.run()
    with torch.inference_mode():
        ref = gpt2.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                            pad_token_id=0)[0, len(prompt):].tolist()
    assert engine.generated == ref


def test_greedy_runs_are_identical_on_both_forwards(builtin_pair, builtin_tokenizer) -> None:
    draft, target = builtin_pair
    prompt = builtin_tokenizer("import numpy as np\n\n\ndef load(path):\n")["input_ids"]
    runs = {}
    for fused in (True, False):
        for mode in (Mode.V2, Mode.TARGET):
            engine = SpeculativeEngine(ModelPair(target, draft), prompt, SpecConfig(
                mode=mode, k=4, max_new_tokens=40, stop_at_eos=False, record=False, fused_forward=fused))
            engine.run()
            runs[fused, mode] = engine.generated
    assert len(set(map(tuple, runs.values()))) == 1


def test_small_matrices_multiply_as_they_are_and_large_ones_get_a_copy(monkeypatch) -> None:
    """A blocked product costs more than torch's default one for a small matrix (BLOCKED_MIN_ELEMENTS)."""
    monkeypatch.delenv("SPECPLAY_BLOCKED_MIN_ROWS", raising=False)
    monkeypatch.setattr("engine.fused_llama.blocked_min_rows", lambda: 1)    # the blocked copy serves every row count
    fast = FusedLlama(build("llama", seed=10, vocab_size=4096))   # the head 4096 x 64 (2^18), the layers under 2^13
    assert fast.blocked is not None and fast.blocked.bytes == fast.lm_head.numel() * 4   # the head's copy alone
    layer, gen = fast.layers[0], torch.Generator().manual_seed(10)
    for weight in (layer.qkv, layer.o, layer.gate_up, layer.down):
        rows = torch.randn(1, 3, weight.shape[1], generator=gen)
        assert torch.equal(fast.blocked.linear(rows, weight), torch.nn.functional.linear(rows, weight))
    x = torch.randn(1, 3, 64, generator=gen)
    dense = torch.nn.functional.linear(x, fast.lm_head)
    assert (fast.blocked.linear(x, fast.lm_head) - dense).abs().max() < 1e-5 * dense.abs().max()
    small = FusedLlama(build("llama", seed=10))                    # every matrix under 2^17 elements: no copy
    assert small.blocked is None and "every matrix is under 131,072 elements" in small.blocked_reason

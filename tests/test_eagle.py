"""The EAGLE-style drafter: a pruned q that is exactly 0 outside the kept set, greedy parity with the target
at several K, the head's cache and features equal to a fresh recomputation after every round, and
heads that refuse a target they were not trained for."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import DrafterKind, Mode, SpecConfig
from engine.drafters.eagle import EagleConfig, EagleHead, EagleLoadError, EagleRuntime, load_runtime, save_head
from engine.fused_llama import bf16_products
from engine.models import LoadedModel
from engine.pair import ModelPair
from engine.prompts import encode_prompt
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeEngine
from tests.conftest import hf_greedy, tiny_model

CODE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


@torch.no_grad()
def start_from_last_layer(head: EagleHead, target: torch.nn.Module) -> None:
    """The target's last decoder layer and final norm, with fc passing the feature through: the untrained
    head computes the target's last layer over the current feature."""
    last = target.model.layers[-1]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(head, name).weight.copy_(getattr(last.self_attn, name).weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(head, name).weight.copy_(getattr(last.mlp, name).weight)
    head.norm_in.copy_(last.input_layernorm.weight)
    head.norm_post.copy_(last.post_attention_layernorm.weight)
    head.norm_out.copy_(target.model.norm.weight)
    d = head.config.hidden
    head.fc.weight.zero_()
    head.fc.weight[:, d:].copy_(torch.eye(d))
    head.fc.bias.zero_()


def random_head(target: LoadedModel, kept: int, seed: int = 0, trained_like: bool = True,
                own_head: bool = False) -> EagleRuntime:
    """A head initialised from the target's last layer, with `kept` random token ids kept (always the EOS);
    `own_head`: an LM head of its own, starting from the target's kept rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target.vocab_size, generator=g)[:kept]
    ids = torch.unique(torch.cat([ids, torch.tensor([target.tokenizer.eos_token_id])]))
    head = EagleHead(replace(EagleConfig.for_target(target, len(ids)), own_head=own_head))
    start_from_last_layer(head, target.model)
    if own_head:
        with torch.no_grad():
            head.lm.copy_(target.model.lm_head.weight[ids])
    if trained_like:  # perturb it so that its drafts are neither always right nor always wrong
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return EagleRuntime(head, ids, target)


@pytest.fixture(scope="module")
def builtin_eagle(builtin_pair) -> ModelPair:
    """The built-in target's head as `python -m engine train-draft --target builtin` shipped it: a real
    trained head, so some of its drafts are accepted and some rejected."""
    from engine.drafters.eagle import load_eagle

    _, target = builtin_pair
    return ModelPair(target, None, load_eagle("builtin", target))


@pytest.fixture(scope="module")
def random_builtin_eagle(builtin_pair) -> ModelPair:
    """An untrained head, initialised from the target's last layer and perturbed: mostly rejected."""
    _, target = builtin_pair
    return ModelPair(target, None, random_head(target, 3000, seed=1))


def run(pair: ModelPair, prompt: list[int], **config) -> SpeculativeEngine:
    engine = SpeculativeEngine(pair, prompt, SpecConfig(**config))
    engine.run()
    engine.close()
    return engine


@pytest.mark.parametrize("own_head", [False, True], ids=["target-lm-head", "own-lm-head"])
def test_q_rows_sum_to_one_and_are_exactly_zero_outside_the_kept_set_and_the_context(builtin_pair, own_head):
    """q covers the kept tokens and, for a head reading the target's LM head, the context's tokens outside them,
    each scored by its own row of that LM head; nothing else. A head with its own LM head covers its kept set."""
    _, target = builtin_pair
    runtime = random_head(target, 1500, seed=2, own_head=own_head)
    pair = ModelPair(target, None, runtime)
    prompt = encode_prompt(target.tokenizer, CODE)
    kept = set(runtime.kept_ids.tolist())
    assert set(prompt) - kept                          # the test needs context tokens the head did not keep
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
        engine = SpeculativeEngine(pair, prompt, SpecConfig(drafter=DrafterKind.EAGLE, k=4, sampling=sampling,
                                                            max_new_tokens=6, stop_at_eos=False))
        engine.step()
        engine.step()
        drafter = engine.drafter
        covered = kept if own_head else kept | set(engine.tokens)
        assert set(drafter.vocabulary.ids.tolist()) == covered and len(drafter.vocabulary.ids) == len(covered)
        outside = torch.tensor([t for t in range(target.vocab_size) if t not in covered])
        proposal = drafter.propose(engine.tokens, 4)
        assert torch.allclose(proposal.q_draft.sum(-1), torch.ones(4), atol=1e-5)
        assert float(proposal.q_draft[:, outside].abs().max()) == 0.0
        assert all(t in covered for t in proposal.tokens)
        assert proposal.source is DrafterKind.EAGLE and proposal.forwards == 4
        if not sampling.greedy and not own_head:   # an extra token's q: its LM-head row's logit, softmaxed with the rest
            extra = sorted(covered - kept)
            assert extra and float(proposal.q_draft[:, extra].min()) > 0.0
            with torch.inference_mode():
                scratch = drafter.pool.new_sequence()
                feats = drafter.runtime.forward(scratch, [engine.tokens[-1]], drafter.features[-1:])
                scratch.free()
                got = drafter.vocabulary.logits(feats)[0]
                want = (feats @ target.fused.lm_head[extra].T)[0].float()
            columns = {t: i for i, t in enumerate(drafter.vocabulary.ids.tolist())}
            assert torch.allclose(got[[columns[t] for t in extra]], want, atol=1e-4)
        engine.close()


@pytest.mark.parametrize("head", ["random", "shipped"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_parity_with_generate_on_the_builtin_target(request, builtin_pair, k, head):
    _, target = builtin_pair
    builtin_eagle = request.getfixturevalue("random_builtin_eagle" if head == "random" else "builtin_eagle")
    prompt = encode_prompt(target.tokenizer, CODE)
    expected = hf_greedy(target, prompt, 40)
    for mode in (Mode.V2, Mode.V1):
        engine = run(builtin_eagle, prompt, drafter=DrafterKind.EAGLE, mode=mode, k=k, max_new_tokens=40)
        assert engine.generated == expected, (mode, k)
    hybrid = run(builtin_eagle, prompt, drafter=DrafterKind.EAGLE_HYBRID, k=k, max_new_tokens=40)
    assert hybrid.generated == expected
    drafted = [r for r in engine.rounds if r.k]
    assert drafted and all(r.proposer is DrafterKind.EAGLE for r in drafted)
    if head == "shipped":   # a real head: whole chains accepted, and rejections too
        assert any(r.accepted == r.k for r in drafted) and any(r.accepted < r.k for r in drafted)


def fresh_features(target: LoadedModel, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(target, len(tokens) + 1)
    cache = runner.new_sequence()
    _, feats = runner.forward_features(cache, tokens)
    cache.free()
    return feats


@pytest.mark.parametrize("drafter", [DrafterKind.EAGLE, DrafterKind.EAGLE_HYBRID])
@pytest.mark.parametrize("mode", [Mode.V2, Mode.V1])
def test_head_state_equals_a_fresh_recomputation_after_every_round(builtin_eagle, builtin_pair, drafter, mode):
    """After each round: the drafter's real features are the target's features of committed[:-1], and its
    cache holds, for each cached position t, exactly the K/V a fresh head forward over (x_t, f_{t-1}) writes."""
    _, target = builtin_pair
    prompt = encode_prompt(target.tokenizer, CODE * 2)
    engine = SpeculativeEngine(builtin_eagle, prompt, SpecConfig(drafter=drafter, mode=mode, k=4, max_new_tokens=40,
                                                                 stop_at_eos=False, block_size=4))
    runtime = builtin_eagle.eagle
    while not engine.finished:
        engine.step()
        head = engine.drafter.model if drafter is DrafterKind.EAGLE_HYBRID else engine.drafter
        committed = engine.tokens
        real = fresh_features(target, committed[:-1])
        assert head.features.shape == real.shape
        assert torch.allclose(head.features, real, atol=1e-4)
        cached = head.cache.table.length
        assert cached <= len(committed) - 1
        if cached:
            pool = runtime.config.kv_shape
            check = EagleRunCache(pool, cached)
            runtime.forward(check.cache, committed[1:cached + 1], real[:cached])
            mine = head.cache.physical_slots()
            theirs = check.cache.physical_slots()
            for tensors, ref in ((head.pool.keys, check.pool.keys), (head.pool.values, check.pool.values)):
                assert torch.allclose(tensors[0][:, mine], ref[0][:, theirs], atol=1e-4)
            check.cache.free()
    engine.close()
    # the paths that matter were taken: drafts accepted (their predicted positions rolled back and
    # refed with real features) and rejected
    assert any(r.accepted for r in engine.rounds if r.k) and any(r.accepted < r.k for r in engine.rounds if r.k)
    assert head.pool.manager.free_blocks == head.pool.num_blocks


class EagleRunCache:
    """A fresh paged cache of the head's shape, for recomputation."""

    def __init__(self, shape, tokens: int) -> None:
        from engine.kv_cache import KVPool

        self.pool = KVPool(shape, -(-tokens // 16) + 1, 16, "cpu", torch.float32)
        self.cache = self.pool.new_sequence()


def test_save_and_load_round_trip_and_refuse_another_target(builtin_pair, builtin_tokenizer, tmp_path):
    _, target = builtin_pair
    runtime = random_head(target, 500, seed=3, trained_like=False)
    save_head(runtime.head, runtime.kept_ids, tmp_path / "head", {"note": "test"})
    loaded = load_runtime(tmp_path / "head", target)
    assert torch.equal(loaded.kept_ids, runtime.kept_ids) and loaded.config == runtime.config
    for a, b in zip(loaded.head.parameters(), runtime.head.parameters()):
        assert torch.allclose(a, b.half().float())   # stored in fp16
    other = tiny_model(builtin_tokenizer, layers=2, seed=0)   # hidden 64, not the built-in target's 384
    with pytest.raises(EagleLoadError, match="trained for"):
        load_runtime(tmp_path / "head", other)
    with pytest.raises(EagleLoadError, match="No usable EAGLE head"):
        load_runtime(tmp_path / "missing", target)
    with pytest.raises(ValueError, match="needs an EAGLE head"):
        SpeculativeEngine(ModelPair(target), [1, 2, 3], SpecConfig(drafter=DrafterKind.EAGLE))


@pytest.mark.skipif(not bf16_products(), reason="this CPU has no bf16 products in oneDNN (AVX2 only)")
def test_a_head_drafting_with_bf16_copies_proposes_nearly_the_same_and_emits_exactly_the_same(builtin_pair):
    """The head's bf16 copies (the default where the CPU multiplies bf16 natively) round its products, not
    its verification: greedy output equals the fp32 head's and generate's token for token; the rounding is
    really there (its predicted features differ from fp32's), stays at bf16's scale (a relative error under
    2%), and moves acceptance by little."""
    from engine.drafters.eagle import draft_in_bf16, read_head
    from engine.sources import eagle_folder

    _, target = builtin_pair
    runs = {}
    for bf16 in (False, True):
        head, kept = read_head(eagle_folder("builtin"))
        runtime = EagleRuntime(head, kept, target, bf16=bf16)
        assert runtime._blocked is not None and runtime._blocked.bf16 is bf16
        prompt = encode_prompt(target.tokenizer, CODE)
        engine = SpeculativeEngine(ModelPair(target, None, runtime), prompt,
                                   SpecConfig(drafter=DrafterKind.EAGLE, k=4, max_new_tokens=40, stop_at_eos=False))
        rounds = engine.run()
        engine.close()
        feats = torch.randn(6, runtime.config.hidden, generator=torch.Generator().manual_seed(0))
        cache = EagleRunCache(runtime.config.kv_shape, 6)
        predicted = runtime.forward(cache.cache, prompt[1:7], feats)
        cache.cache.free()
        runs[bf16] = (engine.generated, sum(r.accepted for r in rounds if r.k) / sum(r.k for r in rounds if r.k),
                      predicted)
    (plain, alpha, exact), (rounded, alpha_bf16, approx) = runs[False], runs[True]
    assert plain == rounded == hf_greedy(target, encode_prompt(target.tokenizer, CODE), 40)
    assert not torch.equal(exact, approx)
    assert float((exact - approx).norm() / exact.norm()) < 0.02
    assert abs(alpha - alpha_bf16) < 0.1 and alpha > 0.3
    assert draft_in_bf16() is False      # the suite pins fp32 drafting (conftest) whatever the CPU

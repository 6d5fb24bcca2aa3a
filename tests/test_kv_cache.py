"""PagedCache: paged forwards give the same logits and K/V as uncached / DynamicCache forwards."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from engine.kv_cache import KVPool, PagedCache
from engine.models import LoadedModel
from engine.runner import ModelRunner
from tests.conftest import tiny_model

TOL = 1e-4


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    # No tokenizer is needed here: a stand-in carrying the eos id keeps these tests asset-free.
    return tiny_model(SimpleNamespace(eos_token_id=0), layers=2, seed=3, vocab=512)


@pytest.fixture(params=["fused", "transformers"])
def path(request) -> str:
    """Each paging test runs on both forwards: the engine's fused one and transformers' over the Cache API."""
    return request.param


def new_cache(model: LoadedModel, path: str, blocks: int = 16, block_size: int = 4) -> tuple[ModelRunner, PagedCache]:
    runner = ModelRunner(model, capacity=0, block_size=block_size, num_blocks=blocks, fused=path == "fused")
    assert runner.forward_path == path
    return runner, runner.new_sequence()


def reference_logits(model: LoadedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(torch.tensor([tokens]), use_cache=False).logits[0].float()


def reference_kv(model: LoadedModel, tokens: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.model.config)
    with torch.inference_mode():
        model.model(torch.tensor([tokens]), cache=cache, use_cache=True)
    return cache


def gathered_kv(cache: PagedCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's K/V [kv_heads, length, head_dim], read from the pool through its block table."""
    slots = torch.tensor([cache.pool.manager.slot(cache.table, i) for i in range(cache.table.length)])
    return cache.pool.keys[layer][:, slots], cache.pool.values[layer][:, slots]


def assert_kv_matches(model: LoadedModel, cache: PagedCache, tokens: list[int]) -> None:
    ref = reference_kv(model, tokens)
    for layer in range(model.kv_shape.layers):
        k, v = gathered_kv(cache, layer)
        assert (k - ref.layers[layer].keys[0]).abs().max() < TOL
        assert (v - ref.layers[layer].values[0]).abs().max() < TOL


def test_chunked_appends_with_rollbacks_match_uncached_forward(model: LoadedModel, path: str) -> None:
    runner, cache = new_cache(model, path)
    gen = torch.Generator().manual_seed(0)
    seq: list[int] = []
    # (tokens to append, tokens to roll back afterwards): chunks straddle block boundaries.
    for append, back in [(5, 0), (3, 2), (4, 0), (1, 1), (6, 3), (2, 0)]:
        chunk = torch.randint(1, 512, (append,), generator=gen).tolist()
        seq += chunk
        logits = runner.forward(cache, chunk)
        expected = reference_logits(model, seq)[-append:]
        assert (logits - expected).abs().max() < TOL
        cache.rollback(back)
        seq = seq[: len(seq) - back]
        assert cache.table.length == len(seq) and cache.tokens == seq
        cache.pool.manager.check()
    assert_kv_matches(model, cache, seq)


def test_sequences_sharing_a_pool_do_not_interfere(model: LoadedModel, path: str) -> None:
    runner, a = new_cache(model, path)
    b = runner.new_sequence()
    seq_a, seq_b = [5, 6, 7], [9, 8, 7, 6, 5]
    runner.forward(a, seq_a)
    runner.forward(b, seq_b)
    runner.forward(a, [11, 12, 13, 14])   # a's new blocks come after b's: its slots interleave
    seq_a += [11, 12, 13, 14]
    assert_kv_matches(model, a, seq_a)
    assert_kv_matches(model, b, seq_b)


def test_read_only_forward_writes_nothing(model: LoadedModel, path: str) -> None:
    runner, cache = new_cache(model, path)
    runner.forward(cache, [3, 1, 4, 1, 5])
    keys = [k.clone() for k in cache.pool.keys]
    values = [v.clone() for v in cache.pool.values]
    length, tokens, free = cache.table.length, list(cache.tokens), cache.pool.manager.free_blocks
    with cache.read_only():
        logits = runner.forward(cache, [9, 2, 6])
    assert all(torch.equal(k, k0) for k, k0 in zip(cache.pool.keys, keys))
    assert all(torch.equal(v, v0) for v, v0 in zip(cache.pool.values, values))
    assert (cache.table.length, cache.tokens, cache.pool.manager.free_blocks) == (length, tokens, free)
    assert (logits - reference_logits(model, [3, 1, 4, 1, 5, 9, 2, 6])[-3:]).abs().max() < TOL
    # A writing forward afterwards sees the same context the read-only one did.
    assert (runner.forward(cache, [9, 2, 6]) - logits).abs().max() < TOL


def test_crop_follows_the_transformers_convention(model: LoadedModel, path: str) -> None:
    runner, cache = new_cache(model, path)
    runner.forward(cache, list(range(1, 10)))
    slots = cache.physical_slots()
    cache.drain_log()
    cache.crop(0)
    assert cache.table.length == 9 and cache.physical_slots() == slots and cache.drain_log() == []
    cache.crop(-4)
    assert cache.table.length == 5 and cache.tokens == list(range(1, 6))
    assert cache.physical_slots() == slots[:5]
    assert_kv_matches(model, cache, list(range(1, 6)))
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(2)


def test_free_returns_every_block(model: LoadedModel, path: str) -> None:
    runner, cache = new_cache(model, path, blocks=5)
    runner.forward(cache, list(range(1, 18)))       # 17 slots -> all 5 blocks of 4
    assert cache.pool.manager.free_blocks == 0
    cache.free()
    assert cache.pool.manager.free_blocks == 5
    cache.pool.manager.check()


def test_usable_as_hf_generate_cache(model: LoadedModel) -> None:
    prompt = torch.tensor([[7, 3, 99, 4, 250, 18, 42]])
    pool = KVPool(model.kv_shape, num_blocks=8, block_size=4, device="cpu", dtype=torch.float32)
    cache = pool.new_sequence()
    with torch.inference_mode():
        paged = model.model.generate(prompt, cache=cache, do_sample=False, max_new_tokens=12)
        plain = model.model.generate(prompt, do_sample=False, max_new_tokens=12)
    assert paged.tolist() == plain.tolist()
    assert cache.get_seq_length() == prompt.shape[1] + 12 - 1   # the last token's K/V is never needed


def test_interleaved_sequences_take_the_gather_path_and_match(model: LoadedModel, path: str) -> None:
    runner, a = new_cache(model, path, blocks=16, block_size=2)
    b = runner.new_sequence()
    seq_a, seq_b = [], []
    for step in range(4):  # alternate growth, so each sequence's blocks interleave with the other's
        for cache, seq, chunk in ((a, seq_a, [7 + step, 3]), (b, seq_b, [40 + step, 2, 9])):
            seq += chunk
            logits = runner.forward(cache, chunk)
            assert (logits - reference_logits(model, seq)[-len(chunk):]).abs().max() < TOL
    assert a._contiguous_span() is None and b._contiguous_span() is None


def test_lone_sequence_stays_contiguous_through_rollbacks(model: LoadedModel, path: str) -> None:
    runner, cache = new_cache(model, path, blocks=16, block_size=2)
    seq: list[int] = []
    for append, back in [(5, 3), (4, 4), (3, 1), (6, 2)]:
        chunk = list(range(20 + len(seq), 20 + len(seq) + append))
        seq += chunk
        logits = runner.forward(cache, chunk)
        assert (logits - reference_logits(model, seq)[-append:]).abs().max() < TOL
        assert cache._contiguous_span() is not None  # LIFO reuse kept its blocks consecutive
        cache.rollback(back)
        seq = seq[: len(seq) - back]

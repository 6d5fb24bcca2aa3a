"""engine.runner: pool sizing equals what a pool allocates, each forward is timed by the injected clock,
features come back for every row, and the cache's tokens follow its K/V."""
from __future__ import annotations

import itertools

import torch

from engine.runner import ModelRunner, pool_bytes


def test_pool_bytes_is_what_the_runner_allocates(builtin_pair):
    for model in builtin_pair:
        for capacity, block in ((50, 16), (64, 16), (7, 4)):
            runner = ModelRunner(model, capacity, block_size=block)
            assert runner.pool.nbytes == pool_bytes(model, capacity, block)


def test_forwards_are_timed_by_the_injected_clock(builtin_pair):
    _, target = builtin_pair
    ticks = itertools.count()
    runner = ModelRunner(target, 32, now=lambda: next(ticks) * 0.002)   # every reading 2 ms later
    cache = runner.new_sequence()
    runner.forward(cache, [1, 2, 3], last_only=True)
    runner.forward(cache, [4])
    assert runner.drain_forward_ms() == [2.0, 2.0] and runner.drain_forward_ms() == []
    assert runner.forwards == 2 and cache.tokens == [1, 2, 3, 4]


def test_features_for_every_row_and_logits_for_the_last(builtin_pair):
    _, target = builtin_pair
    runner = ModelRunner(target, 32)
    cache = runner.new_sequence()
    logits, feats = runner.forward_features(cache, [5, 6, 7, 8], last_only=True)
    assert logits.shape == (1, target.vocab_size) and feats.shape == (4, target.model.config.hidden_size)
    assert torch.allclose(torch.nn.functional.linear(feats[-1:], target.model.lm_head.weight.detach()).float(), logits, atol=1e-5)
    with cache.read_only():
        runner.forward(cache, [9])
    assert cache.tokens == [5, 6, 7, 8] and cache.table.length == 4   # a read-only forward writes nothing

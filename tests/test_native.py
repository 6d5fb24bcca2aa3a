"""The int4 target's C++ layer loop (engine.native): the same ATen calls as the Python loop, so the same logits
and features bit for bit, for one row, a chain, EAGLE-3's taps and a cache gathered block by block; and where it
cannot be had, the Python loop runs and says why."""
from __future__ import annotations

import pytest
import torch

from engine import native
from engine.kv_cache import KVPool
from engine.models import load_model
from engine.sources import BUILTIN
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def int4_target():
    if native.int4_layers() is None:
        pytest.skip(f"no C++ loop here: {native.reason()}")
    return load_model(BUILTIN, "target", dtype="int4")


def forwards(target, loop, fast_path: bool) -> list[torch.Tensor]:
    """A 120-token prefill, one row, a 4-row chain with taps, 3 rows for greedy and one more row, on a cache whose
    blocks are consecutive (`fast_path`) or gathered slot by slot; every logit and feature they return."""
    fused = target.fused
    kept, fused.native = fused.native, loop
    try:
        pool = KVPool(target.kv_shape, 32, 16, "cpu", torch.float32)
        cache = pool.new_sequence(fast_path=fast_path)
        ids = torch.randint(10, 4000, (1, 120), generator=torch.Generator().manual_seed(1))
        out = []
        with torch.inference_mode():
            out += fused.forward_features(cache, ids)
            out += fused.forward_features(cache, torch.tensor([[41]]))
            out += fused.forward_features(cache, torch.tensor([[42, 43, 44, 45]]), taps=(0, 1, 3))
            out += fused.forward_features(cache, torch.tensor([[46, 47, 48]]), argmax_only=True)
            cache.rollback(2)
            out.append(fused.forward(cache, torch.tensor([[49]])))
        return out
    finally:
        fused.native = kept


@pytest.mark.parametrize("fast_path", [True, False], ids=["consecutive", "gathered"])
def test_the_cxx_loop_computes_what_the_python_loop_computes_bit_for_bit(int4_target, fast_path):
    assert int4_target.fused.native is not None and int4_target.fused.native_reason is None
    calls = []
    real = int4_target.fused.native.run
    spy = type("Spy", (), {"run": lambda self, *a: calls.append(a[1].shape[1]) or real(*a)})()
    python = forwards(int4_target, None, fast_path)
    cxx = forwards(int4_target, spy, fast_path)
    assert calls == [120, 1, 4, 3, 1]
    assert len(python) == len(cxx) == 9
    for i, (a, b) in enumerate(zip(python, cxx)):
        assert a.shape == b.shape and torch.equal(a, b), i
    assert python[5].shape[-1] == 3 * python[3].shape[-1]       # three taps side by side


def test_without_the_cxx_loop_int4_layers_run_in_python_and_say_why(builtin_tokenizer, monkeypatch):
    monkeypatch.setenv("SPECPLAY_NATIVE", "0")
    assert native.int4_layers() is None and native.reason() == "SPECPLAY_NATIVE=0"
    target = tiny_model(builtin_tokenizer, layers=1, seed=3, weights="int4")
    assert target.fused.native is None and target.fused.native_reason == "SPECPLAY_NATIVE=0"
    monkeypatch.delenv("SPECPLAY_NATIVE")
    monkeypatch.setattr(native, "_built", {})      # a fresh process on a machine whose build fails

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'specplay_int4_layers'\ng++: not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    assert native.int4_layers() is None
    assert native.reason() == "the C++ layers did not build (Error building extension 'specplay_int4_layers')"
    target = tiny_model(builtin_tokenizer, layers=1, seed=3, weights="int4")
    assert target.fused.native is None and "did not build" in target.fused.native_reason
    with torch.inference_mode():     # and the model still decodes, in Python
        cache = KVPool(target.kv_shape, 4, 16, "cpu", torch.float32).new_sequence()
        assert target.fused.forward(cache, torch.tensor([[5, 6, 7]])).isfinite().all()

"""The C++ layer loops (engine.native): an fp32 or int4 target's layers and an EAGLE head's draft step make the
Python forward's ATen calls, so they give its logits and features bit for bit: one row, a chain, EAGLE-3's taps,
a cache gathered block by block. Where they cannot be had, the Python loop runs and says why."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine import native
from engine.drafters.eagle import EagleRuntime
from engine.fused_llama import CodedWeights
from engine.kv_cache import KVPool
from engine.models import load_model
from engine.sources import BUILTIN
from tests.conftest import builtin_target_from_codes, tiny_model


@pytest.fixture(scope="module", params=["int4", "fp32 blocked", "fp32 dense under 4 rows", "fp32 from codes"])
def target(request):
    """The built-in target with int4 weights; in fp32 with oneDNN's blocked copies at every row count (the AMD
    rule); in fp32 with torch's default product under 4 rows and the blocked copies from 4 (the others'); and in
    fp32 rounded to a GGUF file's codes, which its products read (CodedWeights)."""
    if native.layers() is None:
        pytest.skip(f"no C++ loop here: {native.reason()}")
    if request.param == "fp32 from codes":
        if not native.layers().coded_supported():
            pytest.skip("this CPU has no products from codes")
        loaded = builtin_target_from_codes()
        assert isinstance(loaded.fused.blocked, CodedWeights) and loaded.fused.blocked_rows == 1
        return loaded
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPECPLAY_BLOCKED_MIN_ROWS", "4" if "dense" in request.param else "1")
        loaded = load_model(BUILTIN, "target", dtype="int4" if request.param == "int4" else "float32")
    assert loaded.fused.blocked_rows == (4 if "dense" in request.param else 1)
    return loaded


def forwards(target, loop, fast_path: bool) -> list[torch.Tensor]:
    """A 120-token prefill, one row, a 4-row chain with taps, 3 rows for greedy, one more row and a tree of 4 nodes,
    on a cache whose blocks are consecutive (`fast_path`) or gathered slot by slot; every logit and feature."""
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
            n = cache.get_seq_length()          # a tree: 50 and 52 siblings, 51 below 50, 53 below 51
            seen = torch.zeros(4, n + 4, dtype=torch.bool)
            seen[:, :n] = True
            for row, path in enumerate([[0], [0, 1], [2], [0, 1, 3]]):
                seen[row, [n + p for p in path]] = True
            out += fused.forward_features(cache, torch.tensor([[50, 51, 52, 53]]),
                                          positions=torch.tensor([n, n + 1, n, n + 2]), attn_mask=seen)
        return out
    finally:
        fused.native = kept


@pytest.mark.parametrize("fast_path", [True, False], ids=["consecutive", "gathered"])
def test_the_cxx_loop_computes_what_the_python_loop_computes_bit_for_bit(target, fast_path):
    assert target.fused.native is not None and target.fused.native_reason is None
    calls = []
    real = target.fused.native.run
    spy = type("Spy", (), {"run": lambda self, *a: calls.append(a[1].shape[1]) or real(*a)})()
    python = forwards(target, None, fast_path)
    cxx = forwards(target, spy, fast_path)
    assert calls == [120, 1, 4, 3, 1, 4]
    assert len(python) == len(cxx) == 11
    for i, (a, b) in enumerate(zip(python, cxx)):
        assert a.shape == b.shape and torch.equal(a, b), i
    assert python[5].shape[-1] == 3 * python[3].shape[-1]       # three taps side by side


@pytest.mark.parametrize("copies", ["bf16 copies", "fp32 copies", "8-bit codes"])
def test_the_eagle_heads_cxx_step_computes_what_its_python_step_computes_bit_for_bit(target, copies):
    from tests.test_eagle import random_head

    runtime = random_head(target, kept=600, seed=2)
    runtime = EagleRuntime(runtime.head, runtime.kept_ids, target, bf16=copies == "bf16 copies",
                           codes=copies == "8-bit codes")
    if copies == "8-bit codes":     # a head drafts from codes where its target's products read codes
        assert (runtime.matrices == "8-bit codes") == isinstance(target.fused.blocked, CodedWeights)
        if runtime.matrices == "8-bit codes":   # with 8-bit inputs where the CPU takes the integer products
            integer = native.layers().integer_supported()
            assert runtime.native._kinds == [3 if integer else 2] * 5 and runtime._blocked.integer == integer
    assert runtime.native is not None     # (under the target's blocked_rows a head's steps run in Python)
    d = target.fused.embed.shape[1]
    feats = torch.randn(40, d, generator=torch.Generator().manual_seed(5))

    def steps(step, fast_path: bool) -> list[torch.Tensor]:
        kept, runtime.native = runtime.native, step
        try:
            cache = KVPool(runtime.config.kv_shape, 8, 16, "cpu", torch.float32).new_sequence(fast_path=fast_path)
            out = [runtime.forward(cache, list(range(100, 130)), feats[:30])]       # a prefill: 30 rows, masked
            out.append(runtime.forward(cache, [7], feats[30:31]))
            out.append(runtime.forward(cache, [8, 9, 10], feats[31:34]))
            n = cache.get_seq_length()               # a tree's level: two siblings, and a child of the first
            seen = torch.zeros(3, n + 3, dtype=torch.bool)
            seen[:, :n] = True
            for row, path in enumerate([[0], [1], [0, 2]]):
                seen[row, [n + p for p in path]] = True
            out.append(runtime.forward(cache, [11, 12, 13], feats[34:37], positions=[n + 1, n + 1, n + 2],
                                       attn_mask=seen))
            return [*out, runtime.logits(out[-1])]
        finally:
            runtime.native = kept

    python = steps(None, True)
    for fast_path in (True, False):
        cxx = steps(runtime.native, fast_path)
        assert all(torch.equal(a, b) for a, b in zip(python, cxx))


def test_without_the_cxx_loop_layers_run_in_python_and_say_why(builtin_tokenizer, monkeypatch):
    monkeypatch.setenv("SPECPLAY_NATIVE", "0")
    assert native.layers() is None and native.reason() == "SPECPLAY_NATIVE=0"
    target = tiny_model(builtin_tokenizer, layers=1, seed=3, weights="int4")
    assert target.fused.native is None and target.fused.native_reason == "SPECPLAY_NATIVE=0"
    monkeypatch.delenv("SPECPLAY_NATIVE")
    monkeypatch.setattr(native, "_built", {})      # a fresh process on a machine whose build fails

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'specplay_layers'\ng++: not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    assert native.layers() is None
    assert native.reason() == "the C++ layers did not build (Error building extension 'specplay_layers')"
    target = tiny_model(builtin_tokenizer, layers=1, seed=3, weights="int4")
    assert target.fused.native is None and "did not build" in target.fused.native_reason
    with torch.inference_mode():     # and the model still decodes, in Python
        cache = KVPool(target.kv_shape, 4, 16, "cpu", torch.float32).new_sequence()
        assert target.fused.forward(cache, torch.tensor([[5, 6, 7]])).isfinite().all()


def test_a_forward_in_cxx_lets_the_servers_other_threads_run(target, monkeypatch):
    """The C++ loop lets go of Python's lock while it computes: the event loop and other sessions of a server keep
    running through a long forward (here a 400-row prefill), as they do between the Python loop's operations.
    Holding the lock, the C++ call would leave this thread one gap as long as the call."""
    if target.fused.weights != "int4":
        pytest.skip("one weight format is enough")
    cache = KVPool(target.kv_shape, 32, 16, "cpu", torch.float32).new_sequence()
    ids = torch.randint(10, 4000, (1, 400), generator=torch.Generator().manual_seed(2))
    window, ticks = [], []
    run = target.fused.native.run

    def timed(*args):
        window.append(time.perf_counter())
        out = run(*args)                     # one call into C++, the layers with row-by-row attention
        window.append(time.perf_counter())
        return out

    monkeypatch.setattr(target.fused.native, "run", timed)

    def prefill():
        with torch.inference_mode():
            target.fused.forward(cache, ids, last_only=True)

    worker = threading.Thread(target=prefill)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    start, end = window
    inside = [start] + [t for t in ticks if start < t < end] + [end]
    longest = max(b - a for a, b in zip(inside, inside[1:]))
    assert longest < (end - start) / 2, (longest, end - start)


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    native._clear_stale_lock(tmp_path)
    assert lock.exists()                   # a build under way holds it
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    native._clear_stale_lock(tmp_path)
    assert not lock.exists()               # left by a build that died: the next start does not wait on it
    native._clear_stale_lock(tmp_path)     # and no lock at all is fine


def test_a_compiler_without_openmp_builds_the_module_without_it(monkeypatch, tmp_path):
    """-fopenmp lets torch's threads share out the coded products; a compiler that refuses it still builds the
    module (those products then run on one thread) rather than leaving every layer to Python."""
    import types

    monkeypatch.setenv("SPECPLAY_CACHE", str(tmp_path))
    asked, built = [], types.ModuleType("specplay_layers")

    def load(name, sources, **kwargs):
        asked.append(kwargs["extra_cflags"])
        if "-fopenmp" in kwargs["extra_cflags"]:
            raise RuntimeError("Error building extension 'specplay_layers'\nclang: unsupported option '-fopenmp'")
        return built

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    assert native._build() == {"module": built}
    assert asked == [["-O3", "-ffp-contract=off", "-fopenmp"], ["-O3", "-ffp-contract=off"]]


def test_attention_row_by_row_is_sdpas_and_a_row_is_the_same_alone():
    """engine/native/attention.cpp (the int8 and int4 targets' attention): each row over a prefix of the keys, or
    over a tree node's gathered keys, within float rounding of torch's SDPA on the same keys (grouped heads read
    their own key head), and the same bits alone as beside other rows, whatever the rows' count."""
    module = native.layers()
    if module is None or not module.rows_supported():
        pytest.skip("no attention row by row here (no C++ module or no AVX2)")
    g = torch.Generator().manual_seed(0)
    qs, keys, values = torch.randn(1, 9, 6, 64, generator=g), torch.randn(1, 3, 300, 64, generator=g), \
        torch.randn(1, 3, 300, 64, generator=g)
    qs[:, :, 5] *= 40                                    # scores far apart: weights that round to 0 in fp32
    counts = [1, 7, 8, 9, 150, 300]                      # one key, and counts around the kernel's groups of 4 and 8
    together = module.rows_attention(qs, keys, values, counts, 0.125)
    for r, n in enumerate(counts):
        row = qs[:, :, r:r + 1].contiguous()
        sdpa = torch.nn.functional.scaled_dot_product_attention(row, keys[:, :, :n], values[:, :, :n], scale=0.125,
                                                                enable_gqa=True)
        assert (together[:, :, r:r + 1] - sdpa).abs().max() < 1e-5, n
        assert torch.equal(module.rows_attention(row, keys, values, [n], 0.125), together[:, :, r:r + 1])
    path = torch.tensor([0, 4, 17, 299])                # a tree node's keys, gathered
    gathered = module.rows_attention(qs[:, :, :1], keys.index_select(2, path), values.index_select(2, path), [4], 0.125)
    sdpa = torch.nn.functional.scaled_dot_product_attention(qs[:, :, :1], keys.index_select(2, path),
                                                            values.index_select(2, path), scale=0.125, enable_gqa=True)
    assert (gathered - sdpa).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="sees 1 to 300 keys"):
        module.rows_attention(qs[:, :, :1], keys, values, [301], 0.125)


@pytest.mark.parametrize("width", [64, 13], ids=["lanes full", "a partial last group"])
def test_the_norm_and_the_gate_are_torchs_within_rounding_and_a_row_is_the_same_alone(width):
    """engine/native/pointwise.cpp (every float32 layer's norm and gate on the CPU): LlamaRMSNorm and silu(gate) * up
    within float rounding of torch's, for rows whose width is not a multiple of 8 too, for gates far out on either
    side, and a row's bits do not depend on the rows beside it."""
    module = native.layers()
    if module is None or not module.pointwise_supported():
        pytest.skip("no pointwise steps here (no C++ module or no AVX2)")
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(2, 5, width, generator=g) * 3, torch.randn(width, generator=g)
    normed = module.rms_rows(x, weight, 1e-5)
    assert normed.shape == x.shape
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x, (width,), weight, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(module.rms_rows(x[1, 3], weight, 1e-5), normed[1, 3])
    gate_up = torch.randn(2, 5, 2 * width, generator=g) * 4
    gate_up[0, 0, :width] = torch.linspace(-120, 120, width)       # past exp's range on both sides
    gated = module.gated_rows(gate_up, width)
    gate, up = gate_up.split(width, dim=-1)
    torch.testing.assert_close(gated, torch.nn.functional.silu(gate) * up, rtol=3e-6, atol=1e-6)
    assert torch.equal(module.gated_rows(gate_up[1, 3], width), gated[1, 3])
    with pytest.raises(RuntimeError, match="not 2 x 7"):
        module.gated_rows(gate_up, 7)


def test_the_python_forward_norms_and_gates_as_the_cxx_loop_and_training_keeps_its_gradients(monkeypatch):
    """fused_llama's _rms_norm and _gated call the C++ steps for float32 rows without a gradient (the C++ layer loop's
    results then match the Python loop's); with a gradient wanted (training a head) they stay torch's, which autograd
    follows, and with SPECPLAY_NATIVE=0 too."""
    from engine.fused_llama import _gated, _rms_norm

    module = native.layers()
    if module is None or not module.pointwise_supported():
        pytest.skip("no pointwise steps here (no C++ module or no AVX2)")
    g = torch.Generator().manual_seed(2)
    x, weight, gate_up = torch.randn(3, 40, generator=g), torch.randn(40, generator=g), torch.randn(3, 80, generator=g)
    assert torch.equal(_rms_norm(x, (weight, 1e-6)), module.rms_rows(x, weight, 1e-6))
    assert torch.equal(_gated(gate_up, 40), module.gated_rows(gate_up, 40))
    trained = weight.clone().requires_grad_()
    out = _rms_norm(x, (trained, 1e-6))
    assert torch.equal(out, torch.nn.functional.rms_norm(x, (40,), trained, 1e-6))
    out.sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0
    monkeypatch.setenv("SPECPLAY_NATIVE", "0")
    gate, up = gate_up.split(40, dim=-1)
    assert torch.equal(_gated(gate_up, 40), torch.nn.functional.silu(gate) * up)

"""Tests for engine.sampling: logits processing, inverse-CDF sampling, uniforms."""
import math

import pytest
import torch

from engine.sampling import (
    SamplingParams,
    draw_uniform,
    greedy_ids,
    logits_to_probs,
    one_hot_rows,
    sample_from,
    sample_many,
)


def probs_logits(*probs: float) -> torch.Tensor:
    """A [1, V] logits row whose softmax is exactly the given distribution (up to rounding)."""
    return torch.tensor([probs]).log()


# --- SamplingParams -------------------------------------------------------------------------


def test_defaults_are_greedy():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "Temperature must be"),
        ({"temperature": math.nan}, "Temperature must be"),
        ({"temperature": math.inf}, "Temperature must be"),
        ({"temperature": "1"}, "Temperature must be"),
        ({"top_k": -1}, "Top-k must be"),
        ({"top_k": 2.5}, "Top-k must be"),
        ({"top_k": True}, "Top-k must be"),
        ({"top_p": 0.0}, "Top-p must be"),
        ({"top_p": -0.2}, "Top-p must be"),
        ({"top_p": 1.5}, "Top-p must be"),
        ({"top_p": math.nan}, "Top-p must be"),
    ],
)
def test_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# --- logits_to_probs ------------------------------------------------------------------------


def test_greedy_is_one_hot_with_ties_to_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-math.inf, 2.0, -math.inf, 2.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    expected = torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]])
    assert probs.dtype == torch.float32
    assert torch.equal(probs, expected)


def test_greedy_ties_go_to_lowest_id_across_a_wide_row():
    # Vectorised reductions split a wide row into chunks; the first maximum must still win.
    logits = torch.randn(6, 4096, generator=torch.Generator().manual_seed(0))
    ties = [(0, [7, 4000]), (1, [4095, 3]), (2, [1024, 1025, 2048]), (3, [0, 4095]), (4, [2000, 17]), (5, [9])]
    for row, ids in ties:
        logits[row, ids] = 50.0
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.argmax(dim=-1).tolist() == [min(ids) for _, ids in ties]
    assert torch.equal(probs.sum(dim=-1), torch.ones(6))


def test_greedy_ids_and_one_hot_rows_are_logits_to_probs():
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(1))
    ids = greedy_ids(logits)
    assert torch.equal(ids, logits.argmax(dim=-1))
    assert torch.equal(one_hot_rows(ids, 300), logits_to_probs(logits, SamplingParams()))
    # and inverse-CDF sampling of a greedy row returns its hot id for any u
    u = draw_uniform(32, torch.Generator().manual_seed(2))
    assert torch.equal(sample_from(one_hot_rows(ids, 300), u), ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_positive_inf_anywhere_is_rejected(temperature, bad):
    logits = torch.zeros(3, 4096)
    logits[1, 3000] = bad
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        logits_to_probs(logits, SamplingParams(temperature=temperature))


def test_temperature_scales_logits():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0], [3.0, 1.0, 1.0, -2.0]])
    for t in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(probs, torch.softmax(logits / t, dim=-1))
    # Lower temperature sharpens: the top token's mass grows.
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert bool((cold.max(-1).values > hot.max(-1).values).all())


def test_minus_inf_logits_get_zero_probability():
    logits = torch.tensor([[1.0, -math.inf, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0))
    assert probs[0, 1].item() == 0.0
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))


def test_top_k_keeps_exactly_k_largest_renormalised():
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    top3 = logits.topk(3, dim=-1).indices
    assert torch.equal((probs > 0).sum(-1), torch.full((5,), 3))
    assert bool(probs.gather(1, top3).gt(0).all())
    masked = torch.full_like(logits, -math.inf).scatter(1, top3, logits.gather(1, top3))
    torch.testing.assert_close(probs, torch.softmax(masked, dim=-1))


def test_top_k_ties_keep_lowest_ids_and_k_at_least_v_is_off():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.equal(probs, torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0]]))
    everything = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=9))
    torch.testing.assert_close(everything, torch.softmax(logits, -1))


@pytest.mark.parametrize(
    "top_p, kept",
    [(1e-9, [0]), (0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_minimal_nucleus(top_p, kept):
    # Shuffled order so the nucleus is found by sorting, not by position.
    mass = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
    logits = probs_logits(*(mass[i] for i in range(4)))
    rank_to_id = [2, 0, 3, 1]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))[0]
    kept_ids = sorted(rank_to_id[r] for r in kept)
    assert torch.nonzero(probs).flatten().tolist() == kept_ids
    total = sum(mass[i] for i in kept_ids)
    for i in kept_ids:
        assert probs[i].item() == pytest.approx(mass[i] / total, rel=1e-5)


def test_top_p_applies_to_top_k_renormalised_distribution():
    # After top-3 the masses are 0.5/0.95, 0.3/0.95, 0.15/0.95: the top two reach 0.842 >= 0.82,
    # whereas on the raw distribution they would only reach 0.80 and a third token would be kept.
    logits = probs_logits(0.5, 0.3, 0.15, 0.05)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.82))[0]
    assert torch.nonzero(probs).flatten().tolist() == [0, 1]
    assert probs[0].item() == pytest.approx(0.5 / 0.8, rel=1e-5)


@pytest.mark.parametrize(
    "logits",
    [torch.zeros(4), torch.zeros(1, 2, 3), torch.tensor([[0.0, math.nan]]), torch.tensor([[-math.inf, -math.inf]])],
)
def test_logits_validation(logits):
    with pytest.raises(ValueError):
        logits_to_probs(logits, SamplingParams(temperature=1.0))


# --- sample_from ----------------------------------------------------------------------------


def test_sample_from_u_near_one_never_returns_zero_tail():
    probs = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    u = torch.full((2,), math.nextafter(1.0, 0.0), dtype=torch.float64)
    assert sample_from(probs, u).tolist() == [1, 3]
    assert sample_from(probs, torch.zeros(2, dtype=torch.float64)).tolist() == [0, 3]


def test_sample_from_rounding_edge_is_clamped_to_last_nonzero():
    # A row whose float32 cumsum exceeds the float64 sum of its parts; u * total may round to total.
    probs = torch.tensor([[0.1, 0.7, 0.2, 0.0, 0.0]])
    for u in (math.nextafter(1.0, 0.0), 1.0):  # 1.0 is outside the contract but must still be safe
        assert sample_from(probs, torch.tensor([u], dtype=torch.float64)).item() == 2


def test_sample_from_never_samples_zero_probability_and_follows_the_cdf():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.0, 0.7, 0.0]])
    grid = torch.linspace(0.0, math.nextafter(1.0, 0.0), 10_001, dtype=torch.float64)
    ids = sample_many(probs, grid.unsqueeze(0))[0]
    assert set(ids.tolist()) == {1, 4}
    # The uniform grid maps onto tokens in proportion to their mass.
    assert (ids == 1).double().mean().item() == pytest.approx(0.3, abs=2e-4)


def test_sample_from_accepts_unnormalised_rows():
    probs = torch.tensor([[0.0, 2.0, 6.0]])
    assert sample_from(probs, torch.tensor([0.24], dtype=torch.float64)).item() == 1
    assert sample_from(probs, torch.tensor([0.26], dtype=torch.float64)).item() == 2


def test_sample_from_errors():
    with pytest.raises(ValueError, match="no positive mass"):
        sample_from(torch.zeros(1, 3), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="shape"):
        sample_from(torch.ones(2, 3), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="2-D"):
        sample_from(torch.ones(3), torch.tensor([0.5, 0.5, 0.5]))


# --- draw_uniform ---------------------------------------------------------------------------


def test_draw_uniform_is_reproducible_and_in_range():
    a = draw_uniform(1000, torch.Generator().manual_seed(7), "cpu")
    b = draw_uniform(1000, torch.Generator().manual_seed(7), "cpu")
    assert torch.equal(a, b)
    assert a.shape == (1000,)
    assert bool((a >= 0).all()) and bool((a < 1).all())
    assert a.mean().item() == pytest.approx(0.5, abs=0.05)


def test_draw_uniform_rejects_negative_n():
    with pytest.raises(ValueError):
        draw_uniform(-1, None, "cpu")


def _mass_before(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] float64: each token's mass-before in the stable order (larger first, ties to the lower id), over the
    top-k-renormalised distribution: top-p keeps a token when this is below top_p."""
    scaled = scaled.double()
    order = torch.sort(scaled, dim=-1, descending=True, stable=True).indices
    logits = scaled.gather(1, order)
    if 0 < params.top_k < logits.shape[1]:
        logits[:, params.top_k:] = -math.inf
    mass = torch.softmax(logits, -1)
    return torch.zeros_like(mass).scatter(1, order, torch.cumsum(mass, -1) - mass)


def _boundary_only(fast: torch.Tensor, full: torch.Tensor, scaled: torch.Tensor, params: SamplingParams) -> bool:
    """Where the two masks differ, the token's mass-before (float64, in the stable order) is within float32
    rounding of top_p: the only place the partial sort may decide otherwise."""
    differ = fast != full
    return bool(((_mass_before(scaled, params)[differ] - params.top_p).abs() <= 1e-5).all())


@pytest.mark.parametrize("params", [SamplingParams(1.0, 0, 0.9), SamplingParams(0.7, 0, 0.95), SamplingParams(1.0, 5, 1.0),
                                    SamplingParams(1.0, 40, 0.8), SamplingParams(1.0, 0, 0.5)])
def test_the_partial_sort_keeps_the_full_sorts_set(params):
    from engine.sampling import _mask_by_sorting, _top_k_top_p_mask

    gen = torch.Generator().manual_seed(3)
    for trial in range(60):
        v = int(torch.randint(70, 4000, (1,), generator=gen))
        scaled = torch.randn(6, v, generator=gen) * float(torch.rand(1, generator=gen) * 12) / params.temperature
        if trial % 3 == 0:
            scaled = scaled.round()          # ties, also across the candidates' edge
        if trial % 10 == 0:
            scaled[:3] = 0.0                 # flat rows: the nucleus is wider than every candidate set
        fast, full = _top_k_top_p_mask(scaled, params), _mask_by_sorting(scaled, params)
        assert (fast.sum(1) >= 1).all()
        assert _boundary_only(fast, full, scaled, params), (trial, v)
        if 0 < params.top_k and params.top_p == 1.0:
            assert torch.equal(fast, full)  # top-k alone sums nothing: the sets are identical


def test_a_tie_past_a_small_nucleus_takes_no_full_sort(monkeypatch):
    """bf16-rounded logits (a drafter's, with bf16 weights) tie often, also across the 64 candidates' edge; at
    T = 0.2 the nucleus is a few tokens far above that edge, so the partial sort decides it, as the full sort does."""
    from engine import sampling

    params = SamplingParams(0.2, 0, 0.9)
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 8192, generator=gen) * 2).to(torch.bfloat16).float()
    logits[:, :3] = torch.tensor([14.0, 13.5, 13.0])
    scaled = logits / params.temperature
    top = torch.topk(scaled, 65, dim=-1).values
    assert (top[:, 63] == top[:, 64]).any()              # some row's candidates end inside a tie
    by_sorting, sorts = sampling._mask_by_sorting, []
    monkeypatch.setattr(sampling, "_mask_by_sorting", lambda *a: sorts.append(a) or by_sorting(*a))
    assert torch.equal(sampling._top_k_top_p_mask(scaled, params), by_sorting(scaled, params)) and sorts == []
    scaled[:, 3:] = 13.0 / params.temperature            # now the tie is inside the nucleus: the full sort decides
    assert torch.equal(sampling._top_k_top_p_mask(scaled, params), by_sorting(scaled, params)) and sorts


def test_the_nucleus_total_is_logsumexps_in_float64_within_float32_rounding():
    """top-p's total (the log of a row's exp sum) from float32 terms held at e^-87 and a float32 sum: within float32
    rounding of float64's logsumexp for a low temperature's spread, a flat row and padded -inf logits alike."""
    from engine.sampling import _log_total

    gen = torch.Generator().manual_seed(7)
    scaled = torch.randn(4, 49152, generator=gen) * 4 / 0.05       # T = 0.05: almost every term underflows
    scaled[1] = 3.0                                                 # flat: every term counts
    scaled[2, 40000:] = -math.inf                                   # a padded vocabulary
    scaled[3] = torch.randn(49152, generator=gen)                   # T = 1
    total = _log_total(scaled, scaled.max(-1, keepdim=True).values)
    want = scaled.double().logsumexp(-1, keepdim=True)
    assert total.dtype == torch.float64 and total.shape == (4, 1)
    assert (total - want).abs().max() < 1e-6


@pytest.mark.parametrize("params", [SamplingParams(0.2, 0, 0.9), SamplingParams(1.0, 0, 0.95), SamplingParams(1.5, 0, 0.5),
                                    SamplingParams(0.7, 10**6, 0.99)], ids=["t0.2", "t1", "t1.5-p0.5", "k-past-v"])
def test_the_compiled_nucleus_keeps_the_definitions_set_and_masses(params):
    """engine/native/nucleus.cpp against the rule in float64 (a stable sort, a token kept when the mass before it is
    below top_p), on peaked, flat, tied and padded rows up to SmolLM2's vocabulary: the same kept set but for tokens
    whose mass-before lies within 1e-6 of top_p, and each kept token's mass renormalised over the set. (The ATen
    path's float32 sums part from this rule by more on flat rows of many thousand tokens.)"""
    from engine import sampling

    if sampling.compiled_module() is None:
        pytest.skip("the compiled nucleus needs the C++ module on an x86-64 CPU with AVX2")
    gen = torch.Generator().manual_seed(11)
    for trial in range(40):
        v = int(torch.randint(2, 49153, (1,), generator=gen))
        logits = torch.randn(3, v, generator=gen) * float(torch.rand(1, generator=gen) * 12)
        if trial % 4 == 0:
            logits = logits.round()                      # ties, kept in id order
        if trial % 5 == 0:
            logits[1, : v // 2] = -math.inf              # a padded vocabulary
        probs = logits_to_probs(logits, params)
        scaled = (logits / params.temperature).double()
        before = _mass_before(scaled, params)
        kept = probs > 0
        differ = kept != (before < params.top_p)
        assert bool(((before[differ] - params.top_p).abs() < 1e-6).all()), (trial, v)     # only at the edge
        want = torch.softmax(scaled.masked_fill(~kept, -math.inf), -1)
        assert (probs.double() - want).abs().max() < 1e-6, (trial, v)


def test_a_row_the_compiled_nucleus_cannot_decide_takes_the_full_path():
    """A nucleus reaching below the candidates (a long flat tail more than 16 below the largest logit holds 0.3% of
    the mass, top-p 0.999): that row is left to the ATen path, the others are not; a NaN row still raises."""
    from engine import sampling

    module = sampling.compiled_module()
    if module is None:
        pytest.skip("the compiled nucleus needs the C++ module on an x86-64 CPU with AVX2")
    params = SamplingParams(1.0, 0, 0.999)
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(2))
    logits[1] = -17.0
    logits[1, 7] = 0.0
    _, found = module.nucleus_rows(logits, params.temperature, params.top_p)
    assert found.tolist() == [True, False, True]
    probs = logits_to_probs(logits, params)
    assert torch.equal(probs[1], sampling._processed(logits[1:2], params)[0]) and int((probs[1] > 0).sum()) > 1
    logits[2, 5] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        logits_to_probs(logits, params)


def test_the_compiled_sampler_draws_what_the_aten_path_draws(monkeypatch):
    """engine/native/nucleus.cpp's `sampled_rows` against sample_many's ATen path (a float64 cumsum and a
    searchsorted): the same ids, bit for bit, on dense, sparse, rounded and empty rows of float32 and float64,
    uniforms landing exactly on a running sum included; an empty row still raises."""
    from engine import sampling

    module = sampling.compiled_module()
    if module is None:
        pytest.skip("the compiled sampler needs the C++ module on an x86-64 CPU with AVX2")
    gen = torch.Generator().manual_seed(0)
    cases = []
    for trial in range(300):
        v, rows, t = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (5000, 4, 4))
        probs = torch.rand(rows, v, generator=gen, dtype=torch.float64).to(torch.float32 if trial % 2 else torch.float64)
        if trial % 3 == 0:
            probs = probs * (torch.rand(rows, v, generator=gen) < 0.01)    # a few kept tokens, as top-p leaves
        if trial % 11 == 0:
            probs = probs.round()
        u = torch.rand(rows, t, generator=gen, dtype=torch.float64)
        if trial % 5 == 0:                                                 # exactly on a running sum
            cdf = torch.cumsum(probs.double(), -1)
            at = cdf.gather(1, torch.randint(0, v, (rows, t), generator=gen))
            u = (at / cdf[:, -1:].clamp_min(1e-300)).clamp(max=0.999999)
        cases.append((probs, u))
    compiled = [sampling.sample_many(p, u, check_mass=False) for p, u in cases]
    monkeypatch.setattr(sampling, "compiled_module", lambda: None)
    assert all(torch.equal(c, sampling.sample_many(p, u, check_mass=False)) for c, (p, u) in zip(compiled, cases))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="no positive mass"):
        sampling.sample_from(torch.zeros(2, 300), torch.rand(2, dtype=torch.float64))

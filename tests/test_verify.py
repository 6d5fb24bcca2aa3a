"""Tests for engine.verify (one round's rejection sampling) and playground.teach.losslessness (its statistics).

Statistical tests use fixed seeds and significance level alpha = 1e-3 per output index.
"""
import math

import pytest
import torch

from engine.records import Outcome
from engine.sampling import SamplingParams, draw_uniform, logits_to_probs, sample_from
from engine.stats import goodness_of_fit
from engine.verify import ROW_SUM_TOL, Verdict, align_vocab, verify, verify_greedy, verify_reference
from playground.teach.losslessness import Rule, check_rule, passes, simulate

SIGNIFICANCE = 1e-3
TRIALS = 120_000


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def one_hot(v: int, i: int) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(v)]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_rows(n: int, v: int, g: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(n, v, generator=g) * scale, dim=-1)


def assert_same_result(a: Verdict, b: Verdict) -> None:
    for field in ("path", "tokens", "accepted_count", "rejected", "depths_verified", "tested",
                  "final_token", "final_outcome", "final_row", "final_u"):
        assert getattr(a, field) == getattr(b, field), field
    assert (a.residual is None) == (b.residual is None)
    if a.residual is not None:
        assert torch.equal(a.residual, b.residual)


both_impls = pytest.mark.parametrize("impl", [verify, verify_reference], ids=["vectorised", "reference"])


# --- deterministic rounds -------------------------------------------------------------------


@both_impls
def test_certain_accept_then_bonus(impl):
    q = t([one_hot(4, 1), one_hot(4, 2)])
    p = t([one_hot(4, 1), one_hot(4, 2), one_hot(4, 3)])
    r = impl(q, p, [1, 2], gen())
    assert r.tokens == [1, 2, 3]
    assert (r.accepted_count, r.rejected, r.depths_verified) == (2, False, 2)
    assert [v.outcome for v in r.tested] == [Outcome.ACCEPTED, Outcome.ACCEPTED]
    assert [v.alpha for v in r.tested] == [1.0, 1.0]
    assert (r.final_token, r.final_outcome, r.final_row) == (3, Outcome.BONUS, 2)
    assert r.residual is None


@both_impls
def test_certain_reject_with_single_support_residual(impl):
    # Token 1: q = 0.5, p = 0 -> alpha = 0. Residual max(0, p - q) = [0, 0, 0.5, 0] -> token 2.
    q = t([[0.5, 0.5, 0, 0], one_hot(4, 0), one_hot(4, 0)])
    p = t([[0.5, 0, 0.5, 0], one_hot(4, 0), one_hot(4, 0), one_hot(4, 0)])
    r = impl(q, p, [1, 0, 0], gen())
    assert r.tokens == [2]
    assert (r.accepted_count, r.rejected, r.depths_verified) == (0, True, 1)
    assert len(r.tested) == 1
    v = r.tested[0]
    assert (v.index, v.token, v.p_target, v.q_draft, v.alpha, v.outcome) == (0, 1, 0.0, 0.5, 0.0, Outcome.REJECTED)
    assert (r.final_token, r.final_outcome, r.final_row) == (2, Outcome.CORRECTED, 0)
    assert torch.equal(r.residual, t([0, 0, 1, 0]))
    assert r.residual.dtype == torch.float32 and r.residual.device.type == "cpu"


@both_impls
def test_reject_midway_reports_checked_prefix(impl):
    q = t([one_hot(3, 0), one_hot(3, 1), one_hot(3, 2)])
    p = t([one_hot(3, 0), one_hot(3, 2), one_hot(3, 2), one_hot(3, 0)])
    r = impl(q, p, [0, 1, 2], gen())
    assert r.tokens == [0, 2]
    assert [v.outcome for v in r.tested] == [Outcome.ACCEPTED, Outcome.REJECTED]
    assert (r.accepted_count, r.depths_verified, r.final_row) == (1, 2, 1)


@both_impls
def test_bonus_comes_from_row_k_not_k_minus_1(impl):
    q = t([one_hot(5, 2), one_hot(5, 4)])
    p = t([one_hot(5, 2), one_hot(5, 4), one_hot(5, 0)])  # row K-1 would give 4, row K gives 0
    r = impl(q, p, [2, 4], gen())
    assert r.tokens == [2, 4, 0]
    assert (r.final_token, r.final_row, r.final_outcome) == (0, 2, Outcome.BONUS)


@both_impls
def test_zero_q_token_is_accepted_iff_target_can_emit_it(impl):
    q = t([[1.0, 0, 0, 0]])
    p = t([[0.5, 0, 0.5, 0], one_hot(4, 3)])
    accepted = impl(q, p, [2], gen())  # q = 0, p = 0.5 -> alpha 1
    assert accepted.tested[0].alpha == 1.0
    assert accepted.tokens == [2, 3]
    rejected = impl(q, p, [1], gen())  # q = 0, p = 0 -> alpha 0; residual [0, 0, 0.5, 0]
    assert rejected.tested[0].alpha == 0.0
    assert rejected.tokens == [2]
    assert rejected.final_outcome is Outcome.CORRECTED


@both_impls
def test_partial_acceptance_probability_uses_u(impl):
    q = t([[0.8, 0.2]])
    p = t([[0.4, 0.6], [1.0, 0.0]])
    r = impl(q, p, [0], gen(3))
    u = draw_uniform(1, gen(3), "cpu").item()
    v = r.tested[0]
    assert v.alpha == pytest.approx(0.5)
    assert v.u == u
    assert (v.outcome is Outcome.ACCEPTED) == (u < 0.5)


@both_impls
@pytest.mark.parametrize("validate", [True, False])
def test_zero_mass_residual_is_an_error(impl, validate):
    # p == q, and the drafted token has q = p = 0: alpha 0, and max(0, p - q) is all zeros.
    q = t([[0.5, 0.5, 0.0]])
    p = t([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="could not have sampled"):
        impl(q, p, [2], gen(), validate=validate)


# --- input contract -------------------------------------------------------------------------


def valid_inputs():
    q = t([[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    p = t([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    return q, p, [0, 3]


def with_value(x, row, col, value):
    x = x.clone()
    x[row, col] = value
    return x


INVALID = {
    "q 1-D": (lambda q, p, k: (q[0], p, k), "2-D"),
    "p 3-D": (lambda q, p, k: (q, p.unsqueeze(0), k), "2-D"),
    "p has K rows": (lambda q, p, k: (q, p[:2], k), "K\\+1"),
    "p has K+2 rows": (lambda q, p, k: (q, torch.cat([p, p[:1]]), k), "K\\+1"),
    "vocab mismatch": (lambda q, p, k: (q, torch.cat([p, torch.zeros(3, 1)], 1), k), "vocabulary"),
    "too few tokens": (lambda q, p, k: (q, p, k[:1]), "draft tokens"),
    "too many tokens": (lambda q, p, k: (q, p, k + [1]), "draft tokens"),
    "2-D tokens": (lambda q, p, k: (q, p, torch.tensor([k])), "draft tokens"),
    "float tokens": (lambda q, p, k: (q, p, torch.tensor([0.0, 3.0])), "integer"),
    "K = 0": (lambda q, p, k: (q[:0], p[:1], []), "K >= 1"),
    "NaN in q": (lambda q, p, k: (with_value(q, 0, 1, math.nan), p, k), "NaN or inf"),
    "inf in p": (lambda q, p, k: (q, with_value(p, 2, 0, math.inf), k), "NaN or inf"),
    "negative p": (lambda q, p, k: (q, with_value(p, 1, 0, -0.25), k), "negative"),
    "q row sums to 0.9": (lambda q, p, k: (with_value(q, 1, 3, 0.3), p, k), "sum to 1"),
    "p row sums to 1.01": (lambda q, p, k: (q, with_value(p, 2, 0, 0.71), k), "sum to 1"),
    "logits passed": (lambda q, p, k: (q.log(), p, k), "negative"),
    "token -1": (lambda q, p, k: (q, p, [0, -1]), "\\[0, 4\\)"),
    "token V": (lambda q, p, k: (q, p, [4, 0]), "\\[0, 4\\)"),
    "integer rows": (lambda q, p, k: (q, p.round().long(), k), "2-D|floating"),
}


@both_impls
@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_inputs_raise(impl, case):
    mutate, match = INVALID[case]
    with pytest.raises(ValueError, match=match):
        impl(*mutate(*valid_inputs()), gen())


def test_row_sum_tolerance_is_honoured():
    q, p, k = valid_inputs()
    nearly = with_value(p, 2, 0, 0.7 + ROW_SUM_TOL / 2)
    assert len(verify(q, nearly, k, gen()).tokens) >= 1


def test_valid_inputs_pass_with_tensor_tokens():
    q, p, k = valid_inputs()
    assert_same_result(verify(q, p, torch.tensor(k, dtype=torch.int32), gen(4)), verify(q, p, k, gen(4)))


# --- vectorised == reference; fixed randomness ----------------------------------------------


def random_round(seed: int):
    g = gen(seed)
    k = int(torch.randint(1, 6, (1,), generator=g))
    v = int(torch.randint(2, 13, (1,), generator=g))
    p = random_rows(k + 1, v, g)
    if seed % 3 == 0:  # draft close to the target: long accepted runs and bonuses
        q = 0.9 * p[:k] + 0.1 * random_rows(k, v, g)
    elif seed % 3 == 1:  # sparse rows with exact zeros
        params = SamplingParams(temperature=1.0, top_k=max(1, v // 2))
        p = logits_to_probs(torch.randn(k + 1, v, generator=g) * 2, params)
        q = logits_to_probs(torch.randn(k, v, generator=g) * 2, params)
    else:
        q = random_rows(k, v, g)
    tokens = sample_from(q, draw_uniform(k, g, "cpu"))
    return q, p, tokens


@pytest.mark.parametrize("seed", range(60))
def test_vectorised_matches_reference(seed):
    q, p, tokens = random_round(seed)
    for gseed in range(5):
        g_vec, g_ref = gen(1000 * seed + gseed), gen(1000 * seed + gseed)
        assert_same_result(verify(q, p, tokens, g_vec), verify_reference(q, p, tokens, g_ref))
        assert torch.equal(g_vec.get_state(), g_ref.get_state())


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.2, top_p=0.9), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=40)], ids=["top-p", "full", "top-k"])
def test_the_compiled_verdict_is_the_aten_paths(params, monkeypatch):
    """engine/native's chain_verdict against verify's ATen path on rows of SmolLM2's width, bit for bit: the tests'
    scalars, the accepted count, the final draw and the residual."""
    from engine import sampling

    if sampling.compiled_module() is None:
        pytest.skip("no compiled module on this machine")
    g, v, outcomes = gen(7), 49_152, set()
    for trial in range(40):
        k = 1 + trial % 5
        logits = torch.randn(k + 1, v, generator=g) * 4
        p = logits_to_probs(logits, params)
        q = logits_to_probs(logits[:k] + torch.randn(k, v, generator=g) * (0.2 + trial % 3), params)
        tokens = sample_from(q, draw_uniform(k, g, "cpu"))
        compiled = verify(q, p, tokens, gen(trial), validate=False)
        with monkeypatch.context() as m:
            m.setattr(sampling, "compiled_module", lambda: None)
            aten = verify(q, p, tokens, gen(trial), validate=False)
        assert_same_result(compiled, aten)
        outcomes.add((compiled.rejected, compiled.accepted_count > 0))
    assert outcomes == {(True, True), (True, False), (False, True)}


def test_outcomes_cover_accept_reject_and_bonus_across_seeds():
    # Guard that the equivalence test above exercises every path.
    results = [verify(*random_round(s), gen(1000 * s)) for s in range(60)]
    assert any(r.rejected and r.accepted_count > 0 for r in results)
    assert any(r.rejected and r.accepted_count == 0 for r in results)
    assert any(not r.rejected and len(r.tokens) >= 3 for r in results)


@both_impls
def test_random_consumption_is_fixed_whatever_the_outcome(impl):
    k = 3
    expected = gen(11)
    draw_uniform(k, expected, "cpu")
    draw_uniform(1, expected, "cpu")
    q = t([one_hot(4, 0)] * k)
    all_accept = t([one_hot(4, 0)] * (k + 1))
    reject_first = t([one_hot(4, 1)] * (k + 1))
    reject_last = t([one_hot(4, 0)] * (k - 1) + [one_hot(4, 2)] * 2)
    outcomes = []
    for p in (all_accept, reject_first, reject_last):
        g = gen(11)
        outcomes.append(impl(q, p, [0] * k, g).accepted_count)
        assert torch.equal(g.get_state(), expected.get_state())
    assert outcomes == [3, 0, 2]


# --- align_vocab ----------------------------------------------------------------------------


def test_align_vocab_pads_logits_with_minus_inf_so_padding_is_never_sampled():
    logits = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    out = align_vocab(logits, 4, fill=-math.inf)
    assert out.shape == (2, 4)
    assert torch.equal(out[:, :2], logits)
    assert bool(torch.isneginf(out[:, 2:]).all())
    probs = logits_to_probs(out, SamplingParams(temperature=1.0))
    assert bool((probs[:, 2:] == 0).all())


def test_align_vocab_truncates_and_pads_probabilities_with_zero():
    x = torch.arange(8.0).view(2, 4)
    assert torch.equal(align_vocab(x, 2, fill=0.0), x[:, :2])
    assert torch.equal(align_vocab(x, 4, fill=0.0), x)
    assert torch.equal(align_vocab(x[:, :3], 4, fill=0.0), torch.tensor([[0.0, 1, 2, 0], [4, 5, 6, 0]]))


def test_align_vocab_moves_device_and_dtype():
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    out = align_vocab(x, 5, fill=-math.inf, dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out[:, :3], x.float())
    meta = align_vocab(x, 5, fill=0.0, device="meta", dtype=torch.float64)
    assert meta.device.type == "meta" and meta.shape == (2, 5) and meta.dtype == torch.float64


def test_align_vocab_validation():
    with pytest.raises(ValueError, match="2-D"):
        align_vocab(torch.zeros(3), 4, fill=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        align_vocab(torch.zeros(1, 3), 0, fill=0.0)


# --- goodness of fit ------------------------------------------------------------------------


def test_goodness_of_fit_known_values():
    fit = goodness_of_fit(torch.tensor([60, 40]), torch.tensor([0.5, 0.5]))
    assert (fit.statistic, fit.dof, fit.n) == (pytest.approx(4.0), 1, 100)
    assert fit.p_value == pytest.approx(0.0455003, rel=1e-5)  # P(chi2_1 >= 4)
    exact = goodness_of_fit(torch.tensor([25, 25, 50]), torch.tensor([0.25, 0.25, 0.5]))
    assert (exact.statistic, exact.dof, exact.p_value) == (0.0, 2, 1.0)


def test_goodness_of_fit_pools_small_cells_and_flags_impossible_tokens():
    p = torch.tensor([0.49, 0.49, 0.01, 0.01])  # with n = 100 the last two expect 1 each
    pooled = goodness_of_fit(torch.tensor([48, 50, 1, 1]), p)
    assert pooled.dof == 1  # [49, 49, 2] -> the small bin (2 < 5) merges into a big cell
    impossible = goodness_of_fit(torch.tensor([50, 49, 1]), torch.tensor([0.5, 0.5, 0.0]))
    assert (impossible.statistic, impossible.p_value, impossible.passed) == (math.inf, 0.0, False)
    one_hot_fit = goodness_of_fit(torch.tensor([0, 7, 0]), torch.tensor([0.0, 1.0, 0.0]))
    assert (one_hot_fit.dof, one_hot_fit.p_value) == (0, 1.0)


def test_passes_needs_results():
    with pytest.raises(ValueError):
        passes([])


# --- simulate agrees with verify draw for draw ----------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_simulate_correct_rule_is_verify(seed):
    g = gen(seed)
    k, v = 1 + seed % 4, 6
    p = random_rows(k + 1, v, g)
    q = 0.6 * p[:k] + 0.4 * random_rows(k, v, g)
    counts = simulate(q, p, Rule.CORRECT, 1, gen(seed + 500))
    g_round = gen(seed + 500)
    drafts = sample_from(q, draw_uniform(k, g_round, "cpu"))
    tokens = verify(q, p, drafts, g_round).tokens
    emitted = [int(row.argmax()) for row in counts if int(row.sum()) == 1]
    assert int(counts.sum()) == len(tokens)
    assert emitted == tokens


# --- losslessness, statistically ------------------------------------------------------------


def processed_case(seed: int, k: int, v: int, draft: SamplingParams, target: SamplingParams, shift: float = 0.7):
    """Target and draft rows from correlated random logits, processed like the engine does."""
    g = gen(seed)
    target_logits = torch.randn(k + 1, v, generator=g) * 2
    draft_logits = target_logits[:k] + shift * torch.randn(k, v, generator=g) * 2
    return logits_to_probs(draft_logits, draft), logits_to_probs(target_logits, target)


def unlike_case(seed: int, k: int, v: int):
    """A draft that puts its mass where the target puts little."""
    g = gen(seed)
    target_logits = torch.randn(k + 1, v, generator=g) * 1.5
    return torch.softmax(-2 * target_logits[:k], -1), torch.softmax(target_logits, -1)


LOSSLESS_CASES = {
    "greedy target, greedy draft": lambda: processed_case(7, 3, 8, SamplingParams(), SamplingParams(), shift=0.5),
    "greedy target, sampled draft": lambda: processed_case(2, 2, 8, SamplingParams(temperature=1.0), SamplingParams()),
    "temperature 0.7": lambda: processed_case(3, 4, 10, SamplingParams(0.7), SamplingParams(0.7)),
    "temperature 1.3": lambda: processed_case(4, 1, 12, SamplingParams(1.3), SamplingParams(1.3)),
    "top-k 4": lambda: processed_case(5, 3, 12, SamplingParams(1.0, top_k=4), SamplingParams(1.0, top_k=4)),
    "top-p 0.8": lambda: processed_case(6, 3, 10, SamplingParams(1.0, top_p=0.8), SamplingParams(1.0, top_p=0.8)),
    "top-k 6 + top-p 0.9": lambda: processed_case(7, 2, 12, SamplingParams(0.9, 6, 0.9), SamplingParams(0.9, 6, 0.9)),
    "draft unlike target": lambda: unlike_case(8, 4, 10),
}


@pytest.mark.parametrize("case", list(LOSSLESS_CASES))
def test_correct_rule_is_lossless(case):
    q, p = LOSSLESS_CASES[case]()
    results = check_rule(q, p, Rule.CORRECT, TRIALS, gen(123), alpha_level=SIGNIFICANCE)
    assert results and results[0].index == 0 and results[0].n == TRIALS  # index 0 is always emitted
    assert passes(results), [(r.index, r.p_value) for r in results]


def test_verify_itself_is_lossless():
    # Direct, not via simulate: 8,000 real rounds through verify (K = 2, V = 5).
    g = gen(77)
    p = random_rows(3, 5, g, scale=1.0)
    q = torch.softmax(torch.randn(2, 5, generator=g), -1)
    counts = torch.zeros(3, 5, dtype=torch.long)
    for _ in range(8_000):
        drafts = sample_from(q, draw_uniform(2, g, "cpu"))
        for i, token in enumerate(verify(q, p, drafts, g, validate=False).tokens):
            counts[i, token] += 1
    fits = [goodness_of_fit(counts[i], p[i], alpha_level=SIGNIFICANCE) for i in range(3)]
    assert passes(fits), [f.p_value for f in fits]


def wrong_rule_case(rule: Rule):
    """A case where the rule's bug changes the output distribution a lot."""
    v, k = 8, 2
    if rule is Rule.BONUS_FROM_ROW_K_MINUS_1:
        # Draft equals the target on rows 0..K-1 (everything accepted), rows K-1 and K differ.
        p = t([[1 / v] * v, [0.65] + [0.05] * 7, [0.05] * 7 + [0.65]])
        return p[:k].clone(), p
    # Draft concentrated where the target is thin: many rejections, min(p, q) far from p.
    p = t([[0.3, 0.3, 0.2, 0.1, 0.05, 0.03, 0.01, 0.01]] * (k + 1))
    q = t([[0.01, 0.01, 0.03, 0.05, 0.1, 0.2, 0.3, 0.3]] * k)
    return q, p


@pytest.mark.parametrize("rule", [r for r in Rule if r is not Rule.CORRECT])
def test_wrong_rules_are_caught(rule):
    q, p = wrong_rule_case(rule)
    control = check_rule(q, p, Rule.CORRECT, TRIALS, gen(9), alpha_level=SIGNIFICANCE)
    assert passes(control), [(r.index, r.p_value) for r in control]
    results = check_rule(q, p, rule, TRIALS, gen(9), alpha_level=SIGNIFICANCE)
    assert not passes(results)
    assert min(r.p_value for r in results) < SIGNIFICANCE
    if rule is Rule.BONUS_FROM_ROW_K_MINUS_1:
        assert [r.index for r in results if not r.passed] == [2]  # only the bonus index is wrong


# --- verify_greedy: the greedy fast path ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_verify_greedy_is_verify_on_one_hot_rows(seed: int) -> None:
    """Same tokens, verdicts, uniforms, residual and generator state as `verify` on the one-hot rows."""
    g = torch.Generator().manual_seed(seed)
    k, v = int(torch.randint(1, 9, (1,), generator=g)), 50
    target_ids = torch.randint(0, v, (k + 1,), generator=g)
    drafts = target_ids[:k].clone()
    wrong = int(torch.randint(0, k + 1, (1,), generator=g))  # k = all accepted
    if wrong < k:
        drafts[wrong] = (drafts[wrong] + 1 + int(torch.randint(0, v - 1, (1,), generator=g))) % v
    greedy = SamplingParams()
    q = logits_to_probs(torch.nn.functional.one_hot(drafts, v).float(), greedy)
    p = logits_to_probs(torch.nn.functional.one_hot(target_ids, v).float(), greedy)
    ga, gb = gen(seed), gen(seed)
    fast = verify_greedy(drafts.tolist(), target_ids.tolist(), v, ga)
    full = verify(q, p, drafts.tolist(), gb)
    assert_same_result(fast, full)
    assert fast.accepted_count == min(wrong, k) and fast.rejected == (wrong < k)
    assert torch.equal(ga.get_state(), gb.get_state())


def test_verify_greedy_needs_k_plus_one_argmaxes() -> None:
    with pytest.raises(ValueError, match="K \\+ 1 = 4"):
        verify_greedy([1, 2, 3], [1, 2, 3], 10)

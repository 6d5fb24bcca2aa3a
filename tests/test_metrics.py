"""Tests for engine.metrics: the two acceptance measures, the speed-up model and its inputs, on numbers and
on hand-built rounds."""
import math
import statistics
from dataclasses import replace

import pytest

from engine import metrics
from engine.config import DrafterKind, Mode
from engine.metrics import (
    NotMeasured,
    acceptance_rate,
    alpha_rate,
    best_k,
    expected_tokens_from_rates,
    expected_tokens_per_round,
    mean_accepted_length,
    per_position_acceptance,
    predicted_over_rounds,
    predicted_speedup,
)
from engine.records import FinalRecord, Outcome, PositionRecord, RoundRecord, RoundTimings


def make_round(index: int, outcomes: str, *, draft_ms: float = 0.5, target_ms: float = 10.0,
               elapsed_s: float = 0.0, tokens_total: int = 0, mode: Mode = Mode.V2) -> RoundRecord:
    """A round from a string of outcomes: 'a' accepted, 'r' rejected, 'u' unchecked ('' drafts nothing)."""
    kinds = {"a": Outcome.ACCEPTED, "r": Outcome.REJECTED, "u": Outcome.UNCHECKED}
    positions = [PositionRecord(i, 10 + i, "", 0.5, None, None, None, kinds[c]) for i, c in enumerate(outcomes)]
    accepted = outcomes.count("a")
    rejected = "r" in outcomes
    final = FinalRecord(99, "", Outcome.CORRECTED if rejected else Outcome.BONUS, accepted, 0.5, 0.5)
    k = len(outcomes)
    timings = RoundTimings(0.0, draft_ms * k, target_ms, 0.0, 0.0, target_ms + draft_ms * k, target_ms,
                           [draft_ms] * k)
    return RoundRecord(index, mode, DrafterKind.MODEL if mode is not Mode.TARGET else None,
                       DrafterKind.MODEL if k else None, k, positions, final, [1] * (accepted + 1), "", accepted, [],
                       timings, 1, k, tokens_total, elapsed_s, False)


def test_acceptance_rate_and_alpha_validate():
    assert acceptance_rate(3, 4) == 0.75 and alpha_rate(3, 4) == 0.75
    assert acceptance_rate(0, 0) == 0.0 and alpha_rate(0, 0) == 0.0
    for bad in ((5, 4), (-1, 4), (0, -1)):
        with pytest.raises(ValueError):
            acceptance_rate(*bad)
        with pytest.raises(ValueError):
            alpha_rate(*bad)


def test_alpha_counts_verified_positions_and_draft_rate_counts_drafts():
    # K = 4: accept 2 then reject (2 unchecked); accept all 4; reject the first (3 unchecked).
    rounds = [make_round(0, ""), make_round(1, "aaru"), make_round(2, "aaaa"), make_round(3, "ruuu")]
    rounds[1] = make_round(1, "aaru")
    assert metrics.draft_acceptance(rounds) == pytest.approx(6 / 12)
    # verified: 3 + 4 + 1 = 8 positions, 6 of them accepted
    assert metrics.alpha(rounds) == pytest.approx(6 / 8)
    assert [r.verified for r in rounds] == [0, 3, 4, 1]


def test_running_acceptance_is_each_prefix_measured_again():
    rounds = [make_round(0, ""), make_round(1, "aaru"), make_round(2, ""), make_round(3, "ruuu"), make_round(4, "aaaa")]
    drafted, alphas = metrics.running_acceptance(rounds)
    assert drafted == [metrics.draft_acceptance(rounds[: i + 1]) for i in range(len(rounds))]
    assert alphas == [metrics.alpha(rounds[: i + 1]) for i in range(len(rounds))]
    assert drafted[:2] == [None, pytest.approx(2 / 4)] and alphas[3] == pytest.approx(2 / 4)


def test_the_formula_is_fed_alpha_not_the_draft_rate():
    """Under i.i.d. acceptance, accepted / drafted = a (1 - a^K) / (K (1 - a)): plugging it into E(a, K)
    under-predicts the tokens per round; alpha reproduces them."""
    a, k = 0.75, 4
    draft_rate = a * (1 - a**k) / (k * (1 - a))
    e = expected_tokens_per_round(a, k)
    assert expected_tokens_per_round(draft_rate, k) < 0.85 * e
    # The exact expectation over every outcome pattern of a K=4 round with per-position probability a:
    patterns = [("a" * i + "r" + "u" * (k - i - 1), a**i * (1 - a)) for i in range(k)] + [("a" * k, a**k)]
    tokens = sum(p * (s.count("a") + 1) for s, p in patterns)
    verified = sum(p * (s.count("a") + s.count("r")) for s, p in patterns)
    accepted = sum(p * s.count("a") for s, p in patterns)
    assert tokens == pytest.approx(e)
    assert accepted / verified == pytest.approx(a)          # what metrics.alpha measures
    assert accepted / k == pytest.approx(draft_rate)         # what accepted / drafted measures


def test_mean_accepted_length():
    assert mean_accepted_length([1, 5, 3]) == 3.0
    assert mean_accepted_length([]) == 0.0
    with pytest.raises(ValueError):
        mean_accepted_length([2, -1])


def test_per_position_acceptance_counts_only_rounds_that_checked_the_position():
    rounds = [[True, True, False], [False], [True, True, True], [True, False]]
    rates = per_position_acceptance(rounds, k_max=4)
    assert rates[:3] == [3 / 4, 2 / 3, 1 / 2]
    assert math.isnan(rates[3])  # no round reached position 3


def test_position_rates_from_records_skip_unchecked_drafts():
    rounds = [make_round(1, "aaru"), make_round(2, "aaaa"), make_round(3, "ruuu")]
    assert metrics.position_rates(rounds) == pytest.approx([2 / 3, 2 / 2, 1 / 2, 1.0])


def test_per_position_acceptance_validation():
    with pytest.raises(ValueError, match="k_max"):
        per_position_acceptance([[True, True, True]], k_max=2)
    with pytest.raises(ValueError, match="after a rejection"):
        per_position_acceptance([[False, True]], k_max=2)
    with pytest.raises(ValueError):
        per_position_acceptance([], k_max=0)


def test_expected_tokens_per_round_formula():
    assert expected_tokens_per_round(0.6, 4) == pytest.approx((1 - 0.6**5) / 0.4)
    assert expected_tokens_per_round(0.0, 3) == 1.0
    assert expected_tokens_per_round(0.8, 1) == pytest.approx(1.8)
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert expected_tokens_per_round(1.0 - 1e-12, 5) == pytest.approx(6.0, abs=1e-9)


def test_expected_tokens_from_rates_is_the_product_form():
    rates = [0.9, 0.5, 0.4]
    assert expected_tokens_from_rates(rates, 3) == pytest.approx(1 + 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.4)
    # Equal rates give the i.i.d. formula; missing positions take the last measured rate.
    assert expected_tokens_from_rates([0.6], 4) == pytest.approx(expected_tokens_per_round(0.6, 4))
    assert expected_tokens_from_rates([0.6, math.nan], 2) == pytest.approx(1 + 0.6 + 0.36)
    with pytest.raises(ValueError):
        expected_tokens_from_rates([math.nan], 2)
    with pytest.raises(ValueError):
        expected_tokens_from_rates([1.2], 2)


def test_predicted_speedup():
    # E(0.6, 4) = 2.3056; cost = 0.05 * 4 + 1.5 = 1.7
    assert predicted_speedup(0.6, 4, 0.05, 1.5) == pytest.approx(2.3056 / 1.7)
    assert predicted_speedup(1.0, 3, 0.0, 1.0) == 4.0


def test_predicted_over_rounds_is_the_constant_k_formula_for_constant_k():
    r = lambda n: 1 + 0.1 * (n - 1)  # noqa: E731
    e = lambda k: expected_tokens_per_round(0.7, k)  # noqa: E731
    assert predicted_over_rounds(e, [4, 4, 4], [4, 4, 4], 0.1, r) == pytest.approx(predicted_speedup(0.7, 4, 0.1, r(5)))
    # A round that drafted nothing is one plain step for one token; a copied round costs no draft forward.
    assert predicted_over_rounds(e, [0, 2], [0, 0], 0.5, r) == pytest.approx((1 + e(2)) / (1 + r(3)))


@pytest.mark.parametrize("alpha, c", [(0.6, 0.05), (0.9, 0.1), (0.3, 0.2), (0.95, 0.01), (0.0, 0.1)])
def test_best_k_matches_brute_force(alpha, c):
    r = lambda n: 1 + 0.15 * (n - 1)  # noqa: E731
    values = [((1 - alpha ** (k + 1)) / (1 - alpha)) / (c * k + r(k + 1)) for k in range(1, 17)]
    brute = 1 + next(i for i, v in enumerate(values) if v >= max(values) * (1 - metrics.TIE_RTOL))
    assert best_k(alpha, c, r) == brute


def test_a_growing_verify_cost_pulls_the_best_k_down():
    assert best_k(0.9, 0.05, lambda n: 1.0 + 0.3 * (n - 1), k_max=8) < best_k(0.9, 0.05, 1.0, k_max=8)
    assert best_k(1.0, 0.0, 1.0, k_max=16) == 16   # free, perfect drafts: as many as allowed
    # c = 0 and alpha < 1: the curve creeps up by rounding once alpha^K underflows; ties go to the smaller K.
    assert best_k(0.1, 0.0, 1.0, k_max=16) < 16


def test_predict_on_hand_built_rounds():
    baseline = [make_round(i, "", target_ms=10.0, mode=Mode.TARGET) for i in range(5)]
    # verify forwards of 14 ms: the run's own r(5) is the calibration's 1.4 (`test_a_run_reads_r_from_its_own_...`)
    rounds = [make_round(0, "", target_ms=50.0)] + [make_round(i, "aaru", draft_ms=1.0, target_ms=14.0)
                                                     for i in range(1, 4)]
    r_of_n = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    pred = metrics.predict(rounds, baseline, r_of_n)
    assert pred.alpha == pytest.approx(2 / 3) and pred.draft_acceptance == pytest.approx(0.5)
    assert pred.c == pytest.approx(0.1) and pred.k == 4 and pred.r == pytest.approx(1.4)
    assert pred.speedup_iid == pytest.approx(expected_tokens_per_round(2 / 3, 4) / (0.1 * 4 + 1.4))
    assert pred.rates == pytest.approx([1.0, 1.0, 0.0, math.nan], nan_ok=True)
    assert pred.tokens_rates == pytest.approx(3.0) and pred.tokens_measured == pytest.approx(3.0)
    assert isinstance(metrics.predict(rounds, baseline, None), NotMeasured)           # r never assumed
    assert isinstance(metrics.predict(rounds, [], r_of_n), NotMeasured)               # no baseline timing
    assert isinstance(metrics.predict(rounds[:1], baseline, r_of_n), NotMeasured)     # nothing drafted


def test_v1_rounds_pay_their_commit_forward_in_every_prediction():
    """v1 verifies without writing, then commits the round's tokens (the last committed one and the accepted drafts:
    as many as the round emits) in a second target forward: the formula counts it, r(E) of a step, or v1's
    prediction would be v2's (on the built-in pair 2.15x against a measured 1.23x)."""
    r_of_n = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    baseline = [make_round(i, "", target_ms=10.0, mode=Mode.TARGET) for i in range(5)]
    v2 = [make_round(0, "", target_ms=50.0)] + [make_round(i, "aaru", draft_ms=1.0, target_ms=14.0)
                                                 for i in range(1, 4)]
    v1 = [replace(r, mode=Mode.V1) for r in v2]
    e = expected_tokens_per_round(2 / 3, 4)
    commit = r_of_n(metrics.commit_rows(e))
    assert metrics.commit_rows(e) == round(e) and metrics.commit_rows(0.2) == 1
    one, two = metrics.predict(v1, baseline, r_of_n), metrics.predict(v2, baseline, r_of_n)
    assert one.commit and not two.commit
    assert one.speedup_iid == pytest.approx(e / (0.1 * 4 + 1.4 + commit))
    assert two.speedup_iid == pytest.approx(e / (0.1 * 4 + 1.4))
    assert predicted_speedup(2 / 3, 4, 0.1, 1.4, commit) == pytest.approx(one.speedup_iid)
    # the curve over K and its best K carry it too; a second forward per round pulls the best K up (it is
    # paid once a round, however many drafts the round carries)
    curve = metrics.speedup_curve(0.8, 0.05, r_of_n, 8, commit=True)
    assert curve[2] == pytest.approx(predicted_speedup(0.8, 3, 0.05, r_of_n(4),
                                                       r_of_n(metrics.commit_rows(expected_tokens_per_round(0.8, 3)))))
    assert best_k(0.8, 0.05, r_of_n, 8, commit=True) >= best_k(0.8, 0.05, r_of_n, 8)
    # a round that drafted nothing still commits its one token in v1: two forwards for one token
    assert predicted_over_rounds(lambda k: 1.0, [0], [0], 0.1, r_of_n, commit=True) == pytest.approx(1 / (1 + 1))
    assert metrics.formula_text(True).endswith("+ r(E))") and "r(E)" not in metrics.formula_text()


def test_a_tally_grown_round_by_round_gives_every_prefix_its_own_measures():
    baseline = [make_round(i, "", target_ms=10.0 + i, mode=Mode.TARGET) for i in range(6)]
    rounds = [make_round(0, "", target_ms=50.0), make_round(1, "aaru", draft_ms=1.0), make_round(2, ""),
              make_round(3, "ar", draft_ms=3.0), make_round(4, "aaaa", draft_ms=2.0)]
    r_of_n = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    tally = metrics.Tally()
    for n, r in enumerate(rounds, 1):
        tally.add(r)
        tally.add_baseline(baseline[n - 1])
        decode, steps = rounds[1:n], baseline[1:n]
        drafted = [d for d in decode if d.k]
        if not drafted:
            assert tally.cost_ratio() is None and tally.alpha() is None and tally.speedup_iid(r_of_n) is None
            continue
        c = statistics.median(t for d in decode for t in d.timings.draft_forward_ms) / statistics.median(
            b.timings.target_forward_ms for b in steps)
        a = sum(d.accepted for d in drafted) / sum(d.verified for d in drafted)
        e = lambda k: sum(a**i for i in range(k + 1)) if k else 1.0  # noqa: E731
        speedup = sum(e(d.k) for d in decode) / sum(c * d.draft_forwards + (r_of_n(d.k + 1) if d.k else 1.0)
                                                    for d in decode)
        assert tally.cost_ratio() == pytest.approx(c) and tally.alpha() == pytest.approx(a)
        assert tally.speedup_iid(r_of_n) == pytest.approx(speedup)
        assert tally.speedup_iid(None) is None                                             # r never assumed
        assert metrics.predict(rounds[:n], baseline[:n], r_of_n).speedup_iid == pytest.approx(speedup)


def test_prompt_lookup_rounds_cost_no_draft_forward():
    baseline = [make_round(i, "", mode=Mode.TARGET) for i in range(3)]
    lookup = replace(make_round(1, "ar", draft_ms=0.0), draft_forwards=0,
                     timings=replace(make_round(1, "ar").timings, draft_forward_ms=[]))
    assert metrics.Tally.of([make_round(0, ""), lookup], baseline).cost_ratio() == 0.0
    assert metrics.cost_ratio([make_round(0, ""), lookup], baseline) == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens_per_round(-0.1, 4),
        lambda: expected_tokens_per_round(1.1, 4),
        lambda: expected_tokens_per_round(0.5, 0),
        lambda: predicted_speedup(0.5, 4, -0.1, 1.0),
        lambda: predicted_speedup(0.5, 4, 0.1, 0.0),
        lambda: predicted_speedup(math.nan, 4, 0.1, 1.0),
        lambda: best_k(0.5, 0.1, k_max=0),
        lambda: best_k(0.5, 0.1, r_of_n=lambda n: -1.0),
        lambda: metrics.alpha_interval([]),
        lambda: metrics.alpha_interval([(1, 2)], [(1, 2), (0, 1)]),
        lambda: metrics.alpha_interval([(1, 2)], level=1.0),
    ],
)
def test_validation_errors(call):
    with pytest.raises(ValueError):
        call()


def test_prompt_counts_sum_the_drafted_rounds_of_one_prompt():
    rounds = [make_round(0, ""), make_round(1, "aar"), make_round(2, "aaaa"), make_round(3, "ruu")]
    assert metrics.prompt_counts(rounds) == (6, 8)
    assert metrics.prompt_counts(rounds) == (sum(r.accepted for r in rounds), sum(r.verified for r in rounds))


def test_the_alpha_interval_is_the_ratio_of_sums_and_a_head_against_itself_differs_by_nothing():
    counts = [(10, 40), (30, 50), (5, 30)]
    value, lo, hi = metrics.alpha_interval(counts)
    assert value == pytest.approx(45 / 120) and lo < value < hi
    assert metrics.alpha_interval(counts, counts) == (0.0, 0.0, 0.0)
    assert metrics.alpha_interval(counts, [(a - 5, v) for a, v in counts])[0] == pytest.approx(15 / 120)


def _population(rng, size=2000):
    """Prompts of unequal difficulty and length: each a (true alpha, verified positions)."""
    return [(min(0.95, max(0.05, rng.gauss(0.5, 0.15))), rng.randint(15, 60)) for _ in range(size)]


def test_the_alpha_interval_covers_the_populations_alpha_about_as_often_as_it_says():
    import random

    rng = random.Random(7)
    population = _population(rng)
    # the population's alpha: expected accepted over expected verified
    truth = sum(a * v for a, v in population) / sum(v for _, v in population)
    covered = 0
    trials = 150
    for t in range(trials):
        sample = rng.sample(population, 24)
        counts = [(sum(rng.random() < a for _ in range(v)), v) for a, v in sample]
        _, lo, hi = metrics.alpha_interval(counts, draws=500, seed=t)
        covered += lo <= truth <= hi
    # a percentile bootstrap over 24 prompts runs a little narrow; one over positions, not prompts, would
    # cover far less often (prompts differ far more than binomial noise within one)
    assert 0.85 <= covered / trials <= 0.99


def test_pairing_tells_a_small_steady_gain_from_chance_where_two_separate_intervals_overlap():
    import random

    rng = random.Random(3)
    prompts = _population(rng, 32)
    base, better = [], []
    for a, v in prompts:        # the second head accepts 2 more positions of every 50 on every prompt
        accepted = sum(rng.random() < a for _ in range(v))
        base.append((accepted, v))
        better.append((min(v, accepted + max(1, round(0.04 * v))), v))
    assert metrics.alpha_interval(better, base)[1] > 0
    assert metrics.alpha_interval(better)[1] < metrics.alpha_interval(base)[2]    # apart, the two intervals overlap


def test_measured_over_predicted_is_taken_apart_into_tokens_verify_and_the_rest():
    """Hand-built rounds whose verify forwards cost 1.5 target steps where the calibration says 1.4, which yield
    3 tokens a round where E(2/3, 4) expects 2.11, and whose wall time is given: the three factors are those
    ratios, and their product is what the summary prints as measured / predicted. Once the run has verified
    OWN_R_LEAST times at K + 1 rows, the prediction reads its own r and the verify factor is 1."""
    step, verify_ms, draft_ms = 10.0, 15.0, 1.0
    baseline = [make_round(i, "", target_ms=step, mode=Mode.TARGET, elapsed_s=0.01 * (i + 1), tokens_total=i + 1)
                for i in range(13)]
    rounds = [make_round(0, "", target_ms=50.0, elapsed_s=0.05, tokens_total=1)] + [
        make_round(i, "aaru", draft_ms=draft_ms, target_ms=verify_ms, elapsed_s=0.05 + 0.025 * i,
                   tokens_total=1 + 3 * i) for i in range(1, 5)]
    r_of_n = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    e = expected_tokens_per_round(2 / 3, 4)
    assert metrics.OWN_R_LEAST == 3
    for upto, verify in ((3, (0.1 * 4 + 1.4) / (0.1 * 4 + verify_ms / step)), (5, 1.0)):
        gap = metrics.prediction_gap(rounds[:upto], baseline, r_of_n)
        assert gap.tokens == pytest.approx(3 / e)
        assert gap.verify == pytest.approx(verify)
        measured = metrics.decode_speedup(rounds[:upto], baseline)
        predicted = metrics.predict(rounds[:upto], baseline, r_of_n).speedup_iid
        assert gap.tokens * gap.verify * gap.rest == pytest.approx(measured / predicted)
        assert gap.rest != pytest.approx(1.0)          # these rounds' wall time is not their forwards'
    assert metrics.prediction_gap(rounds, baseline, None) is None and metrics.prediction_gap(rounds[:1], baseline,
                                                                                           r_of_n) is None


def test_a_run_reads_r_from_its_own_verify_forwards_once_it_has_enough_and_the_best_k_from_the_calibration():
    """Verify forwards of 5 rows at 15 ms against 10 ms target-only steps: r(5) is 1.5 in this run, where the
    calibration says 1.4. Two such rounds: the prediction reads the calibration; three: its own 1.5, in the
    speed-up and in r, while the best K is the calibration's curve's alone (one source over every K)."""
    baseline = [make_round(i, "", target_ms=10.0, mode=Mode.TARGET) for i in range(5)]
    rounds = [make_round(0, "", target_ms=50.0)] + [make_round(i, "aaru", draft_ms=1.0, target_ms=15.0)
                                                     for i in range(1, 4)]
    r_of_n = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    e = expected_tokens_per_round(2 / 3, 4)
    early, later = metrics.predict(rounds[:3], baseline, r_of_n), metrics.predict(rounds, baseline, r_of_n)
    assert early.r == pytest.approx(1.4) and early.r_forwards == 0 and early.r_calibrated == pytest.approx(1.4)
    assert early.speedup_iid == pytest.approx(e / (0.1 * 4 + 1.4))
    assert later.r == pytest.approx(1.5) and later.r_forwards == 3 and later.r_calibrated == pytest.approx(1.4)
    assert later.speedup_iid == pytest.approx(e / (0.1 * 4 + 1.5))
    assert later.speedup_rates == pytest.approx(3.0 / (0.1 * 4 + 1.5))
    assert later.best_k == best_k(2 / 3, 0.1, r_of_n, 16)
    tally = metrics.Tally.of(rounds, baseline)
    assert tally.own_r(5) == pytest.approx(1.5) and tally.own_r(3) is None and tally.r_used(None) is None
    assert tally.r_used(r_of_n)(3) == pytest.approx(1.2)          # no forward of 3 rows: the calibration's
    assert metrics.Tally.of(rounds).own_r(5) is None              # no target-only step to compare with


def test_the_decode_speedup_leaves_out_each_runs_prefill_round():
    """Target-only: a 30 ms prefill, then a token every 10 ms. Speculative: a 130 ms prefill (a slow first forward),
    then 3 tokens every 20 ms. After the prefill that is 150 against 100 tokens/s, whatever either prefill cost;
    the speed-up with the prefill counts the slow one. A run that has only prefilled has no decode speed-up."""
    baseline = [make_round(i, "", mode=Mode.TARGET, elapsed_s=0.03 + 0.01 * i, tokens_total=i + 1) for i in range(13)]
    rounds = [make_round(0, "", elapsed_s=0.13, tokens_total=1)] + [
        make_round(i, "aaru", elapsed_s=0.13 + 0.02 * i, tokens_total=1 + 3 * i) for i in range(1, 5)]
    assert metrics.decode_tokens_per_s(rounds) == pytest.approx(150.0)
    assert metrics.decode_tokens_per_s(baseline) == pytest.approx(100.0)
    assert metrics.decode_speedup(rounds, baseline) == pytest.approx(1.5)
    assert metrics.measured_speedup(rounds, baseline) == pytest.approx((13 / 0.21) / (13 / 0.15))   # 0.71×
    assert metrics.decode_speedup(rounds[:1], baseline[:1]) is None
    assert metrics.decode_speedup(rounds[1:], baseline) is None        # no prefill round to start after

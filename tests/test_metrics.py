"""Tests for engine.metrics: the standard definitions and the speed-up model."""
import math

import pytest

from engine.metrics import (
    acceptance_rate,
    best_k,
    expected_tokens_per_round,
    mean_accepted_length,
    per_position_acceptance,
    predicted_speedup,
)


def test_acceptance_rate():
    assert acceptance_rate(3, 4) == 0.75
    assert acceptance_rate(0, 0) == 0.0
    for bad in ((5, 4), (-1, 4), (0, -1)):
        with pytest.raises(ValueError):
            acceptance_rate(*bad)


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


def test_per_position_acceptance_validation():
    with pytest.raises(ValueError, match="k_max"):
        per_position_acceptance([[True, True, True]], k_max=2)
    with pytest.raises(ValueError, match="after a rejection"):
        per_position_acceptance([[False, True]], k_max=2)
    with pytest.raises(ValueError):
        per_position_acceptance([], k_max=0)


def test_expected_tokens_per_round_formula():
    assert expected_tokens_per_round(0.6, 4) == pytest.approx((1 - 0.6**5) / 0.4)
    assert expected_tokens_per_round(0.6, 4) == pytest.approx(2.3056)
    assert expected_tokens_per_round(0.0, 3) == 1.0
    assert expected_tokens_per_round(0.8, 1) == pytest.approx(1.8)


def test_expected_tokens_alpha_to_one_limit():
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert expected_tokens_per_round(1.0 - 1e-12, 5) == pytest.approx(6.0, abs=1e-9)


def test_predicted_speedup():
    # E(0.6, 4) = 2.3056; cost = 0.05 * 4 + 1 = 1.2
    assert predicted_speedup(0.6, 4, 0.05) == pytest.approx(2.3056 / 1.2)
    assert predicted_speedup(0.6, 4, 0.05, r=1.5) == pytest.approx(2.3056 / 1.7)
    assert predicted_speedup(1.0, 3, 0.0) == 4.0


@pytest.mark.parametrize("alpha, c", [(0.6, 0.05), (0.9, 0.1), (0.3, 0.2), (0.95, 0.01), (0.0, 0.1)])
def test_best_k_matches_brute_force(alpha, c):
    brute = max(range(1, 17), key=lambda k: ((1 - alpha ** (k + 1)) / (1 - alpha)) / (c * k + 1))
    assert best_k(alpha, c) == brute


def test_best_k_with_verify_cost_growing_in_k():
    r_of_k = lambda k: 1.0 + 0.3 * k  # noqa: E731
    brute = max(range(1, 9), key=lambda k: predicted_speedup(0.9, k, 0.05, r_of_k(k)))
    assert best_k(0.9, 0.05, r_of_k, k_max=8) == brute
    # A growing verify cost pulls the optimum below the constant-cost one.
    assert best_k(0.9, 0.05, r_of_k, k_max=8) < best_k(0.9, 0.05, 1.0, k_max=8)


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens_per_round(-0.1, 4),
        lambda: expected_tokens_per_round(1.1, 4),
        lambda: expected_tokens_per_round(0.5, 0),
        lambda: predicted_speedup(0.5, 4, -0.1),
        lambda: predicted_speedup(0.5, 4, 0.1, r=0.0),
        lambda: predicted_speedup(math.nan, 4, 0.1),
        lambda: best_k(0.5, 0.1, k_max=0),
        lambda: best_k(0.5, 0.1, r_of_k=lambda k: -1.0),
    ],
)
def test_validation_errors(call):
    with pytest.raises(ValueError):
        call()

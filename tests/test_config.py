"""engine.config: every bound is checked with a message naming the field, enums are accepted by value,
and the schedule moves K as documented."""
from __future__ import annotations

import pytest

from engine.config import K_BOUND, DrafterKind, KSchedule, Mode, SpecConfig, TreeSpec


def test_values_become_enums_and_bad_ones_are_named():
    c = SpecConfig(mode="v1", drafter="eagle-hybrid", k_schedule="heuristic")
    assert (c.mode, c.drafter, c.k_schedule) == (Mode.V1, DrafterKind.EAGLE_HYBRID, KSchedule.HEURISTIC)
    with pytest.raises(ValueError, match=r"drafter must be one of \['model', 'ngram', 'hybrid', 'eagle'"):
        SpecConfig(drafter="magic")


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=0), "K must be an integer between 1 and 32"), (dict(k=K_BOUND + 1), "between 1 and 32"),
    (dict(k=2.5), "K must be an integer"), (dict(k_min=3, k_max=2), "K min <= K max"),
    (dict(k=9, k_schedule="heuristic", k_max=8), "outside the heuristic schedule"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_n=0), "top_n"), (dict(ngram_min=0), "ngram_min"),
    (dict(hybrid_min_n=9), "hybrid_min_n"), (dict(block_size=0), "block_size"),
    (dict(tree="4-2"), "tree must be a TreeSpec"),
    (dict(tree=TreeSpec(budget=4), k_schedule="heuristic"), "constant K schedule"),
])
def test_bounds_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**kwargs)


def test_what_a_run_needs_loaded():
    assert SpecConfig(drafter="model").uses_draft_model and not SpecConfig(drafter="model").uses_eagle
    assert SpecConfig(drafter="eagle").uses_eagle and not SpecConfig(drafter="eagle").uses_draft_model
    assert not SpecConfig(mode="target", drafter="hybrid").uses_draft_model
    assert [d for d in DrafterKind if d.copies] == [DrafterKind.NGRAM, DrafterKind.HYBRID, DrafterKind.EAGLE_HYBRID]


def test_the_heuristic_schedule():
    c = SpecConfig(k=4, k_schedule="heuristic", k_min=2, k_max=7)
    assert [c.next_k(4, True), c.next_k(6, True), c.next_k(3, False), c.next_k(2, False)] == [6, 7, 2, 2]
    assert SpecConfig(k=4).next_k(4, True) == 4

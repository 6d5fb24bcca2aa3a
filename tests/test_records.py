"""engine.records: the outcome labels, what a round counts as verified, and its depth-by-depth checks
for chains and for trees."""
from __future__ import annotations

from dataclasses import replace

from engine.records import Outcome, TreeNode, TreeRecord
from tests.test_metrics import make_round


def test_only_accepted_and_rejected_drafts_count_as_verified():
    assert {o for o in Outcome if o.verified} == {Outcome.ACCEPTED, Outcome.REJECTED}


def test_a_chain_round_counts_positions():
    r = make_round(3, "aaru")
    assert (r.k, r.verified, r.depth, r.checks()) == (4, 3, 4, [True, True, False])
    assert make_round(4, "aaaa").checks() == [True] * 4 and make_round(0, "").is_prefill


def tree_round(path: list[int]):
    """root -> 1, 2; 1 -> 3; 3 -> 4, with `path` accepted: it stops at a rejection unless it ends in a leaf."""
    shape = {1: (0, 1), 2: (0, 1), 3: (1, 2), 4: (3, 3)}
    nodes = [TreeNode(i, p, d, 10 + i, "", 0.5, 0.5, None, None, None,
                      Outcome.ACCEPTED if i in path else Outcome.UNCHECKED) for i, (p, d) in shape.items()]
    final_parent = path[-1] if path else 0
    return replace(make_round(1, ""), k=4, tree=TreeRecord("N4", nodes, path, final_parent), accepted=len(path),
                   emitted=[1] * (len(path) + 1))


def test_a_tree_round_counts_depths():
    stopped = tree_round([1])             # accepted node 1, then its child 3 was rejected
    assert (stopped.verified, stopped.depth, stopped.checks()) == (2, 3, [True, False])
    to_leaf = tree_round([1, 3, 4])        # accepted down to the leaf 4: a bonus, no rejection
    assert (to_leaf.verified, to_leaf.checks()) == (3, [True, True, True])
    nothing = tree_round([])
    assert (nothing.verified, nothing.checks()) == (1, [False])

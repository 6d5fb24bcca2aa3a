"""Tree speculation: the tree's shape and its validation, tree attention equal to a plain forward along
each node's path, greedy parity with target-only and generate for static and dynamic trees, the KV
cache after every tree round equal to a fresh prefill, and records that describe the tree."""
from __future__ import annotations

import heapq

import pytest
import torch

from engine.config import TREE_BOUND, DrafterKind, Mode, SpecConfig, TreeSpec
from engine.pair import ModelPair
from engine.prompts import encode_prompt
from engine.records import Outcome
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeEngine
from engine.tree import COPIED, Confidence, Confidences, DraftTree, _draw_order, attention_mask, grow, verify_tree
from tests.conftest import hf_greedy
from tests.test_speculative import CODE, assert_cache_holds

NEW = 32


def test_specs_validate_and_parse():
    assert TreeSpec(widths=(4, 2, 2, 1)).nodes == 9 and TreeSpec(widths=(4, 2, 2, 1)).max_depth == 4
    assert TreeSpec.parse("4-2-2-1") == TreeSpec(widths=(4, 2, 2, 1))
    assert TreeSpec.parse("N16d6") == TreeSpec(budget=16, depth=6) and TreeSpec.parse("n8").depth == 4
    assert TreeSpec.parse("N16d6q") == TreeSpec(budget=16, depth=6, calibrated=False)
    assert TreeSpec.parse("4-2q").label() == "4-2q" and TreeSpec.parse("4-2").label() == "4-2"
    for bad, message in [(dict(widths=(8, 8, 8, 8, 4)), "36 nodes; the bound is 32"),
                         (dict(widths=(2, 0)), "positive integer"), (dict(budget=0), "node budget"),
                         (dict(budget=TREE_BOUND + 1), "node budget"), (dict(widths=(2,), budget=4), "not both")]:
        with pytest.raises(ValueError, match=message):
            TreeSpec(**bad)
    with pytest.raises(ValueError, match="widths per depth"):
        TreeSpec.parse("four")
    with pytest.raises(ValueError, match="ngram drafter"):
        SpecConfig(drafter=DrafterKind.NGRAM, tree=TreeSpec(budget=4))
    assert SpecConfig(drafter=DrafterKind.HYBRID, tree=TreeSpec(budget=4)).tree.nodes == 4


def fixed_tree() -> DraftTree:
    """root -> a, b;  a -> c, d;  d -> e   (tokens 11, 12, 13, 14, 15)."""
    tree = DraftTree.root(7)
    a, b = tree.add(0, 11, 0.6), tree.add(0, 12, 0.3)
    c, d = tree.add(a, 13, 0.3), tree.add(a, 14, 0.2)
    tree.add(d, 15, 0.1)
    assert (a, b, c, d) == (1, 2, 3, 4)
    return tree


def test_ancestry_mask():
    tree = fixed_tree()
    mask = attention_mask(tree, past=3)
    assert mask.shape == (6, 3 + 6) and mask[:, :3].all()
    assert mask[5, 3:].tolist() == [True, True, False, False, True, True]   # e sees root, a, d and itself
    assert mask[2, 3:].tolist() == [True, False, True, False, False, False]  # b sees root and itself


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
def test_tree_attention_equals_a_plain_forward_along_each_path(builtin_pair, fused):
    _, target = builtin_pair
    prompt = encode_prompt(target.tokenizer, CODE)
    tree = fixed_tree()
    runner = ModelRunner(target, len(prompt) + 16, fused=fused)
    cache = runner.new_sequence()
    runner.forward(cache, prompt[:-1])
    tree.tokens[0] = prompt[-1]
    past = len(prompt) - 1
    logits, _ = runner.forward_features(cache, tree.tokens, features=False,
                                        positions=[past + d for d in tree.depths], attn_mask=attention_mask(tree, past))
    for node in range(len(tree.tokens)):
        path = [prompt[-1]] + [tree.tokens[n] for n in tree.path_to(node)]
        plain = ModelRunner(target, len(prompt) + 16, fused=fused)
        pc = plain.new_sequence()
        plain.forward(pc, prompt[:-1])
        ref = plain.forward(pc, path)[-1]
        assert (logits[node] - ref).abs().max() < 1e-5 * ref.abs().max(), node  # float rounding only


@pytest.fixture(scope="module")
def prompt(builtin_pair) -> list[int]:
    return encode_prompt(builtin_pair[1].tokenizer, CODE)


@pytest.fixture(scope="module")
def reference(builtin_pair, prompt) -> list[int]:
    return hf_greedy(builtin_pair[1], prompt, NEW)


@pytest.mark.parametrize("spec", [TreeSpec(widths=(4, 2, 2, 1)), TreeSpec(widths=(2, 2, 2, 2, 2)),
                                  TreeSpec(budget=4, depth=3), TreeSpec(budget=16, depth=6),
                                  TreeSpec(budget=32, depth=8), TreeSpec(budget=16, depth=6, calibrated=False)],
                         ids=lambda s: s.label())
@pytest.mark.parametrize("mode", [Mode.V2, Mode.V1])
def test_greedy_trees_match_generate_and_keep_the_cache_exact(builtin_pair, prompt, reference, spec, mode):
    draft, target = builtin_pair
    engine = SpeculativeEngine(ModelPair(target, draft), prompt, SpecConfig(tree=spec, mode=mode, max_new_tokens=NEW,
                                                                            block_size=4))
    pools = [engine.target_runner.pool] + [c.cache.pool for c in engine.drafter.caches()]
    while not engine.finished:
        r = engine.step()
        assert engine.target_cache.tokens == engine.tokens[:-1]
        assert_cache_holds(target, engine.target_cache, engine.tokens[:-1])
        if r.tree is not None:
            assert r.k == len(r.tree.nodes) <= spec.nodes and r.accepted == len(r.tree.path)
            assert max(n.depth for n in r.tree.nodes) <= spec.max_depth
            on_path = [n.index for n in r.tree.nodes if n.outcome is Outcome.ACCEPTED]
            assert on_path == r.tree.path
            target_kv = next(kv for kv in r.kv if kv.model == "target")
            if mode is Mode.V2:
                assert len(target_kv.written) == r.k + 1   # root and every node written, then compacted
    engine.close()
    assert engine.generated == reference
    for pool in pools:
        assert pool.manager.free_blocks == pool.num_blocks
        pool.manager.check()


@pytest.mark.parametrize("drafter", [DrafterKind.HYBRID, DrafterKind.EAGLE_HYBRID])
def test_hybrid_trees_match_generate_and_copy_where_the_context_repeats(builtin_pair, prompt, reference, drafter):
    from engine.drafters.eagle import load_eagle

    draft, target = builtin_pair
    pair = ModelPair(target, draft, load_eagle("builtin", target))   # the shipped head
    for spec in (TreeSpec(budget=16, depth=6), TreeSpec(widths=(3, 2, 2, 1))):
        engine = SpeculativeEngine(pair, prompt, SpecConfig(drafter=drafter, tree=spec, max_new_tokens=NEW, block_size=4))
        pools = [engine.target_runner.pool] + [c.cache.pool for c in engine.drafter.caches()]
        rounds = [r for r in engine.run() if r.tree is not None]
        assert engine.target_cache.tokens == engine.tokens[:-1]
        assert_cache_holds(target, engine.target_cache, engine.tokens[:-1])
        engine.close()
        assert engine.generated == reference
        copied = [n for r in rounds for n in r.tree.nodes if n.copied]
        assert copied and any(n.outcome is Outcome.ACCEPTED for n in copied)
        assert all(n.q_draft == 1.0 for n in copied)
        for pool in pools:
            assert pool.manager.free_blocks == pool.num_blocks


def test_a_larger_budget_never_accepts_less_from_the_same_context(builtin_pair, prompt):
    """Best-first growth adds nodes in one order whatever the budget, so the N=8 tree is a subtree of the
    N=16 one and that of the N=32 one; under greedy verification a subtree's accepted path can be no
    longer. Checked on the first drafting round from several contexts along a greedy continuation."""
    draft, target = builtin_pair
    continuation = hf_greedy(target, prompt, 24)

    def accepted(context: list[int], budget: int) -> int:
        # a fresh pair each time: every tree then grows from the same (prior) confidence table
        engine = SpeculativeEngine(ModelPair(target, draft), context, SpecConfig(tree=TreeSpec(budget=budget, depth=6), max_new_tokens=8,
                                                             stop_at_eos=False))
        first = next(r for r in engine.run() if r.k)
        engine.close()
        return first.accepted

    lengths = {cut: [accepted(prompt + continuation[:cut], n) for n in (8, 16, 32)] for cut in range(0, 24, 4)}
    assert all(a <= b <= c for a, b, c in lengths.values()), lengths
    assert any(a < c for a, _, c in lengths.values()), lengths      # the budget matters somewhere


def test_moved_slots_show_in_the_kv_record(builtin_pair, prompt):
    draft, target = builtin_pair
    engine = SpeculativeEngine(ModelPair(target, draft), prompt, SpecConfig(tree=TreeSpec(budget=8, depth=4),
                                                                            max_new_tokens=NEW, block_size=4))
    moved = []
    for r in engine.run():
        kv = next(k for k in r.kv if k.model == "target")
        moved += kv.moved
        if r.tree is not None and r.tree.path and r.tree.path != list(range(1, len(r.tree.path) + 1)):
            assert kv.moved, "a path that is not the first nodes must be moved next to the root"
    engine.close()
    assert moved


def test_verify_tree_greedy_walk_and_errors():
    tree = fixed_tree()
    v = 20
    rows = torch.zeros(len(tree.tokens), v)
    for node, best in {0: 11, 1: 14, 4: 15, 5: 3, 2: 1, 3: 1}.items():
        rows[node, best] = 1.0
    verdict = verify_tree(tree, rows, torch.Generator().manual_seed(0), greedy=True)
    assert verdict.path == [1, 4, 5] and verdict.tokens == [11, 14, 15, 3]
    assert verdict.final_outcome is Outcome.BONUS and verdict.final_row == 5
    rows[4] = 0.0
    rows[4, 9] = 1.0   # the target wants 9 after d: no child matches
    verdict = verify_tree(tree, rows, torch.Generator().manual_seed(0), greedy=True)
    assert verdict.path == [1, 4] and verdict.final_token == 9 and verdict.final_outcome is Outcome.CORRECTED
    assert verdict.depths_verified == 3
    with pytest.raises(ValueError, match="one p row per tree node"):
        verify_tree(tree, rows[:3], None, greedy=True)


def test_grow_respects_widths_budgets_and_depths():
    v = 50
    g = torch.Generator().manual_seed(3)
    rows = torch.softmax(torch.randn(200, v, generator=g), dim=-1)
    def rows_at(tree, nodes):
        return {n: rows[n] for n in nodes}
    for spec in (TreeSpec(widths=(4, 2, 2, 1)), TreeSpec(budget=12, depth=3), TreeSpec(budget=32, depth=8)):
        for greedy in (True, False):
            tree = grow(spec, 5, rows_at, greedy, torch.Generator().manual_seed(1))
            depths = [tree.depths[i] for i in range(1, len(tree.tokens))]
            assert tree.size == spec.nodes and max(depths) <= spec.max_depth
            if spec.widths:
                assert [depths.count(d + 1) for d in range(len(spec.widths))] == list(spec.widths)
            for node, kids in enumerate(tree.children):
                assert len({tree.tokens[k] for k in kids}) == len(kids)       # siblings are distinct
                if kids:
                    assert node in tree.q_rows
            if greedy:   # children in order of draft probability
                for node, kids in enumerate(tree.children):
                    probs = [float(tree.q_rows[node][tree.tokens[k]]) for k in kids]
                    assert probs == sorted(probs, reverse=True)


def test_a_copy_from_prompt_lookup_is_merged_in_first_along_its_chain():
    """The root and each copied node get the next copied token as their first child; the model's
    children come after, without that token (greedy: ranked as in the draft's own order)."""
    v = 50
    rows = torch.softmax(torch.randn(200, v, generator=torch.Generator().manual_seed(4)), dim=-1)

    def rows_at(tree, nodes):
        return {n: rows[n] for n in nodes}
    copy = [int(rows[0].argsort()[10]), int(rows[0].argmax()), 7]

    def copy_at(tree, node):   # a copied chain from the root
        depth = tree.depths[node]
        return copy[depth] if depth < len(copy) and (node == 0 or tree.copied(node)) else None
    for greedy in (True, False):
        tree = grow(TreeSpec(budget=12, depth=4), 5, rows_at, greedy, torch.Generator().manual_seed(2),
                    copy_at=copy_at)
        node, chain = 0, []
        while tree.children[node] and tree.copied(tree.children[node][0]):
            node = tree.children[node][0]
            chain.append(tree.tokens[node])
        assert chain == copy[:len(chain)] and len(chain) >= 1
        assert sum(map(tree.copied, range(1, len(tree.tokens)))) == len(chain)   # copies only where copy_at said
        for parent, kids in enumerate(tree.children):
            model_kids = [k for k in kids if not tree.copied(k)]
            assert not any(tree.copied(k) for k in kids[1:])                  # a copy is always the first child
            assert len({tree.tokens[k] for k in kids}) == len(kids)           # the model never repeats the copy
            if greedy and kids:
                order = tree.q_rows[parent].argsort(descending=True).tolist()
                assert [tree.ranks[k] for k in model_kids] == [order.index(tree.tokens[k]) for k in model_kids]
    assert tree.ranks[tree.children[0][0]] == COPIED


def test_a_copied_child_is_verified_as_proposed_with_certainty():
    """At T > 0 a copy's q is one-hot: accepted with probability p(c); after its rejection the model's
    children are tested against p without c."""
    tree = DraftTree.root(7)
    tree.add(0, 3, 0.5, rank=COPIED)
    tree.add(0, 4, 0.3, rank=0)
    q = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5])
    tree.q_rows[0] = q
    p = torch.tensor([[0.0, 0.0, 0.0, 0.25, 0.75]] * 3)
    accepted = [verify_tree(tree, p, torch.Generator().manual_seed(s), greedy=False) for s in range(400)]
    first = [v.tested[0] for v in accepted]
    assert all(t.q_draft == 1.0 and t.alpha == pytest.approx(0.25) for t in first)
    seconds = [v.tested[1] for v in accepted if len(v.tested) > 1]
    # p without c is one-hot on 4, q without c is one-hot on 4: the model's child is then always accepted
    assert seconds and all(t.alpha == 1.0 and t.outcome is Outcome.ACCEPTED for t in seconds)
    assert 0.15 < sum(t.outcome is Outcome.ACCEPTED for t in first) / 400 < 0.35


def test_a_tree_spec_has_no_verification_rule_to_pick():
    """The wrong rule lives with the lab, not in the engine's configuration."""
    with pytest.raises(TypeError):
        TreeSpec(budget=4, rule="no-residual-update")


def unsure_but_right(v: int = 50):
    """A draft whose first guess (token 1, q = 0.3) is always the target's token, and whose next
    guesses (2 and 3, q = 0.2 each) never are: rows_at for grow, and the target's one-hot p rows."""
    q = torch.full((v,), 0.3 / (v - 3))
    q[1], q[2], q[3] = 0.3, 0.2, 0.2

    def rows_at(tree, nodes):
        return {n: q for n in nodes}

    def p_rows(tree):
        return torch.nn.functional.one_hot(torch.ones(len(tree.tokens), dtype=torch.long), v).float()
    return rows_at, p_rows


def test_confidence_starts_at_q_and_learns_what_children_were_worth():
    conf = Confidence(prior=4.0)
    assert conf.weigh(0.35, 0, 1) == pytest.approx(0.35) and conf.weigh(0.15, 1, 3) == pytest.approx(0.15)
    rows_at, p_rows = unsure_but_right()
    spec = TreeSpec(budget=8, depth=8)
    for _ in range(40):
        tree = grow(spec, 5, rows_at, True, torch.Generator(), conf.weigh)
        conf.observe(tree, verify_tree(tree, p_rows(tree), torch.Generator(), greedy=True))
    assert conf.weigh(0.3, 0, 1) > 0.9 and conf.weigh(0.3, 0, 6) > 0.9    # first guesses: always right
    assert conf.weigh(0.2, 1, 1) < 0.1      # later siblings: never right (from a prior of 0.25; once learned, rarely drafted)


def test_a_copy_starts_at_one_half_and_learns_its_hit_rate_by_bin():
    conf = Confidence(prior=4.0)
    assert conf.weigh(0.02, COPIED, 1) == pytest.approx(0.5) == conf.weigh(0.9, COPIED, 4)
    tree = DraftTree.root(7)
    tree.add(0, 3, 0.5, rank=COPIED)
    tree.add(0, 4, 0.3, rank=0)
    tree.q_rows[0] = torch.tensor([0.0, 0.0, 0.0, 0.02, 0.85])
    p = torch.nn.functional.one_hot(torch.full((3,), 3), 5).float()   # the target takes the copy every time
    for _ in range(30):
        conf.observe(tree, verify_tree(tree, p, None, greedy=True))
    assert conf.weigh(0.02, COPIED, 1) > 0.9              # a copy the draft gave 2% is right: it learned
    assert conf.weigh(0.85, 0, 1) < 0.3                   # the draft's confident first guess was not
    assert conf.weigh(0.85, COPIED, 1) == pytest.approx(0.5)  # another q bin: nothing learned yet


def test_measured_confidence_grows_deeper_trees_that_accept_more():
    """Raw q (EAGLE-2) ranks the unsure first guess's grandchild (0.09) below its siblings (0.2): the
    tree stays shallow. Measured confidence learns that first guesses are right and grows a chain."""
    rows_at, p_rows = unsure_but_right()
    spec = TreeSpec(budget=8, depth=8)
    raw = grow(spec, 5, rows_at, True, torch.Generator())
    conf = Confidence()
    for _ in range(30):
        tree = grow(spec, 5, rows_at, True, torch.Generator(), conf.weigh)
        conf.observe(tree, verify_tree(tree, p_rows(tree), torch.Generator(), greedy=True))
    learned = grow(spec, 5, rows_at, True, torch.Generator(), conf.weigh)

    def accepted(tree):
        return verify_tree(tree, p_rows(tree), torch.Generator(), greedy=True).accepted_count
    assert max(raw.depths) <= 3 and accepted(raw) == max(raw.depths)
    assert max(learned.depths) == 8 and accepted(learned) == 8
    # sampling draws children from q alone: the learned weights change nothing there
    sampled = grow(spec, 5, rows_at, False, torch.Generator().manual_seed(0), conf.weigh)
    plain = grow(spec, 5, rows_at, False, torch.Generator().manual_seed(0))
    assert (sampled.tokens, sampled.parents) == (plain.tokens, plain.parents)


def test_a_run_learns_in_its_own_confidence_table_unless_its_caller_keeps_one(builtin_pair, prompt):
    draft, target = builtin_pair
    pair = ModelPair(target, draft)
    kept = Confidences()

    def run(learned: Confidences | None = None, **config) -> SpeculativeEngine:
        cfg = SpecConfig(max_new_tokens=12, **config)
        engine = SpeculativeEngine(pair, prompt, cfg, confidence=learned.for_run(cfg) if learned else None)
        engine.run()
        engine.close()
        return engine
    first = run(kept, tree=TreeSpec(budget=8, depth=6))
    table = first.confidence
    mass = sum(map(sum, table.mass))
    second = run(kept, tree=TreeSpec(budget=4, depth=3))
    assert second.confidence is table and sum(map(sum, table.mass)) > mass    # the caller's table learned on
    assert run(tree=TreeSpec(budget=4, depth=3)).confidence is not table       # a run of its own: a fresh one
    assert run(kept, tree=TreeSpec(budget=8, depth=6, calibrated=False)).confidence is None
    assert run(kept, tree=TreeSpec(budget=8, depth=6), sampling=SamplingParams(temperature=0.8), seed=3).confidence \
        is None
    assert run(kept, k=4).confidence is None


def test_a_seed_reproduces_a_greedy_tree_run_whatever_ran_before_it(builtin_pair, prompt):
    """The same greedy N16d6 tree run, repeated after unrelated tree runs over the same shared pair, drafts
    the same trees in every round (it used to learn from the runs before it: 12 of 12 rounds differed)."""
    draft, target = builtin_pair
    pair = ModelPair(target, draft)

    def trees(spec: TreeSpec, tokens: int = 24) -> list:
        engine = SpeculativeEngine(pair, prompt, SpecConfig(tree=spec, max_new_tokens=tokens, seed=1))
        rounds = engine.run()
        engine.close()
        return [(r.tree.nodes, r.emitted) for r in rounds if r.tree is not None]
    first = trees(TreeSpec(budget=16, depth=6))
    for other in (TreeSpec(budget=8, depth=4), TreeSpec(budget=24, depth=8), TreeSpec(widths=(4, 2, 2, 1))):
        trees(other, 32)
    again = trees(TreeSpec(budget=16, depth=6))
    assert len(first) > 3 and again == first




def best_first(spec: TreeSpec, root: int, rows_at, greedy: bool, weigh, copy_at) -> tuple[DraftTree, int]:
    """The specification grow must meet: best-first growth (EAGLE-2), one "next child of v" at a time from a
    heap, rows fetched whenever a node without one could be next (the engine's growth until it drafted a
    level per forward). Returns the tree and how many times it called rows_at."""
    tree, calls = DraftTree.root(root), 0
    caps, filled = (list(spec.widths) if spec.widths else None), [0] * (spec.max_depth + 1)
    heap, pending, count = [], [0], 0      # heap entries: (-priority, tie, node, order, ranks, qs, taken)

    def priority(node, ranks, qs, taken):
        if taken >= len(ranks):
            return 0.0
        if greedy:
            return tree.scores[node] * weigh(qs[taken], ranks[taken], tree.depths[node] + 1)
        return tree.scores[node] * max(0.0, 1.0 - sum(qs[:taken]))
    while tree.size < spec.nodes and (heap or pending):
        bound = max(tree.scores[n] for n in pending) if pending else -1.0
        if pending and (not heap or -heap[0][0] < bound):
            calls += 1
            tree.q_rows.update(rows_at(tree, pending))
            for node in pending:
                tokens, ranks, qs = _draw_order(tree.q_rows[node], greedy, None, spec.nodes,
                                                copy_at(tree, node) if copy_at else None)
                if tokens:
                    count += 1
                    heapq.heappush(heap, (-priority(node, ranks, qs, 0), count, node, tokens, ranks, qs, 0))
            pending = []
            continue
        _, _, node, tokens, ranks, qs, taken = heapq.heappop(heap)
        depth = tree.depths[node] + 1
        if depth > spec.max_depth or (caps is not None and filled[depth] >= caps[depth - 1]):
            continue
        child = tree.add(node, tokens[taken], tree.scores[node] * weigh(qs[taken], ranks[taken], depth), ranks[taken])
        filled[depth] += 1
        if taken + 1 < len(tokens):
            count += 1
            heapq.heappush(heap, (-priority(node, ranks, qs, taken + 1), count, node, tokens, ranks, qs,
                                  taken + 1))
        if depth < spec.max_depth:
            pending.append(child)
    return tree, calls


def _shape(tree: DraftTree) -> set:
    """A tree as the set of its nodes' token paths (node numbering aside), with ranks and scores."""
    return {(tuple(tree.tokens[n] for n in tree.path_to(i)), tree.ranks[i], round(tree.scores[i], 12))
            for i in range(1, len(tree.tokens))}


@pytest.mark.parametrize("greedy", [True, False])
def test_a_tree_drafted_a_level_at_a_time_is_the_tree_best_first_growth_builds(monkeypatch, greedy):
    """Random draft rows keyed by each node's token path (so both growths see the same rows whatever they
    number nodes), every kind of shape, measured confidence that ranks later siblings above first ones,
    and prompt lookup's copies: the level-by-level growth builds exactly best-first's tree, children in
    the same order, and calls the drafter at most once per level (best-first: up to once per node). When
    sampling, every node draws the same Gumbel noise, so both see identical draws."""
    from engine import tree as tree_mod
    if not greedy:
        noise = torch.rand(40, generator=torch.Generator().manual_seed(9))
        monkeypatch.setattr(tree_mod, "draw_uniform", lambda n, generator, device: noise[:n].clone())
    v, trials, level_calls, node_calls = 40, 0, 0, 0
    for seed in range(24):
        g = torch.Generator().manual_seed(seed)
        sharpness = float(torch.rand(1, generator=g)) * 4 + 0.5

        def rows_at(tree, nodes, salt=seed):
            out = {}
            for n in nodes:
                path = (salt, *(tree.tokens[i] for i in tree.path_to(n)))
                logits = torch.randn(v, generator=torch.Generator().manual_seed(hash(path) % 2**31)) * sharpness
                out[n] = torch.softmax(logits, dim=-1)
            return out

        def weigh(q, rank, depth):   # a confidence table that trusts later siblings more than first ones
            return min(0.99, q * (0.6 if rank == 0 else 1.3) * (1.0 + 0.05 * depth))

        def copy_at(tree, node):      # prompt lookup copies along the root's first-child chain
            return (7 + tree.depths[node]) if node == 0 or tree.copied(node) else None
        for spec in (TreeSpec(budget=6, depth=4), TreeSpec(budget=16, depth=8), TreeSpec(budget=24, depth=5),
                     TreeSpec(widths=(4, 3, 2, 2, 1))):
            for w, c in ((None, None), (weigh if greedy else None, None), (None, copy_at)):
                calls = []

                def counted(tree, nodes):
                    calls.append(len(nodes))
                    return rows_at(tree, nodes)
                grown = grow(spec, 5, counted, greedy, torch.Generator(), w, c)
                reference, reference_calls = best_first(spec, 5, rows_at, greedy, w if greedy and w else tree_mod.raw_q, c)
                assert _shape(grown) == _shape(reference)
                for node, kids in enumerate(grown.children):   # the same sibling order (draw order)
                    ref = next(i for i in range(len(reference.tokens))
                               if [reference.tokens[n] for n in reference.path_to(i)] ==
                               [grown.tokens[n] for n in grown.path_to(node)])
                    assert [grown.tokens[k] for k in kids] == [reference.tokens[k] for k in reference.children[ref]]
                    if kids:
                        assert torch.equal(grown.q_rows[node], reference.q_rows[ref])
                assert len(calls) <= max(grown.depths) + 1
                trials, level_calls, node_calls = trials + 1, level_calls + len(calls), node_calls + reference_calls
    assert trials == 24 * 12
    # greedy trees here run deep (2.8 times fewer drafter calls); sampled ones are wide and shallow
    assert level_calls < node_calls / 2 if greedy else level_calls <= node_calls

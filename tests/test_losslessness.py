"""Losslessness, end to end through the engine: sampled speculative output follows the target's own
(processed) distribution, for every drafter, with temperature, top-k and top-p.

The target is a tiny random Llama, so the exact distribution of the first three generated tokens can be
enumerated from its own forwards (top-k keeps the support small). Many runs with different seeds give
empirical counts of (x1, x2, x3); a Pearson chi-square test at level 1e-3 must not reject. x1 comes from
the prefill round, x2 and x3 from the first speculative round (drafted, verified, corrected or bonus).
"""
from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch

from engine.config import DrafterKind, SpecConfig, TreeSpec
from engine.drafters import base as drafters_base
from engine.models import LoadedModel
from engine.pair import ModelPair
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, logits_to_probs
from engine.speculative import SpeculativeEngine
from engine.stats import goodness_of_fit
from engine.tree import verify_tree
from playground.teach.losslessness import no_residual_update
from tests.conftest import tiny_model
from tests.test_eagle import random_head

SAMPLING = SamplingParams(temperature=0.9, top_k=4, top_p=0.95)
RUNS = 450         # the skewed distribution below is still rejected at p ~ 3e-6 with these counts
LEVEL = 1e-3
SHARPEN = 50.0
PROMPT = [5, 17, 230, 9, 17, 230, 9]   # a repeat, so that prompt lookup finds something to copy
# When the target's first token is 496 (p = 0.27), the context ends "10 496" and prompt lookup copies
# 2558: a token the target gives p = 0.25 there and the draft's top-k leaves out (q = 0), so a copy
# verified as if the model had drafted it would always be accepted. (Found by searching the tiny pair.)
COPY_PROMPT = [5, 10, 496, 2558, 9, 10]


def next_probs(target: LoadedModel, tokens: list[int], sampling: SamplingParams = SAMPLING) -> torch.Tensor:
    runner = ModelRunner(target, len(tokens) + 1)
    cache = runner.new_sequence()
    logits = runner.forward(cache, tokens, last_only=True)
    cache.free()
    return logits_to_probs(logits, sampling)[0]


def exact_joint(target: LoadedModel, prompt: list[int],
                sampling: SamplingParams = SAMPLING) -> dict[tuple[int, int, int], float]:
    """P(x1, x2, x3) under the target's processed distribution, by enumeration."""
    out = {}
    p1 = next_probs(target, prompt, sampling)
    for a in p1.nonzero().flatten().tolist():
        p2 = next_probs(target, prompt + [a], sampling)
        for b in p2.nonzero().flatten().tolist():
            p3 = next_probs(target, prompt + [a, b], sampling)
            for c in p3.nonzero().flatten().tolist():
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


def run_counts(pair: ModelPair, runs: int, prompt: list[int] = PROMPT, sampling: SamplingParams = SAMPLING,
               **config) -> dict[tuple[int, int, int], int]:
    """How often each first three tokens came out over `runs` seeds of the engine with `config`."""
    counts: dict[tuple[int, int, int], int] = {}
    for seed in range(runs):
        engine = SpeculativeEngine(pair, prompt, SpecConfig(sampling=sampling, seed=seed, max_new_tokens=3,
                                                            stop_at_eos=False, record=False, **config))
        engine.run()
        engine.close()
        key = tuple(engine.generated)
        counts[key] = counts.get(key, 0) + 1
    return counts


def sampled_counts(pair: ModelPair, drafter: DrafterKind, runs: int) -> dict[tuple[int, int, int], int]:
    return run_counts(pair, runs, drafter=drafter, k=2, ngram_min=1)


def chi_square(exact: dict, counts: dict) -> float:
    cells = sorted(set(exact) | set(counts))
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    expected = torch.tensor([exact.get(c, 0.0) for c in cells], dtype=torch.float64)
    return goodness_of_fit(observed, expected, alpha_level=LEVEL).p_value


@pytest.fixture(scope="module")
def tiny(builtin_tokenizer):
    target = tiny_model(builtin_tokenizer, layers=2, seed=11)
    draft = tiny_model(builtin_tokenizer, layers=1, seed=12)
    # A draft that agrees with the target some of the time: half its logits are the target's.
    with torch.no_grad():
        for mine, theirs in zip(draft.model.parameters(), itertools.islice(target.model.parameters(), None)):
            if mine.shape == theirs.shape:
                mine.mul_(0.5).add_(theirs, alpha=0.5)
    return ModelPair(target, draft, random_head(target, 3000, seed=4)), exact_joint(target, PROMPT)


@pytest.fixture(scope="module")
def chain_counts(tiny) -> dict[DrafterKind, dict[tuple[int, int, int], int]]:
    """Each drafter's counts over RUNS seeds, drawn once for the module: the fit tests and the power test read
    the same runs."""
    pair, _ = tiny
    return {d: sampled_counts(pair, d, RUNS) for d in (DrafterKind.MODEL, DrafterKind.NGRAM, DrafterKind.HYBRID,
                                                       DrafterKind.EAGLE, DrafterKind.EAGLE_HYBRID)}


@pytest.mark.parametrize("drafter", [DrafterKind.MODEL, DrafterKind.NGRAM, DrafterKind.HYBRID, DrafterKind.EAGLE,
                                     DrafterKind.EAGLE_HYBRID])
def test_sampled_output_follows_the_target(tiny, chain_counts, drafter):
    _, exact = tiny
    counts = chain_counts[drafter]
    assert abs(sum(exact.values()) - 1.0) < 1e-6
    assert set(counts) <= set(exact)                     # never a sequence the target cannot produce
    assert chi_square(exact, counts) >= LEVEL


class NucleusCalls:
    """engine.native's module, counting its `nucleus_rows` calls."""

    def __init__(self, module) -> None:
        self.module, self.calls = module, 0

    def nucleus_rows(self, *args):
        self.calls += 1
        return self.module.nucleus_rows(*args)

    def __getattr__(self, name: str):
        return getattr(self.module, name)


TOP_P_ALONE = SamplingParams(temperature=0.9, top_p=0.8)    # the compiled nucleus's case (engine/native/nucleus.cpp)
NUCLEUS_SHARPEN = 36.0   # the target's logits scaled up so that each nucleus is a few tokens: 15 sequences in all


@pytest.mark.parametrize("drafter", [DrafterKind.MODEL, DrafterKind.EAGLE_HYBRID])
def test_top_p_alone_follows_the_target(tiny, builtin_tokenizer, drafter, monkeypatch):
    """Top-p without top-k, where logits_to_probs takes the compiled nucleus: the engine's output still follows
    the target's processed distribution, computed by the same function and enumerated."""
    from engine import sampling

    pair, _ = tiny
    target = tiny_model(builtin_tokenizer, layers=2, seed=11)
    with torch.no_grad():
        target.model.model.norm.weight.mul_(NUCLEUS_SHARPEN)
    exact = exact_joint(target, PROMPT, TOP_P_ALONE)
    assert 8 <= len(exact) <= 40 and abs(sum(exact.values()) - 1.0) < 1e-6
    module = sampling.compiled_module()
    counting = NucleusCalls(module)
    if module is not None:
        monkeypatch.setattr(sampling, "compiled_module", lambda: counting)
    counts = run_counts(ModelPair(target, pair.draft, random_head(target, 3000, seed=4)), RUNS, PROMPT, TOP_P_ALONE,
                        drafter=drafter, k=2, ngram_min=1)
    assert module is None or counting.calls >= 2 * RUNS    # the target's rows and the draft's went through it
    assert set(counts) <= set(exact)
    assert chi_square(exact, counts) >= LEVEL


def test_the_test_can_fail(tiny, chain_counts):
    """Counts of the engine's runs against a distribution that differs in one conditional row are rejected:
    the test has the power to see a lossy rule."""
    _, exact = tiny
    counts = chain_counts[DrafterKind.NGRAM]
    first = max(exact, key=exact.get)[0]
    skewed = {key: p * (2.0 if key[0] == first else 1.0) for key, p in exact.items()}
    total = sum(skewed.values())
    assert chi_square({k: v / total for k, v in skewed.items()}, counts) < LEVEL


def tree_counts(pair: ModelPair, drafter: DrafterKind, spec: TreeSpec, runs: int,
                prompt: list[int] = PROMPT) -> dict[tuple[int, int, int], int]:
    return run_counts(pair, runs, prompt, drafter=drafter, tree=spec)


@pytest.fixture(scope="module")
def copy_exact(tiny) -> dict[tuple[int, int, int], float]:
    return exact_joint(tiny[0].target, COPY_PROMPT)


@pytest.mark.parametrize("drafter, spec", [
    (DrafterKind.MODEL, TreeSpec(widths=(3, 2))),
    (DrafterKind.MODEL, TreeSpec(budget=6, depth=2)),
    (DrafterKind.EAGLE, TreeSpec(widths=(3, 3))),
], ids=["model-static-3-2", "model-dynamic-N6", "eagle-static-3-3"])
def test_tree_sampling_follows_the_target(tiny, drafter, spec):
    pair, exact = tiny
    counts = tree_counts(pair, drafter, spec, RUNS)
    assert set(counts) <= set(exact)
    assert chi_square(exact, counts) >= LEVEL


HYBRID_TREES = [(DrafterKind.HYBRID, TreeSpec(widths=(3, 2))), (DrafterKind.EAGLE_HYBRID, TreeSpec(budget=6, depth=2))]


@pytest.mark.parametrize("drafter, spec", HYBRID_TREES, ids=["hybrid-static-3-2", "eagle-hybrid-dynamic-N6"])
def test_hybrid_tree_sampling_with_a_copied_branch_follows_the_target(tiny, copy_exact, drafter, spec):
    pair, _ = tiny
    counts = tree_counts(pair, drafter, spec, RUNS, COPY_PROMPT)
    assert set(counts) <= set(copy_exact)
    assert chi_square(copy_exact, counts) >= LEVEL


def test_a_copy_verified_as_if_the_model_drafted_it_fails_the_same_test(tiny, copy_exact, monkeypatch):
    """Reading the copy's q from the model's row (q = 0 here, so alpha = 1) instead of one-hot accepts
    it every time the target allows it at all: the chi-square test sees that."""
    from engine import tree as tree_mod

    pair, _ = tiny
    # the root still gets the copy first; verification then reads its q from the model's row
    monkeypatch.setattr(tree_mod.DraftTree, "copied", lambda self, node: False)
    counts = tree_counts(pair, *HYBRID_TREES[0], RUNS, COPY_PROMPT)
    assert chi_square(copy_exact, counts) < LEVEL


def test_a_tree_rule_that_skips_the_residual_update_fails_the_same_test(tiny, builtin_tokenizer, monkeypatch):
    """Testing every sibling against the same p (no residual update between them) over-produces
    the tokens the draft proposes; the chi-square test sees it. The draft here is the target with its
    logits scaled up (its final norm's weight times SHARPEN): the same top-k support, a far sharper q,
    so the wrong rule's bias is large."""
    pair, exact = tiny
    sharp = tiny_model(builtin_tokenizer, layers=2, seed=11)      # the target's own weights
    with torch.no_grad():
        sharp.model.model.norm.weight.mul_(SHARPEN)
    # the lab's wrong rule, handed to the engine's tree verification for this test only
    monkeypatch.setattr(drafters_base, "verify_tree", partial(verify_tree, after_rejection=no_residual_update))
    wrong = tree_counts(ModelPair(pair.target, sharp), DrafterKind.MODEL, TreeSpec(widths=(4, 1)), 300)
    assert chi_square(exact, wrong) < LEVEL

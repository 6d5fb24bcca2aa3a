"""Batched decoding (engine.batch): B sequences, one target forward a round.

Greedy: every sequence emits, token for token, what it emits alone target-only (and what `generate` emits),
for every drafter and a tree, at B = 1, 3 and 8 with prompts of different lengths. Sampled: a sequence's first
three tokens, drawn inside a batch beside other prompts, follow the target's exact distribution (chi-square).
A sequence the engine refuses is reported by name while the others finish; a batch over the free memory is
refused before anything is allocated.
"""
from __future__ import annotations

import pytest

from engine.batch import BatchEngine, BatchRequest, BatchTooLarge
from engine.config import DrafterKind, Mode, SpecConfig, TreeSpec
from engine.drafters.eagle import load_eagle
from engine.pair import ModelPair
from engine.speculative import SpeculativeEngine
from tests.conftest import hf_greedy
from tests.test_losslessness import LEVEL, PROMPT, SAMPLING, chi_square, tiny  # noqa: F401 (tiny: a fixture)

NEW = 16
CODE = ["def fib(n):\n", "import os\nimport sys\n\n\ndef main():\n    args = sys.argv[1:]\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
        "for i in range(10):", "# sort a list\n", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
        "x = [1, 2, 3]\ny = [", "while True:\n    line = input()\n"]


def greedy(**config) -> SpecConfig:
    return SpecConfig(max_new_tokens=NEW, stop_at_eos=False, record=False, **config)


@pytest.fixture(scope="module")
def pair(builtin_pair) -> ModelPair:
    draft, target = builtin_pair
    return ModelPair(target, draft, load_eagle("builtin", target))


@pytest.fixture(scope="module")
def prompts(pair) -> list[list[int]]:
    tok = pair.target.tokenizer
    ids = [tok(text)["input_ids"] for text in CODE]
    assert len({len(p) for p in ids}) > 4   # mixed lengths
    return ids


@pytest.fixture(scope="module")
def alone(pair, prompts) -> list[list[int]]:
    """Each prompt's target-only greedy tokens, decoded alone."""
    out = []
    for p in prompts:
        engine = SpeculativeEngine(pair, p, greedy(mode=Mode.TARGET))
        engine.run()
        out.append(engine.generated)
    return out


def batch_tokens(pair, prompts, config) -> tuple[list[list[int]], BatchEngine]:
    batch = BatchEngine(pair, [BatchRequest(f"seq{i}", p) for i, p in enumerate(prompts)], config)
    batch.run()
    batch.close()
    made = batch.generated()
    return [made[f"seq{i}"] for i in range(len(prompts))], batch


def test_target_only_alone_matches_generate(pair, prompts, alone):
    assert alone[1] == hf_greedy(pair.target, prompts[1], NEW)


CONFIGS = {
    "target": dict(mode=Mode.TARGET),
    "model": dict(drafter=DrafterKind.MODEL, k=4),
    "ngram": dict(drafter=DrafterKind.NGRAM, k=4, ngram_min=1),
    "hybrid": dict(drafter=DrafterKind.HYBRID, k=3),
    "eagle": dict(drafter=DrafterKind.EAGLE, k=3),
    "eagle-hybrid": dict(drafter=DrafterKind.EAGLE_HYBRID, k=2),
    "v1": dict(drafter=DrafterKind.MODEL, k=3, mode=Mode.V1),
    "tree": dict(drafter=DrafterKind.MODEL, k=3, tree=TreeSpec(widths=(2, 2, 1))),
}


@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_sequence_of_a_greedy_batch_emits_its_target_only_tokens(pair, prompts, alone, name, size):
    # B = 3 takes the three longest prompts' neighbours in a mixed order; B = 8 all of them
    chosen = {1: [0], 3: [5, 0, 2], 8: list(range(8))}[size]
    made, batch = batch_tokens(pair, [prompts[i] for i in chosen], greedy(**CONFIGS[name]))
    assert not batch.failures
    for got, i in zip(made, chosen):
        assert got == alone[i], f"{name}, B={size}: sequence {i} differs from its target-only decode"
    if name != "target" and size > 1:
        # one forward a round for the whole batch, over every sequence's rows
        assert any(len(r.rows) == size and sum(r.rows) > size for r in batch.rounds)


def test_a_batch_of_one_is_the_single_engine(pair, prompts):
    """B = 1 runs the same rounds as SpeculativeEngine.step: the same K, acceptances and tokens each round."""
    config = greedy(drafter=DrafterKind.MODEL, k=3)
    single = SpeculativeEngine(pair, prompts[2], config)
    single.run()
    _, batch = batch_tokens(pair, [prompts[2]], config)
    ours = [r.records[0] for r in batch.rounds]
    assert [(r.k, r.accepted, r.emitted) for r in ours] == [(r.k, r.accepted, r.emitted) for r in single.rounds]


def test_sequences_stop_on_their_own_and_leave_the_batch(pair, prompts, alone):
    """Different budgets: each sequence stops at its own; later rounds carry only the unfinished ones."""
    config = greedy(drafter=DrafterKind.NGRAM, k=3, ngram_min=1)
    batch = BatchEngine(pair, [BatchRequest("long", prompts[0]), BatchRequest("short", prompts[3])], config)
    batch.engines["short"].sequence.max_new_tokens = 5
    batch.run()
    made = batch.generated()
    assert made["short"] == alone[3][:5] and made["long"] == alone[0]
    assert batch.rounds[-1].names == ["long"]
    assert all(e.target_cache.table.length == 0 for e in batch.engines.values())   # KV freed as each finished


def test_a_failing_sequence_is_reported_by_name_and_the_rest_finish(pair, prompts, alone):
    vocab = pair.target.vocab_size
    context = pair.target.max_context
    requests = [BatchRequest("good", prompts[0]), BatchRequest("bad-ids", [1, vocab + 7, 3]),
                BatchRequest("too-long", [5] * context), BatchRequest("empty", []), BatchRequest("also-good", prompts[4])]
    batch = BatchEngine(pair, requests, greedy(drafter=DrafterKind.MODEL, k=3))
    batch.run()
    failed = {f.name: f.message for f in batch.failures}
    assert set(failed) == {"bad-ids", "too-long", "empty"}
    assert str(vocab + 7) in failed["bad-ids"] and "vocabulary" in failed["bad-ids"]
    assert "context" in failed["too-long"]
    made = batch.generated()
    assert made["good"] == alone[0] and made["also-good"] == alone[4]


def test_a_batch_over_the_free_memory_is_refused_before_it_starts(pair, prompts):
    with pytest.raises(BatchTooLarge, match=r"batch of 8 sequences needs .* of KV cache, and 1.0 MiB is free"):
        BatchEngine(pair, [BatchRequest(f"s{i}", p) for i, p in enumerate(prompts)], greedy(), memory=1 << 20)
    with pytest.raises(ValueError, match="its own name"):
        BatchEngine(pair, [BatchRequest("a", prompts[0]), BatchRequest("a", prompts[1])], greedy())


def test_a_sampled_sequence_follows_the_target_beside_other_prompts(tiny):  # noqa: F811 (the fixture)
    """The first three tokens of a prompt sampled inside batches of four (two copies of it with their own seeds,
    between prompts longer and shorter than it) over 200 batches, 400 samples: chi-square against the target's
    exact distribution."""
    pair, exact = tiny
    counts: dict[tuple[int, ...], int] = {}
    for run in range(200):
        requests = [BatchRequest("before", [7, 300, 12, 5, 9, 1000, 44, 3, 17, 230]), BatchRequest("ours", PROMPT),
                    BatchRequest("again", PROMPT), BatchRequest("after", [230, 9])]
        config = SpecConfig(sampling=SAMPLING, seed=4 * run, max_new_tokens=3, stop_at_eos=False, record=False,
                            drafter=DrafterKind.MODEL, k=2)
        batch = BatchEngine(pair, requests, config)
        batch.run()
        batch.close()
        made = batch.generated()
        for name in ("ours", "again"):
            key = tuple(made[name])
            counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact)
    assert chi_square(exact, counts) >= LEVEL

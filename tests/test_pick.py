"""The default drafter and K measured on the serving machine (engine.pick): what a pick measures, what it keeps per
CPU, how it explains a loss, and how the app's controls start from it."""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest

from engine import metrics
from engine.clock import machine_name
from engine.config import DrafterKind, SpecConfig
from engine.pair import ModelPair
from engine.pick import Candidate, Pick, PickStopped, Tried, candidates_for, load_pick, measure_pick, save_pick
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeEngine

SAMPLING = SamplingParams(0.2, 0, 0.9)
CPU = "Test CPU 9000, 2 torch threads"


@pytest.fixture(scope="module")
def pair(builtin_pair) -> ModelPair:
    draft, target = builtin_pair
    return ModelPair(target, draft)


def prompt_ids(pair: ModelPair) -> list[list[int]]:
    tok = pair.target.tokenizer
    return [tok(text)["input_ids"] for text in ("def fibonacci(n):\n    if n < 2:\n", "import os\n\n\ndef walk(path):\n")]


def test_a_pick_reads_each_candidate_from_its_own_rounds(pair, cache):
    candidates = (Candidate(DrafterKind.MODEL.value, 2), Candidate(DrafterKind.NGRAM.value, 2))
    seen = []
    pick = measure_pick(pair, prompt_ids(pair), candidates, SAMPLING, CPU, new_tokens=16,
                        progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 6) for i in range(1, 7)]         # 2 prompts x (target-only + 2 candidates)
    model, ngram = pick.tried
    # the same configuration decoded again (same seed, same prompts) verifies the same positions
    rounds = []
    for ids in prompt_ids(pair):
        engine = SpeculativeEngine(pair, ids, SpecConfig(drafter=DrafterKind.MODEL, k=2, sampling=SAMPLING,
                                                        max_new_tokens=16, stop_at_eos=False, record=False))
        rounds += engine.run()
        engine.close()
    assert model.alpha == pytest.approx(metrics.Tally.of(rounds).alpha())
    assert ngram.c == 0.0 and model.c > 0 and model.r >= 1.0 - 0.5
    assert pick.best in pick.tried and pick.target_tokens_per_s > 0
    assert {t.speedup for t in pick.tried} == {t.tokens_per_s / pick.target_tokens_per_s for t in pick.tried}


def test_a_pick_waits_for_the_compute_gate_and_stops_when_asked(pair):
    from engine.clock import ComputeGate

    gate, stop, progressed = ComputeGate(), threading.Event(), threading.Event()
    outcome = []

    def pick():
        try:
            measure_pick(pair, prompt_ids(pair)[:1], (Candidate(DrafterKind.NGRAM.value, 2),), SAMPLING, CPU,
                         new_tokens=64, gate=gate, stop=stop, progress=lambda d, t: progressed.set())
            outcome.append("finished")
        except PickStopped:
            outcome.append("stopped")

    with gate.held():                    # a visitor's round holds the cores: the pick runs no round meanwhile
        thread = threading.Thread(target=pick)
        thread.start()
        assert not progressed.wait(0.5)
        stop.set()
    thread.join(60)
    assert outcome == ["stopped"] and not progressed.is_set()


def tried(drafter: str, k: int, speedup: float) -> Tried:
    return Tried(Candidate(drafter, k), 30.0 * speedup, speedup, 0.31, 0.072, 1.39)


def a_pick(*speedups: float) -> Pick:
    rows = tuple(tried(DrafterKind.EAGLE_HYBRID.value, k, s) for k, s in enumerate(speedups, start=1))
    return Pick(CPU, "smollm2", "fp32", 0.2, 0.9, 3, 48, 30.0, rows)


def test_the_fastest_candidate_wins_only_when_it_beats_target_only():
    assert a_pick(0.9, 1.31, 1.2).chosen == Candidate(DrafterKind.EAGLE_HYBRID.value, 2)
    assert "eagle-hybrid, K=2 decoded 1.31× as fast as target-only" in a_pick(0.9, 1.31, 1.2).explain()
    assert "slim" not in a_pick(0.9, 1.31, 1.2).explain()
    slim = a_pick(0.9, 1.08).explain()                    # a win, but a small one: why, in α, c and r
    assert "decoded 1.08× as fast" in slim and "A slim margin (α 0.31, c 0.072, r(K+1) 1.39)" in slim
    lost = a_pick(0.56, 0.8, 0.7)
    assert lost.chosen is None
    assert lost.explain().startswith("No drafter beat target-only on this CPU (Test CPU 9000, 2 torch threads) "
                                     "at T = 0.2: the best, eagle-hybrid, K=2, decoded 0.80× (α 0.31, c 0.072, "
                                     "r(K+1) 1.39).")


def test_the_bench_default_stays_when_the_quick_measurement_cannot_tell_it_from_the_fastest():
    k2 = Candidate(DrafterKind.EAGLE_HYBRID.value, 2)
    close = replace(a_pick(1.1, 1.26, 1.31, 1.2), preferred=k2)          # K=2 within 10% of K=3
    assert close.chosen == k2 and "the fastest, eagle-hybrid, K=3 at 1.31×, is within 10%, so the bench default " \
        "stays" in close.explain()
    assert replace(a_pick(1.1, 1.15, 1.31), preferred=k2).chosen.k == 3   # more than 10% behind: the fastest
    assert replace(a_pick(1.02, 0.96, 1.05), preferred=k2).chosen.k == 3  # the default lost to target-only


def test_a_pick_is_kept_per_cpu_model_and_sampling(cache):
    cands = candidates_for(has_draft=False, has_eagle=True)
    assert Candidate(DrafterKind.EAGLE_HYBRID.value, 2) in cands and all(c.k <= 4 for c in cands)
    pick = a_pick(1.1, 1.4)
    save_pick(pick, SAMPLING, cands)
    assert load_pick(CPU, "smollm2", "fp32", SAMPLING, cands) == pick
    assert load_pick("Another CPU, 2 torch threads", "smollm2", "fp32", SAMPLING, cands) is None
    assert load_pick(CPU, "smollm2", "int8", SAMPLING, cands) is None
    assert load_pick(CPU, "smollm2", "fp32", SamplingParams(1.0, 0, 1.0), cands) is None
    assert load_pick(CPU, "smollm2", "fp32", SAMPLING, cands[:2]) is None
    assert load_pick(CPU, "smollm2", "fp32", SAMPLING, cands, preferred=cands[1]) is None
    preferring = replace(pick, preferred=cands[1])
    save_pick(preferring, SAMPLING, cands)
    assert load_pick(CPU, "smollm2", "fp32", SAMPLING, cands, preferred=cands[1]) == preferring
    [kept] = (cache / "picks").iterdir()
    kept.write_text(json.dumps({"not": "a pick"}))           # damaged: measured again, never read half-way
    assert load_pick(CPU, "smollm2", "fp32", SAMPLING, cands) is None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_CACHE", str(tmp_path))
    return tmp_path


def test_the_controls_start_from_the_pick_and_say_where_it_comes_from(cache):
    from playground.controls import default_drafter, preset_defaults
    from playground.registry import ModelRegistry

    registry = ModelRegistry()
    preset = registry.presets[0]
    assert registry.recommended(preset) == preset.recommended and registry.pick_note(preset.key) == ""
    registry.picking.add(preset.key)
    assert registry.pick_note(preset.key).startswith("Measuring which drafter and K decode fastest")
    registry.picks[preset.key] = Pick(CPU, "t", "fp32", 1.0, 1.0, 3, 48, 100.0,
                                      (tried(DrafterKind.NGRAM.value, 3, 1.2), tried(DrafterKind.MODEL.value, 2, 1.1)))
    rec = registry.recommended(preset)
    assert (rec.drafter, rec.k, rec.measured_here) == (DrafterKind.NGRAM, 3, True)
    assert default_drafter(preset, rec) == DrafterKind.NGRAM.value
    _, _, drafter, k, *_ = preset_defaults(registry, preset.key)
    assert drafter["value"] == DrafterKind.NGRAM.value and k == 3
    assert "measured on this machine's CPU" in drafter["info"]
    registry.picks[preset.key] = a_pick(0.7, 0.9)          # nothing won: the preset's own default, and why
    assert registry.recommended(preset) == preset.recommended
    assert registry.pick_note(preset.key).startswith("No drafter beat target-only")


def test_a_kept_pick_is_read_by_source_before_any_model_loads(cache):
    from playground.registry import ModelRegistry

    registry = ModelRegistry()
    key = registry.presets[0].key
    _, sampling, candidates, preferred = registry._pick_of(key)
    assert registry.kept_pick(key) is None and key not in registry.picks
    preset = registry.presets[0]
    kept = Pick(machine_name(), preset.target, preset.weights, sampling.temperature, sampling.top_p, 3, 48, 100.0,
                (tried(candidates[0].drafter, candidates[0].k, 1.3),), preferred)
    save_pick(kept, sampling, candidates)
    assert ModelRegistry().kept_pick(key) == kept
    assert registry.kept_pick(key) == kept and registry.picks[key] == kept


def test_a_pick_that_cannot_be_kept_is_still_used_by_this_process(cache, monkeypatch):
    import engine.pick as pick_module
    from playground.registry import ModelRegistry

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(pick_module, "save_pick", refuse)
    monkeypatch.setattr(pick_module, "NEW_TOKENS", 8)
    monkeypatch.setattr(pick_module, "candidates_for", lambda has_draft, has_eagle: (
        Candidate(DrafterKind.NGRAM.value, 2),))
    registry = ModelRegistry()
    key = registry.presets[0].key
    measured = registry.measure_pick(key, registry.pair(key))
    assert registry.picks[key] == measured and key not in registry.picking
    assert not (cache / "picks").exists()

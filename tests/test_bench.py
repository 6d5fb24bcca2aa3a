"""The bench: a tiny in-process run's JSON has every field and identical greedy tokens; the maths it reports."""
from __future__ import annotations

import json
import math
from dataclasses import fields

import pytest

from engine import metrics
from engine.bench.cli import main
from engine.bench.clock import ForwardTime
from engine.bench.methods import Method, build_methods
from engine.bench.results import MethodResult, summarize
from engine.bench.runs import Phases, RunSample
from engine.config import DrafterKind

NEW = 6


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, str]:
    """One --quick bench (built-in pair, K=2, 1 prompt, 1 repeat, 6 new tokens): (JSON document, stdout)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("bench") / "bench.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(["--quick", "--ks", "2", "--new-tokens", str(NEW), "--no-progress", "--json", str(out)])
    assert status == 0
    return json.loads(out.read_text()), stdout.getvalue()


def test_json_has_every_field_for_every_method(quick_run):
    doc, _ = quick_run
    expected = {m.label for m in build_methods(("target-transformers", "hf-assisted", "hf-prompt-lookup", "v2", "v1",
                                                "v2-heuristic", "v1-heuristic", "ngram", "hybrid", "hybrid-heuristic"),
                                               (2,))}
    records = doc["records"]
    assert {r["label"] for r in records} == expected | {"hf-generate", "target"}
    names = {f.name for f in fields(MethodResult)}
    for r in records:
        assert set(r) == names, r["label"]
        assert r["tokens"] == NEW and r["prompts"] == 1 and r["repeats"] == 1
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0, r["label"]
        if r["family"] == "engine":  # generate does not report which positions it verified: no alpha
            assert r["predicted_speedup"] is not None and r["predicted_speedup"] > 0, r["label"]
            assert r["accepted"] <= r["verified"] <= r["drafted"], r["label"]
            if r["drafted"]:
                assert r["alpha"] == pytest.approx(r["accepted"] / r["verified"]), r["label"]
        assert 0.0 <= r["draft_acceptance_rate"] <= 1.0 and r["accepted"] <= r["drafted"]
        assert r["mean_accepted_length"] * r["rounds"] == pytest.approx(r["tokens"])
        assert (r["phases_ms_per_token"] is None) == (r["family"] == "hf")
    assert doc["meta"]["new_tokens"] == NEW and doc["meta"]["prompt_lengths"] == [32]
    assert doc["meta"]["calibration"]["ns"][0] == 1   # the curve itself: tests/test_calibration.py


def test_identical_tokens_for_every_greedy_method(quick_run):
    doc, stdout = quick_run
    for r in doc["records"]:
        assert r["identical_tokens"] is True and r["mismatched_prompts"] == [], r["label"]
    assert doc["meta"]["all_identical"] is True
    assert "identical tokens: all methods" in stdout


def test_baselines_and_constant_k_accounting(quick_run):
    doc, _ = quick_run
    by_label = {r["label"]: r for r in doc["records"]}
    baselines = ("hf-generate", "target", "target-transformers")
    for name in baselines:
        r = by_label[name]
        assert r["target_forwards_per_token"] == 1.0 and r["drafted"] == 0 and r["predicted_speedup"] == 1.0
    # Speed-ups are over the fastest target-only method, whichever it was in this (noisy) tiny run.
    fastest = max(baselines, key=lambda n: by_label[n]["tokens_per_s"])
    assert by_label[fastest]["speedup"] == pytest.approx(1.0) and doc["meta"]["fastest_baseline"] == fastest
    assert all(by_label[n]["speedup"] <= 1.0 + 1e-9 for n in baselines)
    for name in ("v2 K=2", "v1 K=2", "hf-assisted K=2"):
        # Model drafters draft K per round, except a last round capped by the token budget.
        r = by_label[name]
        assert r["drafted"] >= 2 * (r["rounds"] - 1) and r["c"] > 0, name


def _sample(prompt: int, tokens: list[int], rounds_k: list[int], accepted: int, verified: int | None) -> RunSample:
    # A slow prefill forward on each model first: c and r must leave it out.
    fwd = [ForwardTime(q=32, rows=1, seconds=0.5)] + [ForwardTime(q=k + 1, rows=0, seconds=0.01 * (1 + 0.1 * k))
                                                      for k in rounds_k]
    draft = [ForwardTime(q=32, rows=1, seconds=0.5)] + [ForwardTime(q=1, rows=1, seconds=0.002)] * sum(rounds_k)
    return RunSample(prompt, tokens, wall_s=0.5, ttft_s=0.1, rounds_k=rounds_k, accepted=accepted, verified=verified,
                     target_fwd=fwd, draft_fwd=draft, phases=Phases(0.0, 1.0, 2.0, 0.0, 0.0, 0.0) if verified else None,
                     checks=[[True, False], [False]])


BASELINE = [_sample(0, [1, 2, 3, 4], [0, 0, 0], 0, None)]   # 8 tokens/s; 7.5 after the first token


def test_summarize_flags_mismatched_tokens_and_reads_c_and_r_from_the_runs():
    method = Method("v2", 2)
    reference = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}
    samples = [_sample(0, [1, 2, 3, 4], [2, 2], 1, 3), _sample(1, [5, 6, 9, 8], [2, 2], 1, 3)]
    result = summarize(method, samples, t1=0.01, fastest=BASELINE, reference=reference, r_of_n=lambda n: 1.5)
    assert result.identical_tokens is False and result.mismatched_prompts == [1]
    assert result.draft_acceptance_rate == 0.25 and result.mean_accepted_length == 2.0
    assert result.alpha == pytest.approx(2 / 6)   # accepted / verified over the first repeat of each prompt
    assert result.c == pytest.approx(0.2) and result.r == pytest.approx(1.2) and result.r_calibrated == 1.5
    assert result.speedup == pytest.approx(1.0)  # 8 tokens in 2 x 0.5 s against 8 tokens/s
    expected = metrics.predicted_speedup(2 / 6, 2, 0.2, 1.5)
    assert result.predicted_speedup == pytest.approx(expected)
    assert result.predicted_from_rates == pytest.approx(
        (1 + 0.5 + 0.5 * 0.0) / (0.2 * 2 + 1.5))   # rates [1/2, 0/1] from the checks
    # meas/pred compares the decode speed-up (6 tokens in 2 x 0.4 s against 7.5 tokens/s) with the prediction,
    # and is taken apart: 8 tokens against 4 E(1/3, 2); the cost with r cal 1.5 against the rounds' 1.2
    assert result.decode_speedup == pytest.approx(1.0) and result.efficiency == pytest.approx(1.0 / expected)
    gap = result.gap
    assert gap.tokens == pytest.approx(8 / (4 * (1 + 1 / 3 + 1 / 9)))
    assert gap.verify == pytest.approx((0.2 * 8 + 4 * 1.5) / (0.2 * 8 + 4 * 1.2))
    assert gap.tokens * gap.verify * gap.rest == pytest.approx(result.efficiency)
    assert result.forward_share == pytest.approx((2 * 0.012 + 4 * 0.002) / 0.4)   # decode forwards / wall - TTFT


@pytest.mark.parametrize("name, c", [("eagle", 0.2), ("eagle-hybrid", 0.2), ("ngram", 0.0)])
def test_an_eagle_heads_step_is_its_draft_cost(name, c):
    """The head's forwards are draft forwards: c is their cost (prompt lookup's is 0)."""
    samples = [_sample(0, [1, 2, 3, 4], [2, 2], 1, 3)]
    result = summarize(Method(name, 2), samples, t1=0.01, fastest=BASELINE, reference={0: [1, 2, 3, 4]},
                       r_of_n=lambda n: 1.5)
    assert result.c == pytest.approx(c)


def test_generate_gets_no_prediction_without_verified_positions():
    samples = [_sample(0, [1, 2, 3, 4], [2, 2], 2, None)]
    result = summarize(Method("hf-assisted", 2), samples, t1=0.01, fastest=BASELINE, reference={0: [1, 2, 3, 4]},
                       r_of_n=lambda n: 1.5)
    assert result.alpha is None and math.isnan(result.predicted_speedup) and result.draft_acceptance_rate == 0.5


def test_a_method_written_with_its_k_runs_at_that_k_only():
    built = build_methods(["eagle:6", "v2", "eagle:2", "eagle:6", "tree-dynamic:16"], (1, 4))
    assert [(m.name, m.k) for m in built] == [("hf-generate", None), ("target", None), ("v2", 1), ("v2", 4),
                                              ("eagle", 2), ("eagle", 6), ("tree-dynamic", 16)]


def test_a_tree_is_compared_with_its_own_drafters_chains():
    from engine.bench.report import same_drafter_chains

    assert same_drafter_chains("tree-dynamic-q") == ["v2"] and same_drafter_chains("eagle-tree-static") == ["eagle"]
    assert same_drafter_chains("hybrid-tree-dynamic") == ["v2", "hybrid"]
    assert same_drafter_chains("eagle-hybrid-tree-static") == ["eagle", "eagle-hybrid"]


@pytest.mark.parametrize("name, drafter", [("hybrid-tree-dynamic", DrafterKind.HYBRID),
                                           ("eagle-hybrid-tree-static", DrafterKind.EAGLE_HYBRID),
                                           ("eagle-tree-dynamic", DrafterKind.EAGLE), ("tree-static-q", DrafterKind.MODEL),
                                           ("hybrid", DrafterKind.HYBRID)])
def test_tree_methods_name_their_drafter_and_tree(name, drafter):
    config = Method(name, 16).spec_config(64)
    assert config.drafter is drafter
    assert (config.tree is not None) == ("tree" in name)
    if config.tree is not None:
        assert config.tree.calibrated == (not name.endswith("-q"))
        assert config.tree.nodes == 16 and (not config.tree.widths or sum(config.tree.widths) == 16)


def test_ngram_min2_copies_only_after_a_two_token_match():
    """vLLM's prompt-lookup rule beside the engine's default: the same drafter, a longer minimum match."""
    import torch

    from engine.config import SpecConfig
    from engine.drafters.ngram import NgramDrafter

    plain, strict = Method("ngram", 4).spec_config(64), Method("ngram-min2", 4).spec_config(64)
    assert plain.drafter is strict.drafter is DrafterKind.NGRAM
    assert (plain.ngram_min, strict.ngram_min) == (SpecConfig().ngram_min, 2)
    assert plain.ngram_max == strict.ngram_max
    committed = [5, 7, 9, 3, 8, 5]             # only the last token has occurred before
    drafters = [NgramDrafter(c.ngram_max, c.ngram_min, 16, torch.device("cpu")) for c in (plain, strict)]
    assert [d.match(committed, 3)[1] for d in drafters] == [[7, 9, 3], []]
    assert [d.match(committed + [7], 3)[1] for d in drafters] == [[9, 3, 8]] * 2


@pytest.mark.parametrize("argv", [["--ks", "0"], ["--methods", "v3"], ["--repeats", "0"], ["--profile", "v2:x"],
                                  ["--methods", "v2:x"], ["--methods", "v2:99"], ["--methods", "tree-static:5"]])
def test_bad_input_exits_2(argv, capsys):
    assert main(["--quick", "--no-progress", *argv]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_profile_accounts_for_the_whole_wall_time(capsys):
    assert main(["--quick", "--new-tokens", str(NEW), "--profile", "v2:2", "--profile-top", "5"]) == 0
    out = capsys.readouterr().out
    shares = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-1].endswith("%") and parts[0] in ("prefill", "draft", "verify", "commit",
                                                                          "other", "outside"):
            assert float(parts[-2]) >= 0.0
            shares[parts[0]] = float(parts[-1].rstrip("%"))
    assert set(shares) == {"prefill", "draft", "verify", "commit", "other", "outside"}
    assert sum(shares.values()) == pytest.approx(100.0, abs=0.6)   # the phases partition the wall time
    forwards = next(line for line in out.splitlines() if "model forwards (engine clock)" in line)
    rest = next(line for line in out.splitlines() if "everything else" in line)
    share = lambda line: float(line.split()[-1].rstrip("%")) if line.split()[-1].endswith("%") else float(  # noqa: E731
        line.split("%")[0].split()[-1])
    assert share(forwards) + share(rest) == pytest.approx(100.0, abs=0.2)
    assert 0 < share(forwards) < 100
    assert "cProfile, top 5 functions by own time" in out


def test_sampled_bench_counts_every_prompt_and_rejects_greedy(builtin_pair, capsys):
    """The sampled bench sums both engines over its prompts: each prompt gives max_new_tokens tokens,
    and alpha is accepted over verified positions of the speculative runs."""
    from engine.bench.sampled import main, measure, prompts_for
    from engine.config import DrafterKind, SpecConfig
    from engine.pair import ModelPair
    from engine.sampling import SamplingParams

    draft, target = builtin_pair
    prompts = prompts_for(target, 2)
    assert len(prompts) == 2 and all(isinstance(p, list) and len(p) == 128 for p in prompts)
    config = SpecConfig(drafter=DrafterKind.MODEL, k=3, max_new_tokens=12, stop_at_eos=False,
                        sampling=SamplingParams(temperature=0.7, top_p=0.95))
    result = measure(ModelPair(target, draft), prompts, config)
    assert result.tokens == 24 and result.prompts == 2 and 0 < result.alpha <= 1
    assert result.tokens_per_s > 0 and result.baseline_tokens_per_s > 0
    for bad, message in [(["--temperature", "0"], "above 0"), (["--target", "smollm2", "--drafter", "model"],
                                                             "built-in target only"),
                         (["--k", "2,x"], "separated by commas"), (["--k", "2,99"], "K must be an integer")]:
        with pytest.raises(SystemExit):
            main(bad)
        assert message in capsys.readouterr().err
    # several heads in one process, one line each; a head that is not there gets its sentence
    assert main(["--eagle", "builtin,builtin", "--num-prompts", "1", "--new-tokens", "4", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["eagle"] for x in lines] == ["builtin", "builtin"] and all(x["tokens"] == 4 for x in lines)
    # several Ks in one process: each head at each K, in that order
    assert main(["--k", "1,3,1", "--num-prompts", "1", "--new-tokens", "4", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["k"] for x in lines] == [1, 3] and all(x["tokens"] == 4 for x in lines)
    assert main(["--eagle", "no-such-head", "--num-prompts", "1"]) == 2 and "no-such-head" in capsys.readouterr().err


def test_two_eagle_heads_are_compared_in_one_bench(tmp_path, capsys):
    """The eagle3 methods draft with the second head (--eagle3), the eagle ones with the first (--eagle); here
    both are the built-in target's head loaded twice, so they must draft alike, and decode like target-only."""
    assert Method("eagle3-hybrid-tree-dynamic", 4).drafter == "eagle-hybrid" and Method("eagle3", 2).head == "eagle3"
    assert Method("eagle", 2).head == "" and Method("eagle3", 2).spec_config(4).drafter is DrafterKind.EAGLE
    out = tmp_path / "b.json"
    assert main(["--quick", "--ks", "2", "--new-tokens", str(NEW), "--no-progress", "--methods", "eagle,eagle3",
                 "--eagle3", "builtin", "--json", str(out)]) == 0
    by = {r["label"]: r for r in json.loads(out.read_text())["records"]}
    assert by["eagle3 K=2"]["identical_tokens"] and by["eagle K=2"]["identical_tokens"]
    # the report says how the heads multiplied (the suite drafts with fp32 copies on every CPU, see conftest)
    assert json.loads(out.read_text())["meta"]["eagle_matrices"] == "fp32 copies"
    assert "the EAGLE head drafts with fp32 copies" in capsys.readouterr().out
    assert (by["eagle3 K=2"]["accepted"], by["eagle3 K=2"]["drafted"]) == (by["eagle K=2"]["accepted"],
                                                                          by["eagle K=2"]["drafted"])
    assert main(["--quick", "--ks", "2", "--no-progress", "--methods", "eagle3", "--eagle3", "no-such-head"]) != 0
    assert "eagle3" in capsys.readouterr().err

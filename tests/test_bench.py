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
from engine.bench.results import MethodResult, predicted, summarize
from engine.bench.runs import RunSample

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
        assert r["predicted_speedup"] is not None and r["predicted_speedup"] > 0, r["label"]
        assert 0.0 <= r["acceptance_rate"] <= 1.0 and r["accepted"] <= r["drafted"]
        assert r["mean_accepted_length"] * r["rounds"] == pytest.approx(r["tokens"])
        assert (r["phases_ms_per_token"] is None) == (r["family"] == "hf")
    assert doc["meta"]["new_tokens"] == NEW and doc["meta"]["prompt_lengths"] == [32]


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


def _sample(prompt: int, tokens: list[int], rounds_k: list[int], accepted: int) -> RunSample:
    # A slow prefill forward on each model first: c and r must leave it out.
    fwd = [ForwardTime(q=32, rows=1, seconds=0.5)] + [ForwardTime(q=k + 1, rows=0, seconds=0.01 * (1 + 0.1 * k))
                                                      for k in rounds_k]
    draft = [ForwardTime(q=32, rows=1, seconds=0.5)] + [ForwardTime(q=1, rows=1, seconds=0.002)] * sum(rounds_k)
    return RunSample(prompt, tokens, wall_s=0.5, ttft_s=0.1, rounds_k=rounds_k, accepted=accepted,
                     target_fwd=fwd, draft_fwd=draft, phases=None)


def test_summarize_flags_mismatched_tokens():
    method = Method("hf-assisted", 2)
    reference = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}
    samples = [_sample(0, [1, 2, 3, 4], [2, 2], 2), _sample(1, [5, 6, 9, 8], [2, 2], 2)]
    result = summarize(method, samples, t1=0.01, fastest_tps=8.0, reference=reference)
    assert result.identical_tokens is False and result.mismatched_prompts == [1]
    assert result.acceptance_rate == 0.5 and result.mean_accepted_length == 2.0
    assert result.c == pytest.approx(0.2) and result.r == pytest.approx(1.2)
    assert result.speedup == pytest.approx(1.0)  # 8 tokens in 2 x 0.5 s against 8 tokens/s


def test_predicted_is_leviathan_at_constant_k():
    alpha, c, r = 0.6, 0.2, {4: 1.3}
    assert predicted(alpha, [4] * 10, c, r) == pytest.approx(metrics.predicted_speedup(alpha, 4, c, 1.3))
    # A round that drafted nothing costs one forward and yields one token.
    mixed = predicted(alpha, [4, 0], c, r)
    e4 = metrics.expected_tokens_per_round(alpha, 4)
    assert mixed == pytest.approx((e4 + 1) / (c * 4 + 1.3 + 1))
    assert math.isfinite(predicted(0.0, [3], 0.0, {}))
    # A hybrid round that copied its drafts spent no draft forward: only the verify is paid.
    copied = predicted(alpha, [4, 8], c, {4: 1.3, 8: 1.9}, draft_forwards=[4, 0])
    e8 = metrics.expected_tokens_per_round(alpha, 8)
    assert copied == pytest.approx((e4 + e8) / (c * 4 + 1.3 + 1.9))
    assert copied > predicted(alpha, [4, 8], c, {4: 1.3, 8: 1.9})


@pytest.mark.parametrize("argv", [["--ks", "0"], ["--methods", "v3"], ["--repeats", "0"], ["--profile", "v2:x"]])
def test_bad_input_exits_2(argv, capsys):
    assert main(["--quick", "--no-progress", *argv]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_profile_reports_phases(capsys):
    assert main(["--quick", "--new-tokens", str(NEW), "--profile", "v2:2", "--profile-top", "5"]) == 0
    out = capsys.readouterr().out
    for phase in ("draft", "verify", "commit", "other", "model forwards", "cProfile"):
        assert phase in out


def test_forward_clocks_time_the_fused_forward_and_restore_it(builtin_pair):
    from engine.bench.clock import ForwardClock
    from engine.runner import ModelRunner

    draft = builtin_pair[0]
    runner = ModelRunner(draft, 64)
    assert runner.forward_path == "fused"
    cache = runner.new_sequence()
    with ForwardClock(draft) as outer, ForwardClock(draft) as inner:  # nested: one model, two clocks
        runner.forward(cache, [1, 2, 3], last_only=True)
        runner.forward(cache, [4])
    assert [(t.q, t.rows) for t in outer.times] == [(t.q, t.rows) for t in inner.times] == [(3, 1), (1, 0)]
    assert "forward" not in vars(runner.fused)  # the class's method again
    runner.forward(cache, [5])
    assert len(outer.times) == 2

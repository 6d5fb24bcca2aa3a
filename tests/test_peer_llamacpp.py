"""peer-bench --peer llama.cpp: what it reads from llama.cpp's server (a real /metrics capture), its sentences when
llama.cpp cannot be built or started, and, where llama.cpp is compiled under the cache, greedy parity with it."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine.bench import peer_llamacpp as lc
from engine.bench.peer import PeerUnavailable, main
from engine.sources import smollm2_gguf

FIXTURE = Path(__file__).resolve().parent / "data" / "llamacpp-b11434-cpu-metrics-ngram.txt"


def test_verify_steps_come_from_the_servers_metrics():
    assert lc.drafts_of(FIXTURE.read_text()) == 35.0        # llamacpp:spec_decode_num_drafts_total in the capture
    no_speculation = "\n".join(line for line in FIXTURE.read_text().splitlines() if "spec_decode" not in line)
    assert lc.drafts_of(no_speculation) == 0.0


@pytest.mark.parametrize("line, fraction", [("[12/216] Building CXX object x.o", 12 / 216),
                                            ("[ 45%] Built target ggml", 0.45), ("-- Configuring done", None),
                                            ("[a/b] odd", None)])
def test_build_progress_is_read_from_ninja_and_make_lines(line, fraction):
    assert lc._ninja_fraction(line) == (pytest.approx(fraction) if fraction is not None else None)


def test_a_missing_compiler_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setattr(lc.shutil, "which", lambda name: None if name == "cmake" else "/usr/bin/" + name)
    with pytest.raises(PeerUnavailable, match="needs cmake: install them"):
        lc.ensure_llamacpp(tmp_path / "llama.cpp", lambda m: None)


def _program(path: Path, script: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_a_server_that_dies_at_start_is_reported_with_its_last_words(tmp_path):
    _program(lc.tool(tmp_path, "llama-server"),
             'echo "loading model"\necho "error: failed to load model $2" >&2\nexit 1\n')
    with pytest.raises(PeerUnavailable, match=r"exited at start \(code 1\): loading model \| error: failed to load"):
        with lc.LlamaServer(tmp_path, tmp_path / "absent.gguf", [], threads=1):
            pass


def test_a_server_that_never_answers_is_stopped_and_reported(tmp_path, monkeypatch):
    _program(lc.tool(tmp_path, "llama-server"), 'echo "warming up"\nexec sleep 60\n')
    monkeypatch.setattr(lc, "START_TIMEOUT_S", 1.0)
    server = lc.LlamaServer(tmp_path, tmp_path / "m.gguf", [], threads=1)
    with pytest.raises(PeerUnavailable, match=r"did not answer /health within 1 s: warming up"):
        server.__enter__()
    assert server._proc.poll() is not None       # not left running


def test_what_llamacpp_does_not_compare_is_refused_before_building(tmp_path, capsys):
    assert main(["--peer", "llama.cpp", "--llamacpp", str(tmp_path / "never"), "--batch", "1,2"]) == 2
    assert "--batch compares with vLLM" in capsys.readouterr().err and not (tmp_path / "never").exists()


BENCH = Path(__file__).resolve().parent / "data" / "llamabench-b11434-q4_1-rn.json"


def test_llamas_r_of_n_is_read_from_its_benchs_report_as_the_engines_is_made():
    import json
    import statistics

    report = json.loads(BENCH.read_text())    # llama-bench -p 1,2,3,5,9 -n 0 -d 16 -r 3 on the wheel's Q4_1 file
    curve = lc.rn_from_bench(BENCH.read_text(), "smollm2", "llama.cpp Q4_1", 16)
    medians = [statistics.median(t["samples_ns"]) / 1e6 for t in report]
    assert curve.ns == [1, 2, 3, 5, 9] and curve.ms == pytest.approx(medians) and curve.repeats == 3
    assert curve.r[0] == 1.0 and curve.r == pytest.approx([m / medians[0] for m in medians])
    # a forward of 5 timed faster than one of 3 (a noisy repetition) is smoothed, as specplay's own curve is
    report[3]["samples_ns"] = [int(medians[2] * 1e6 * 0.9)] * 3
    dipped = lc.rn_from_bench(json.dumps(report), "smollm2", "llama.cpp Q4_1", 16)
    assert dipped.r == sorted(dipped.r) and dipped.r[2] == dipped.r[3] < curve.r[3]


@pytest.mark.parametrize("edit, message", [
    (lambda r: "not json", "is not JSON"),
    (lambda r: [], "holds no test"),
    (lambda r: r[1:], "has no test of 1 token"),
    (lambda r: [dict(t, n_gen=16) for t in r], "expected prompt tests"),
    (lambda r: [dict(t, n_depth=128) for t in r], "after 16 cached ones, got n_prompt 1, n_gen 0, n_depth 128"),
    (lambda r: [dict(t, samples_ns=[]) for t in r], "has no timed repetition"),
    (lambda r: [{k: v for k, v in t.items() if k != "samples_ns"} for t in r], "lacks n_prompt"),
])
def test_a_bench_report_that_does_not_fit_is_one_sentence(edit, message):
    import json

    edited = edit(json.loads(BENCH.read_text()))
    with pytest.raises(ValueError, match=message):
        lc.rn_from_bench(edited if isinstance(edited, str) else json.dumps(edited), "smollm2", "llama.cpp Q4_1", 16)


def test_a_bench_that_fails_is_reported_with_its_last_words(tmp_path):
    _program(lc.tool(tmp_path, "llama-bench"), 'echo "error: failed to load model" >&2\nexit 1\n')
    with pytest.raises(PeerUnavailable, match="llama-bench on m.gguf failed here: error: failed to load model"):
        lc.measure_rn(tmp_path, tmp_path / "m.gguf", "smollm2", "llama.cpp F32", 16, (1, 2), 1, 1)
    _program(lc.tool(tmp_path, "llama-bench"), f'cat {BENCH}\n')       # a bench that answers: its own report
    assert lc.measure_rn(tmp_path, tmp_path / "m.gguf", "smollm2", "llama.cpp Q4_1", 16, (1, 2), 1, 1).ns[-1] == 9
    with pytest.raises(PeerUnavailable, match="llama-bench on m.gguf: expected prompt tests of n >= 1 tokens after 32"):
        lc.measure_rn(tmp_path, tmp_path / "m.gguf", "smollm2", "llama.cpp Q4_1", 32, (1, 2), 1, 1)


FOLDER = Path(os.environ.get("SPECPLAY_LLAMACPP", lc.default_folder()))


@pytest.mark.skipif(not all(lc._runs(lc.tool(FOLDER, t)) for t in lc.TOOLS) or smollm2_gguf() is None,
                    reason="llama.cpp is not compiled here (peer-bench --peer llama.cpp --install-only)")
def test_llamacpp_decodes_the_f32_copy_token_for_token_as_the_engine():
    from engine.bench.methods import BenchSettings, Method
    from engine.bench.prompts import make_prompts
    from engine.bench.runs import BenchModels, run_engine
    from engine.pair import load_pair

    models = BenchModels(load_pair("smollm2"))
    prompts = make_prompts(BenchSettings(prompt_set="chat", num_prompts=2, prompt_tokens=128, new_tokens=24),
                           models.target)
    f32 = lc.f32_copy(FOLDER, smollm2_gguf())
    with lc.LlamaServer(FOLDER, f32, list(lc.NGRAM_K4), threads=2) as server:   # its n-gram speculation on
        for p in prompts:
            assert server.complete(p.ids, 24)["tokens"] == run_engine(Method("target"), models, p.ids, 24).tokens


@pytest.mark.skipif(not lc._runs(lc.tool(FOLDER, "llama-server")),
                    reason="llama.cpp is not compiled here (peer-bench --peer llama.cpp --install-only)")
def test_llamacpp_decodes_the_builtin_pairs_gguf_copies_as_the_engine_and_drafts_with_its_draft(builtin_pair,
                                                                                              tmp_path):
    """The built-in pair written as GGUF (engine.gguf_file.write_llama): llama.cpp's greedy tokens equal the
    engine's, and its draft-model speculation accepts what the same draft model's drafts earn in the engine."""
    from engine.config import SamplingParams, SpecConfig
    from engine.pair import ModelPair
    from engine.speculative import SpeculativeEngine

    draft, target = builtin_pair
    pair = ModelPair(target, draft)
    folder = tmp_path / "peer"
    for tool in lc.TOOLS:   # the compiled tools, the copies in a folder of the test's own
        lc.tool(folder, tool).parent.mkdir(parents=True, exist_ok=True)
        lc.tool(folder, tool).symlink_to(lc.tool(FOLDER, tool))
    target_gguf, draft_gguf = lc.builtin_copies(folder, pair)
    ids = target.tokenizer("def fibonacci(n):\n    ")["input_ids"]
    engine = SpeculativeEngine(pair, ids, SpecConfig(k=4, sampling=SamplingParams(temperature=0.0), max_new_tokens=40))
    while not engine.finished:
        engine.step()
    [method] = [m for m in lc.methods_for_builtin(draft_gguf) if m.specplay == "v2:4"]
    with lc.LlamaServer(folder, target_gguf, list(method.server), threads=2) as server:
        out = server.complete(ids, 40)
    eos = target.tokenizer.eos_token_id
    mine = engine.generated[:engine.generated.index(eos)] if eos in engine.generated else engine.generated
    assert out["tokens"][:len(mine)] == mine and len(mine) >= 8
    assert out["drafted"] > 0 and out["accepted"] > 0


def test_tokens_are_compared_up_to_the_end_of_specplays_turn(builtin_pair):
    """Past the end-of-turn token the two engines follow different rules (llama.cpp masks it, specplay emits it),
    so the comparison stops there; a difference before it is reported with the logits' gap where it happens."""
    from engine.bench.peer import Side, format_table

    _, target = builtin_pair
    eos = 99
    mine = Side([30.0], None, None, [[5, 6, eos, 7], [5, 6, 7, 8]])
    theirs = Side([50.0], None, None, [[5, 6, 8, 9], [5, 6, 9, 9]])
    cuts = [2, 4]
    cut_mine, cut_theirs = lc.through_end(mine, cuts), lc.through_end(theirs, cuts)
    assert cut_mine.tokens == [[5, 6], [5, 6, 7, 8]] and cut_theirs.tokens == [[5, 6], [5, 6, 9, 9]]
    table = format_table("t", [("target-only", cut_theirs, cut_mine)], cut_mine.tokens, peer="llama.cpp")
    assert "no (1 prompts differ)" in table
    [head, line] = lc.differences(target, [[1, 2, 3], [1, 2, 3]], cut_mine.tokens, cut_theirs.tokens)
    assert head.startswith("target-only tokens, F32 weights: 1 of 2 prompts identical")
    assert line.startswith("prompt 1: first difference at token 2: ")
    assert lc.differences(target, [[1, 2, 3]], [[5, 6]], [[5, 6]], "int4 against fp32") == \
        ["int4 against fp32: all 1 prompts identical"]
    # each row against target-only on its own weights: the int4 row against int4 target-only, not fp32's
    int4 = Side([50.0], None, None, [[5, 7], [5, 6, 7, 8]])
    table = format_table("t", [("target-only", cut_theirs, cut_mine), ("target-only, Q4_1 / int4", None, int4)],
                         cut_mine.tokens, peer="llama.cpp", references=[cut_mine.tokens, int4.tokens])
    assert table.splitlines()[-2].rstrip().endswith("yes")

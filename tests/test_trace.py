"""Traces: ComparedRun writes them, load_trace round-trips them exactly and rejects bad files clearly."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest

from engine import trace as trace_mod
from engine.clock import machine_name
from engine.compared import ComparedRun
from engine.config import SpecConfig
from engine.pair import ModelPair
from engine.records import Outcome, RoundRecord
from engine.trace import (
    ROUND_COLUMNS,
    TRACE_VERSION,
    TraceError,
    TraceWriter,
    config_from_dict,
    config_to_dict,
    export_csv,
    load_trace,
    make_header,
    round_from_dict,
    round_to_dict,
    rounds_dataframe,
    summary_from_dict,
    summary_to_dict,
)

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef add"
CONFIG = SpecConfig(k=3, max_new_tokens=12, block_size=4)


@pytest.fixture(scope="module")
def traced(tiny_pair, tmp_path_factory) -> tuple[Path, ComparedRun]:
    """A finished, closed ComparedRun with the trace it wrote (random draft: corrections, some accepts)."""
    draft, target = tiny_pair
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    run = ComparedRun(ModelPair(target, draft), PROMPT, CONFIG, trace_path=path)
    run.run_to_end()
    run.close()
    return path, run


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, objs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_compared_run_writes_header_rounds_and_summaries(traced) -> None:
    path, run = traced
    objs = lines_of(path)
    kinds = [(o["type"], o["stream"]) for o in objs]
    n_spec, n_base = len(run.spec.rounds), len(run.baseline.rounds)
    assert kinds[0] == ("header", None)
    assert kinds.count(("round", "spec")) == n_spec and kinds.count(("round", "baseline")) == n_base
    assert kinds[-2:] == [("summary", "spec"), ("summary", "baseline")]
    assert n_base == CONFIG.max_new_tokens and n_spec <= n_base  # the baseline emits one token per round


def test_load_trace_round_trips_exactly(traced, tiny_pair) -> None:
    path, run = traced
    t = load_trace(path)
    assert t.complete
    assert t.rounds == run.spec.rounds and t.baseline == run.baseline.rounds
    spec, base = run.summaries()
    assert summary_to_dict(t.summary) == summary_to_dict(spec)
    assert summary_to_dict(t.baseline_summary) == summary_to_dict(base)
    h = t.header
    assert (h.version, h.prompt, h.prompt_ids, h.seed) == (TRACE_VERSION, PROMPT, run.spec.prompt, CONFIG.seed)
    assert (h.target, h.draft) == (tiny_pair[1].name, tiny_pair[0].name)
    assert h.devices == {"target": "cpu", "draft": "cpu"} and h.dtypes["draft"] == "float32"
    assert set(h.versions) == {"python", "torch", "transformers", "specplay"}
    assert h.machine == machine_name() and "torch threads" in h.machine     # figures name the machine they ran on
    assert h.layers == tiny_pair[1].layers_in                          # where the target's layers ran
    assert t.config == CONFIG == config_from_dict(h.config)         # parsed once, by the reader
    assert load_trace(path.read_bytes()) == t


def test_round_dicts_round_trip_every_outcome(traced, tiny_pair) -> None:
    _, run = traced
    target = tiny_pair[1]
    self_run = ComparedRun(ModelPair(target, target), PROMPT, CONFIG, compare=False)   # all accepted: bonus rounds
    rounds = run.spec.rounds + run.baseline.rounds + self_run.run_to_end()
    self_run.close()
    finals = {r.final.outcome for r in rounds}
    positions = {p.outcome for r in rounds for p in r.positions}
    assert finals == {Outcome.CORRECTED, Outcome.BONUS} and Outcome.ACCEPTED in positions
    for r in rounds:
        d = round_to_dict(r)
        assert json.loads(json.dumps(d)) == d          # plain JSON, no enums or tensors left
        assert round_from_dict(json.loads(json.dumps(d))) == r


def test_summary_nan_rates_become_null(traced) -> None:
    spec, _ = traced[1].summaries()
    nan_spec = dataclasses.replace(spec, per_position_acceptance=[0.5, float("nan")])
    d = summary_to_dict(nan_spec)
    assert d["per_position_acceptance"] == [0.5, None]
    back = summary_from_dict(json.loads(json.dumps(d, allow_nan=False)))
    assert back.per_position_acceptance[0] == 0.5 and math.isnan(back.per_position_acceptance[1])


@pytest.mark.parametrize("config", [SpecConfig(drafter="ngram"), SpecConfig(mode="target")])
def test_header_records_no_draft_when_none_is_used(tiny_pair, config: SpecConfig) -> None:
    draft, target = tiny_pair
    h = make_header("x", [1, 2], config, target, draft)
    assert h.draft is None and set(h.devices) == set(h.dtypes) == {"target"}
    assert h.config == config_to_dict(config) and h.config["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}


def test_interrupted_trace_loads_incomplete(traced, tmp_path) -> None:
    path, run = traced
    data = path.read_bytes()
    cut = data[: data.rindex(b'{"type": "round"') + 40]     # mid-way through the last round line
    t = load_trace(cut)
    assert not t.complete and t.summary is None
    all_rounds = load_trace(path)
    assert len(t.rounds) + len(t.baseline) == len(all_rounds.rounds) + len(all_rounds.baseline) - 1


def test_live_trace_is_readable_mid_run(tiny_pair, tmp_path) -> None:
    draft, target = tiny_pair
    path = tmp_path / "live.jsonl"
    run = ComparedRun(ModelPair(target, draft), PROMPT, CONFIG, trace_path=path)
    first = run.step()
    t = load_trace(path)                                      # the writer is still open
    assert not t.complete and t.rounds == [first] and len(t.baseline) == len(first.emitted)
    run.close()


def test_writer_rejects_unknown_streams_and_closed_files(traced, tiny_pair, tmp_path) -> None:
    draft, target = tiny_pair
    traced_round = traced[1].spec.rounds[0]
    header = make_header("x", [1, 2], CONFIG, target, draft)
    with TraceWriter(tmp_path / "w.jsonl", header) as writer:
        with pytest.raises(ValueError, match="stream must be one of"):
            writer.write_summary(None, stream="draft")  # type: ignore[arg-type]
    assert writer.closed
    with pytest.raises(ValueError, match="closed"):
        writer.write_round(traced_round, stream="spec")
    assert load_trace(tmp_path / "w.jsonl").header == header


# ---------------------------------------------------------------------------- bad files

def edited(traced, tmp_path: Path, edit) -> Path:
    objs = lines_of(traced[0])
    edit(objs)
    return write_lines(tmp_path / "edited.jsonl", objs)


def first_round(objs: list[dict]) -> dict:
    return next(o for o in objs if o["type"] == "round")


def set_final_outcome(objs):
    first_round(objs)["data"]["final"]["outcome"] = "maybe"


def drop_key(objs):
    del first_round(objs)["data"]["accepted"]


def stringly_k(objs):
    first_round(objs)["data"]["k"] = "3"


def bool_index(objs):
    first_round(objs)["data"]["index"] = True


def wrong_version(objs):
    objs[0]["data"]["version"] = TRACE_VERSION + 1


def drop_header(objs):
    del objs[0]


def unknown_type(objs):
    objs.insert(2, {"type": "frame", "stream": "spec", "data": {}})


def bad_stream(objs):
    first_round(objs)["stream"] = "draft"


def second_header(objs):
    objs.insert(3, objs[0])


def extra_key(objs):
    first_round(objs)["data"]["surprise"] = 1


def bad_config(objs):
    objs[0]["data"]["config"]["k"] = 99


def too_many_emitted(objs):
    r = first_round(objs)["data"]
    r["emitted"] = r["emitted"] * (r["k"] + 2)


@pytest.mark.parametrize("edit, message", [
    (set_final_outcome, r"line 2: round.final.outcome: 'maybe' is not one of accepted, rejected, unchecked, corrected, bonus, pending"),
    (drop_key, r"line 2: round: missing key\(s\) accepted"),
    (stringly_k, r"line 2: round.k: expected an integer, got str"),
    (bool_index, r"line 2: round.index: expected an integer, got bool"),
    (wrong_version, rf"line 1: trace version {TRACE_VERSION + 1} is not supported"),
    (drop_header, r"line 1: the first line must be the header, got type 'round'"),
    (unknown_type, r"line 3: unknown line type 'frame'"),
    (bad_stream, r"line 2: stream must be one of spec, baseline, got 'draft'"),
    (second_header, r"line 4: a second header"),
    (extra_key, r"line 2: round: unknown key\(s\) surprise"),
    (bad_config, r"line 1: config is not a valid SpecConfig: K must be"),
    (too_many_emitted, r"line 2: round.emitted: \d+ tokens for k=\d+ \(expected 1\.\.\d+\)"),
])
def test_bad_records_are_rejected_with_line_numbers(traced, tmp_path, edit, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(edited(traced, tmp_path, edit))


def test_not_json_in_the_middle(traced) -> None:
    data = traced[0].read_bytes().split(b"\n")
    data[2] = b"this is not json"
    with pytest.raises(TraceError, match="line 3: not valid JSON"):
        load_trace(b"\n".join(data))


@pytest.mark.parametrize("number, message", [(b"NaN", "NaN is not allowed"), (b"-Infinity", "-Infinity is not allowed"),
                                             (b"1e999", "round.elapsed_s: inf is not a finite number")])
def test_non_finite_numbers(traced, tmp_path, number: bytes, message: str) -> None:
    def poison(objs):
        first_round(objs)["data"]["elapsed_s"] = "__X__"

    data = edited(traced, tmp_path, poison).read_bytes().replace(b'"__X__"', number)
    with pytest.raises(TraceError, match=f"line 2: .*{message}"):
        load_trace(data)


def test_empty_and_header_only_files(traced) -> None:
    with pytest.raises(TraceError, match="empty"):
        load_trace(b"\n\n")
    with pytest.raises(TraceError, match="no complete header"):
        load_trace(traced[0].read_bytes()[:50])
    header_only = load_trace(traced[0].read_bytes().split(b"\n")[0] + b"\n")
    assert header_only.rounds == [] and not header_only.complete


def test_oversized_files_are_rejected(traced, monkeypatch) -> None:
    monkeypatch.setattr(trace_mod, "MAX_TRACE_BYTES", 1000)
    with pytest.raises(TraceError, match="over the 1,000-byte"):
        load_trace(traced[0])
    with pytest.raises(TraceError, match="over the 1,000-byte"):
        load_trace(traced[0].read_bytes())


def test_missing_file() -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace("/no/such/trace.jsonl")


# ---------------------------------------------------------------------------- tables

def test_csv_has_one_row_per_round(traced, tmp_path) -> None:
    rounds: list[RoundRecord] = traced[1].spec.rounds
    path = export_csv(rounds, tmp_path / "rounds.csv")
    df = pd.read_csv(path, keep_default_na=False)
    assert list(df.columns) == list(ROUND_COLUMNS) and len(df) == len(rounds)
    assert df["index"].tolist() == list(range(len(rounds)))
    assert df["emitted"].tolist() == [len(r.emitted) for r in rounds]
    assert df["accepted"].tolist() == [r.accepted for r in rounds]
    assert df["final_outcome"].tolist() == [r.final.outcome.value for r in rounds]
    assert df["tokens_total"].iloc[-1] == CONFIG.max_new_tokens
    assert list(rounds_dataframe([]).columns) == list(ROUND_COLUMNS)


def test_a_trace_from_before_version_4_names_no_machine_and_a_version_4_header_must(traced, tmp_path) -> None:
    path, _ = traced
    objs = lines_of(path)
    del objs[0]["data"]["machine"]
    objs[0]["data"]["version"] = 3
    old = load_trace(write_lines(tmp_path / "v3.jsonl", objs))
    assert old.header.version == 3 and old.header.machine is None and old.rounds == load_trace(path).rounds
    objs[0]["data"]["version"] = TRACE_VERSION
    with pytest.raises(TraceError, match="missing key.*machine"):
        load_trace(write_lines(tmp_path / "v4.jsonl", objs))


@pytest.mark.parametrize("key, before", [("layers", 4), ("codes", 5)],
                         ids=["where the layers ran (version 5)", "whether products read codes (version 6)"])
def test_a_trace_from_before_a_header_field_reads_without_it_and_a_newer_header_must_have_it(traced, tmp_path, key,
                                                                                             before) -> None:
    path, _ = traced
    objs = lines_of(path)
    if key == "codes":
        assert objs[0]["data"]["codes"] is None      # a random model's products read its fp32 matrices
    del objs[0]["data"][key]
    objs[0]["data"]["version"] = before
    assert getattr(load_trace(write_lines(tmp_path / "old.jsonl", objs)).header, key) is None
    objs[0]["data"]["version"] = TRACE_VERSION
    with pytest.raises(TraceError, match=f"missing key.*{key}"):
        load_trace(write_lines(tmp_path / "new.jsonl", objs))


def test_version_1_traces_are_upgraded_as_they_are_read() -> None:
    """A trace written before the records were typed: drafts after a rejection were REJECTED with
    checked=false, "none" named no drafter, and there was no alpha."""
    from engine.config import DrafterKind, Mode
    from engine.records import Outcome

    path = Path(__file__).parent / "data" / "trace_v1.jsonl"
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert raw[0]["data"]["version"] == 1
    old_unchecked = sum(1 for o in raw if o["type"] == "round" and o["stream"] == "spec"
                        for p in o["data"]["positions"] if p["checked"] is False)
    trace = load_trace(path)
    assert trace.header.version == 1 and trace.rounds and trace.baseline
    assert sum(p.outcome is Outcome.UNCHECKED for r in trace.rounds for p in r.positions) == old_unchecked > 0
    assert all(p.outcome is not Outcome.REJECTED or i == r.accepted for r in trace.rounds
               for i, p in enumerate(r.positions))
    assert trace.rounds[0].mode is Mode.V2 and trace.rounds[1].drafter is DrafterKind.MODEL
    assert trace.baseline[0].drafter is None and trace.baseline[1].proposer is None
    assert trace.rounds[1].proposer is DrafterKind.MODEL
    assert len(trace.rounds[1].timings.draft_forward_ms) == trace.rounds[1].draft_forwards
    verified = sum(r.verified for r in trace.rounds)
    assert trace.summary.alpha == pytest.approx(sum(r.accepted for r in trace.rounds) / verified)
    assert trace.summary.weight_bytes == raw[-2]["data"]["weight_bytes"] or \
        trace.summary.weight_bytes == raw[-1]["data"]["weight_bytes"]


# ---------------------------------------------------------------------------- hostile files

def negative_position_token(objs):
    r = next(o for o in objs if o["type"] == "round" and o["data"]["positions"])["data"]
    r["positions"][0]["token"] = -5


def negative_final_token(objs):
    first_round(objs)["data"]["final"]["token"] = -1


def negative_candidate(objs):
    first_round(objs)["data"]["final"]["candidates"][0]["token"] = -2


def negative_prompt_id(objs):
    objs[0]["data"]["prompt_ids"][0] = -3


def negative_block(objs):
    first_round(objs)["data"]["kv"][0]["block_table"][0] = -4


@pytest.mark.parametrize("edit, message", [
    (negative_position_token, r"line \d+: round.positions\[0\].token: -5 is negative; token ids"),
    (negative_final_token, r"line 2: round.final.token: -1 is negative"),
    (negative_candidate, r"line 2: round.final.candidates\[0\].token: -2 is negative"),
    (negative_prompt_id, r"line 1: header.prompt_ids\[0\]: -3 is negative; token ids are integers >= 0"),
    (negative_block, r"line 2: round.kv\[0\].block_table\[0\]: -4 is negative"),
])
def test_negative_ids_are_refused(traced, tmp_path, edit, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(edited(traced, tmp_path, edit))


@pytest.mark.parametrize("line", [
    b"[" * 10_000 + b"]" * 10_000,                                  # balanced, far too deep
    b"[" * 10_000,                                                  # unbalanced: the parser's own limit
    b'{"type": "round", "stream": "spec", "data": ' + b"{\"a\": " * 5000 + b"1" + b"}" * 5000 + b"}",
], ids=["balanced", "unbalanced", "inside-a-round"])
def test_deeply_nested_json_gets_a_message_not_a_recursion_error(traced, line: bytes) -> None:
    header = traced[0].read_bytes().split(b"\n")[0]
    with pytest.raises(TraceError, match=rf"line 2: JSON nested more than {trace_mod.MAX_DEPTH} levels deep"):
        load_trace(header + b"\n" + line + b"\n")


def test_the_depth_count_skips_brackets_inside_strings() -> None:
    text = json.dumps({"emitted_text": "[[[[{{{{" * 10 + '\\"]]', "x": [[1], {"y": [2]}]}).encode()
    assert trace_mod.json_depth(text, 99) == 4 == trace_mod.json_depth(b'[[1], {"a": [["]"]]}]', 99)
    assert trace_mod.json_depth(b"[]" * 3, 99) == 1 and trace_mod.json_depth(b"1", 99) == 0


def test_a_trace_over_the_round_bound_is_refused(traced, monkeypatch) -> None:
    monkeypatch.setattr(trace_mod, "MAX_ROUNDS", 2)
    with pytest.raises(TraceError, match=r"line \d+: more than 2 (spec|baseline) rounds; this build replays at most 2 per stream"):
        load_trace(traced[0])


def test_loading_keeps_only_the_records_in_memory() -> None:
    """Lines are parsed and built one at a time: the peak while loading stays close to what the records
    themselves hold (reading the whole file, then every parsed line, then the records, needed several
    times that)."""
    import gc
    import tracemalloc

    path = min((Path(__file__).parent.parent / "assets" / "traces").glob("*.jsonl"))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        loaded = load_trace(path)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert loaded.rounds and peak - before < 1.5 * (kept - before)


def test_a_trace_is_readable_after_its_writer_is_killed(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "killed.jsonl"
    script = textwrap.dedent("""
        import sys, time
        from engine.compared import ComparedRun
        from engine.config import SpecConfig
        from engine.models import load_model
        from engine.pair import ModelPair
        pair = ModelPair(load_model("builtin", "target"), load_model("builtin", "draft"))
        run = ComparedRun(pair, "def f(x):\\n", SpecConfig(k=3, max_new_tokens=200), trace_path=sys.argv[1])
        for _ in range(3):
            run.step()
        print("ready", flush=True)
        while not run.finished:
            run.step()
            time.sleep(0.05)
    """)
    child = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parent.parent, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGKILL)
    child.wait()
    t = load_trace(path)
    assert not t.complete and len(t.rounds) >= 3 and t.summary is None


def test_tree_growth_round_trips_and_older_traces_read_as_raw_q():
    from engine.config import TreeSpec

    for spec in (TreeSpec(budget=16, depth=6), TreeSpec(widths=(4, 2), calibrated=False)):
        config = SpecConfig(tree=spec)
        assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config
    older = config_to_dict(SpecConfig(tree=TreeSpec(budget=16, depth=6)))
    del older["tree"]["calibrated"]   # written before growth by measured confidence existed
    assert config_from_dict(older).tree == TreeSpec(budget=16, depth=6, calibrated=False)


def test_copied_tree_nodes_round_trip_and_version_2_trees_read_as_uncopied(builtin_pair, tmp_path):
    from engine.config import DrafterKind, TreeSpec

    draft, target = builtin_pair
    path = tmp_path / "hybrid-tree.jsonl"
    config = SpecConfig(drafter=DrafterKind.HYBRID, tree=TreeSpec(budget=8, depth=4), max_new_tokens=24)
    run = ComparedRun(ModelPair(target, draft), PROMPT, config, trace_path=path, compare=False)
    run.run_to_end()
    run.close()
    trace = load_trace(path)
    assert trace.rounds == run.spec.rounds
    assert any(n.copied for r in trace.rounds if r.tree for n in r.tree.nodes)
    objs = lines_of(path)
    objs[0]["data"]["version"] = 2
    for o in objs:
        if o["type"] == "round" and o["data"]["tree"]:
            for n in o["data"]["tree"]["nodes"]:
                del n["copied"]
    old = load_trace(write_lines(tmp_path / "v2.jsonl", objs))
    assert old.header.version == 2 and len(old.rounds) == len(trace.rounds)
    assert not any(n.copied for r in old.rounds if r.tree for n in r.tree.nodes)


@pytest.mark.parametrize("where, edit", [
    ("header.prompt", lambda objs: objs[0]["data"].update(prompt="ok \ud800 then")),
    ("round.final.text", lambda objs: first_round(objs)["data"]["final"].update(text="\udfff")),
    ("round.final.candidates[0].text",
     lambda objs: first_round(objs)["data"]["final"]["candidates"][0].update(text="a\ud83d")),
])
def test_a_lone_surrogate_in_any_text_field_is_refused_naming_the_field(traced, tmp_path, where, edit) -> None:
    """JSON can spell a lone surrogate as an escape; such text breaks every renderer downstream (Gradio's
    stream could not send it), so a trace holding one is refused like a prompt holding one."""
    path = edited(traced, tmp_path, edit)
    assert b"\\ud8" in path.read_bytes() or b"\\udf" in path.read_bytes()   # written as a JSON escape
    with pytest.raises(TraceError, match=rf"line \d+: {re.escape(where)}: the text contains '\\ud[89a-f][0-9a-f]{{2}}' "
                                         r"at character \d+, which is not valid Unicode text \(a lone surrogate\)"):
        load_trace(path)
    pair = edited(traced, tmp_path, lambda objs: first_round(objs)["data"]["final"].update(text="🙂 é"))
    assert load_trace(pair).rounds[0].final.text == "🙂 é"        # real characters, escaped or not, are fine


def test_bytes_that_are_not_utf8_get_their_own_sentence(traced) -> None:
    data = traced[0].read_bytes().split(b"\n")
    data[1] = data[1].replace(b'"text": "', b'"text": "\xff', 1)
    with pytest.raises(TraceError, match=r"line 2: byte \d+ \(0xff\) is not UTF-8; a trace is UTF-8 text"):
        load_trace(b"\n".join(data))
    whole = load_trace(traced[0])
    cut = traced[0].read_bytes() + '{"type": "round", "text": "é'.encode()[:-1]   # a writer killed mid-character
    assert load_trace(cut).rounds == whole.rounds                       # that last line is dropped

"""Controller, sessions, registry and settings: the playground's behaviour without a browser."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from engine.models import ModelLoadError
from engine.prompts import PromptError
from engine.records import Outcome
from engine.sources import BUILTIN
from engine.trace import TraceError
from playground import controller
from playground.controller import Context, DecodeRequest
from playground.registry import CUSTOM, ModelRegistry, check_room, estimate_parameters, weight_bytes
from playground.render.frame import render_frame
from playground.sessions import SessionLimitReached, SessionPool
from playground.settings import AppSettings, allow_custom_default

PROMPT = "def fibonacci(n):\n"


def request(**changes) -> DecodeRequest:
    values = dict(prompt=PROMPT, preset="default", custom_draft="", custom_target="", mode="v2", drafter="model",
                  k=4.0, k_schedule="constant", k_min=1.0, k_max=8.0, temperature=1.0, top_k=0.0, top_p=1.0,
                  seed=3.0, max_new_tokens=12.0)
    return DecodeRequest(**(values | changes))


@pytest.fixture
def ctx(builtin_pair, tmp_path) -> Context:
    draft, target = builtin_pair
    registry = ModelRegistry(loader=lambda source, role, device: draft if role == "draft" else target)
    settings = AppSettings(max_sessions=2, max_new_tokens=64)
    yield Context(registry, SessionPool(2, 64 * 2**20, 60.0, root=tmp_path), settings)


def test_step_runs_rounds_then_replays_them_after_stepping_back(ctx):
    s = ctx.pool.open("a")
    assert controller.step(ctx, s, request()) is None
    assert s.cursor.shown == 1 and len(s.run.spec.rounds) == 1
    controller.step(ctx, s, request())
    controller.back(s)
    assert s.cursor.shown == 1
    controller.step(ctx, s, request())     # replays round 2: no new engine round
    assert s.cursor.shown == 2 and len(s.run.spec.rounds) == 2
    controller.scrub(s, 0)
    assert s.cursor.shown == 0


def test_reveal_substep_shows_pending_then_the_verdict(ctx):
    s = ctx.pool.open("a")
    controller.step(ctx, s, request(), reveal=True)
    assert (s.cursor.shown, s.cursor.revealed) == (1, False)
    controller.step(ctx, s, request(), reveal=True)
    assert (s.cursor.shown, s.cursor.revealed) == (1, True)
    assert len(s.run.spec.rounds) == 1


def test_run_to_end_reports_progress_and_finishes(ctx):
    s = ctx.pool.open("a")
    seen: list[tuple[int, int]] = []
    controller.run_to_end(ctx, s, request(), lambda done, total: seen.append((done, total)))
    assert s.run.finished and s.cursor.shown == len(s.run.spec.rounds)
    assert seen[-1] == (12, 12) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert "finished" in controller.step(ctx, s, request())


def test_a_visitors_tree_run_is_the_same_whatever_another_visitor_ran_meanwhile(ctx):
    """Sessions share the models and nothing else: the same greedy tree run, reset again after another
    visitor ran trees of their own over the same pair, draws the same trees in every round."""
    tree = request(tree="N16d6", temperature=0.0, max_new_tokens=24.0)
    a, b = ctx.pool.open("a"), ctx.pool.open("b")

    def trees(session) -> list:
        return [(r.tree.nodes, r.emitted) for r in session.run.spec.rounds if r.tree is not None]
    controller.run_to_end(ctx, a, tree)
    first = trees(a)
    for shape in ("N8d4", "4-2-2-1", "N24d8"):
        controller.reset(ctx, b, request(tree=shape, temperature=0.0, max_new_tokens=32.0))
        controller.run_to_end(ctx, b, request(tree=shape, temperature=0.0, max_new_tokens=32.0))
    controller.reset(ctx, a, tree)
    controller.run_to_end(ctx, a, tree)
    assert len(first) > 3 and trees(a) == first


@pytest.mark.parametrize("changes", [dict(mode="v1"), dict(drafter="ngram"), dict(mode="target"),
                                     dict(k_schedule="heuristic", k=2.0, k_min=1.0, k_max=6.0, temperature=0.0)],
                         ids=["v1", "ngram", "target-only", "heuristic-greedy"])
def test_every_mode_and_drafter_runs_and_renders(ctx, changes):
    s = ctx.pool.open("a")
    controller.run_to_end(ctx, s, request(max_new_tokens=8.0, **changes))
    view = s.view()
    frame = render_frame(view, s.cursor)
    assert view.rounds[-1].tokens_total == len(view.spec_tokens) <= 8
    assert "finished" in frame.stream.status and frame.stream.rounds_total == len(view.rounds)
    models = {k.model for k in view.rounds[-1].kv}
    assert models == ({"target", "draft"} if view.info.draft else {"target"})
    if changes.get("mode") == "target":
        assert view.baseline == () and "Needs a target-only baseline" in frame.charts.speedup.layout.annotations[0].text
    else:
        assert len(frame.charts.tokens_time.data) == 2
    if changes.get("k_schedule") == "heuristic":
        assert {r.k for r in view.rounds} - {0} <= set(range(1, 7))


@pytest.mark.parametrize("changes, error, words", [
    (dict(prompt="   "), PromptError, "empty"),
    (dict(k=0.0), ValueError, "K must be"),
    (dict(k=2.5), ValueError, "whole number"),
    (dict(temperature=None), ValueError, "Temperature is empty"),
    (dict(top_p=0.0), ValueError, "Top-p must be in"),
    (dict(k_min=6.0, k_max=3.0), ValueError, "K min and K max must satisfy"),
    (dict(max_new_tokens=65.0), ValueError, "Max new tokens must be a whole number from 1 to 64, got 65"),
    (dict(preset="custom", custom_draft="x", custom_target="y"), ModelLoadError, "disabled"),
    (dict(preset="nope"), ModelLoadError, "Unknown model pair"),
])
def test_bad_input_raises_a_readable_user_error(ctx, changes, error, words):
    s = ctx.pool.open("a")
    with pytest.raises(error, match=words) as info:
        controller.reset(ctx, s, request(**changes))
    assert isinstance(info.value, controller.USER_ERRORS)
    assert s.run is None and s.kv_bytes == 0
    controller.step(ctx, s, request())     # the session still works afterwards
    assert s.cursor.shown == 1


SEED_RULE = "Seed must be a whole number from 0 to 9223372036854775807, got "


@pytest.mark.parametrize("changes, message", [
    (dict(prompt="def f():\ud800\n"), "The prompt contains '\\ud800' at character 9, which is not valid Unicode text"),
    (dict(prompt="x" * 8001), "The prompt has 8,001 characters; this server takes at most 8,000."),
    (dict(seed=2**70), SEED_RULE + "1180591620717411303424."),
    (dict(seed=float(2**70)), SEED_RULE + "1180591620717411303424."),
    (dict(seed=-1), SEED_RULE + "-1."),
    (dict(seed="abc"), SEED_RULE + "'abc'."),
    (dict(seed=float("nan")), SEED_RULE + "nan."),
    (dict(seed=float("inf")), SEED_RULE + "inf."),
    (dict(seed=0.5), SEED_RULE + "0.5."),
    (dict(top_k=float("inf")), "Top-k must be a whole number of at least 0, got inf."),
    (dict(top_k="many"), "Top-k must be a whole number of at least 0, got 'many'."),
    (dict(temperature=float("nan")), "Temperature must be a finite number of at least 0 (0 = greedy), got nan."),
    (dict(top_p=float("-inf")), "Top-p must be a number in (0, 1], got -inf."),
    (dict(k=2.5), "K must be a whole number from 1 to 32, got 2.5."),
    (dict(k=None), "K is empty: enter a whole number from 1 to 32."),
    (dict(mode="v3"), "Mode must be one of v2, v1, target, got 'v3'."),
    (dict(preset="custom", custom_draft="\udcff", custom_target="x"), "Custom draft contains '\\udcff' at character 1"),
], ids=["surrogate", "long-prompt", "seed-2^70", "seed-2^70-float", "seed-negative", "seed-text", "seed-nan",
        "seed-inf", "seed-fraction", "top-k-inf", "top-k-text", "temperature-nan", "top-p-inf", "k-fraction",
        "k-empty", "mode", "custom-id-surrogate"])
def test_every_bad_value_gets_a_sentence_naming_the_field_and_what_it_allows(ctx, changes, message):
    s = ctx.pool.open("a")
    with pytest.raises(controller.USER_ERRORS) as info:
        controller.reset(ctx, s, request(**changes))
    assert message in str(info.value)


def test_the_seed_sentence_is_the_engines_own():
    from engine.config import SpecConfig

    with pytest.raises(ValueError) as engine_side:
        SpecConfig(seed=2**70)
    with pytest.raises(ValueError) as ui_side:
        request(seed=2**70).config(64)
    assert str(engine_side.value) == str(ui_side.value) == SEED_RULE + "1180591620717411303424."


def test_the_largest_seed_runs():
    from engine.config import SEED_MAX

    assert request(seed=SEED_MAX).config(64).seed == SEED_MAX


@pytest.mark.parametrize("changes", [
    dict(k=2.5), dict(prompt="x" * 8001), dict(seed=2**70), dict(preset="nope"),
    dict(prompt="a = 1\n" * 400),         # too long for the target's context: found only once the run is built
    dict(max_new_tokens=64.0, k=16.0),    # fine, but over the KV budget below
], ids=["k-fraction", "long-prompt", "seed-overflow", "unknown-pair", "context-overflow", "kv-budget"])
def test_a_failed_reset_always_keeps_the_old_run_as_the_previous_one(builtin_pair, tmp_path, changes):
    draft, target = builtin_pair
    registry = ModelRegistry(loader=lambda source, role, device: draft if role == "draft" else target)
    small = Context(registry, SessionPool(2, 2 * 2**20, 60.0, root=tmp_path), AppSettings(max_new_tokens=64))
    small.pool.reserve_kv(small.pool.open("neighbour"), int(0.6 * 2**20))
    s = small.pool.open("a")
    controller.step(small, s, request(max_new_tokens=8.0))
    controller.step(small, s, request(max_new_tokens=8.0))
    rounds, kv_pool, trace = s.view().rounds, s.run.spec.target_runner.pool.manager, s.trace_path
    with pytest.raises(controller.USER_ERRORS):
        controller.reset(small, s, request(**changes))
    assert s.run is None and s.kv_bytes == 0 and kv_pool.free_blocks == kv_pool.num_blocks
    assert s.view().rounds == rounds and s.cursor.shown == 2 and s.view().previous
    assert trace.exists() and s.trace_path == trace          # its trace can still be downloaded
    status = render_frame(s.view(), s.cursor).stream.status
    assert status.startswith("**Previous run**") and "Round 2 of 2" in status and "Step will not continue" in status
    for action in (controller.step, controller.run_to_end):
        with pytest.raises(ValueError, match="This is the previous run"):
            action(small, s, request())
    assert s.view().rounds == rounds and s.cursor.shown == 2
    controller.back(s)
    assert s.cursor.shown == 1 and s.view().previous                  # looking back still works
    controller.reset(small, s, request(max_new_tokens=8.0))
    assert s.live and s.view().previous is None and s.cursor.shown == 0 and not trace.exists()


def test_a_failed_reset_with_no_run_before_leaves_none(ctx):
    s = ctx.pool.open("a")
    with pytest.raises(ValueError):
        controller.reset(ctx, s, request(k=2.5))
    assert s.view() is None and s.previous is None
    assert controller.step(ctx, s, request()) is None and s.live


def test_the_session_bound_gives_a_clear_message(ctx):
    a = ctx.pool.open("a")
    ctx.pool.open("b")
    with pytest.raises(SessionLimitReached, match="full: all 2 sessions are in use"):
        ctx.pool.open("c")
    ctx.pool.close(a)
    ctx.pool.close(a)  # unload, then state expiry: closing twice is harmless
    assert ctx.pool.open("c").key == "c" and len(ctx.pool) == 2


def test_closing_a_session_frees_its_kv_blocks_and_files(ctx):
    s = ctx.pool.open("a")
    controller.step(ctx, s, request())
    pool = s.run.spec.target_runner.pool.manager
    workdir = s.workdir
    assert pool.free_blocks < pool.num_blocks and workdir.exists()
    ctx.pool.close(s)
    assert pool.free_blocks == pool.num_blocks and not workdir.exists() and s.run is None


def test_the_kv_budget_bounds_all_sessions_together(builtin_pair, tmp_path):
    draft, target = builtin_pair
    registry = ModelRegistry(loader=lambda source, role, device: draft if role == "draft" else target)
    small = Context(registry, SessionPool(4, 3 * 2**20, 60.0, root=tmp_path), AppSettings(max_new_tokens=512))
    controller.reset(small, small.pool.open("a"), request(max_new_tokens=64.0))
    with pytest.raises(SessionLimitReached, match="KV cache"):
        controller.reset(small, small.pool.open("b"), request(max_new_tokens=512.0))


def test_idle_sessions_are_evicted_when_the_pool_is_full(builtin_pair, tmp_path):
    pool = SessionPool(1, 2**30, idle_ttl_s=0.0, root=tmp_path)
    old = pool.open("old")
    assert pool.open("new") is not old and len(pool) == 1 and not old.workdir.exists()


def test_replay_needs_no_model_and_bad_traces_are_refused(ctx, tmp_path):
    s = ctx.pool.open("a")
    controller.run_to_end(ctx, s, request())
    trace = s.trace_path
    rounds = len(s.run.spec.rounds)
    replay = ctx.pool.open("b")
    controller.load_replay(replay, trace, "mine.jsonl")
    assert replay.run is None and replay.view().source == "mine.jsonl"
    for _ in range(rounds + 1):
        note = controller.step(ctx, replay, request())
    assert note == "End of the trace." and replay.cursor.shown == rounds
    bad = tmp_path / "bad.jsonl"
    for text in ("not json\n", json.dumps({"type": "round", "stream": "spec", "data": {}}) + "\n", ""):
        bad.write_text(text)
        with pytest.raises(TraceError):
            controller.load_replay(replay, bad, "bad.jsonl")
    assert replay.view().source == "mine.jsonl"   # a failed upload leaves the replay as it was
    csv = controller.export_rounds_csv(replay)
    assert len(pd.read_csv(csv)) == rounds  # emitted text may hold quoted newlines, so parse it


def test_the_session_trace_records_both_streams(ctx):
    s = ctx.pool.open("a")
    controller.run_to_end(ctx, s, request(temperature=0.0))
    lines = [json.loads(line) for line in Path(s.trace_path).read_text().splitlines()]
    streams = {(l["type"], l["stream"]) for l in lines}
    assert {("header", None), ("round", "spec"), ("round", "baseline"), ("summary", "spec"),
            ("summary", "baseline")} <= streams
    view = s.view()
    assert view.identical_to_baseline() is True
    assert all(r.final.outcome in (Outcome.CORRECTED, Outcome.BONUS) for r in view.rounds)


# -- registry ----------------------------------------------------------------------------------------------

QWEN_7B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False, max_position_embeddings=32768)


def test_parameter_estimate_matches_a_known_model():
    from transformers import Qwen2Config

    assert estimate_parameters(Qwen2Config(**{k: v for k, v in QWEN_7B.items() if k != "architectures"})) \
        == pytest.approx(7.62e9, rel=0.01)


def test_a_model_too_big_for_free_memory_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    import torch

    need = weight_bytes(str(tmp_path), "target", torch.device("cpu"))
    assert need > 28 * 2**30
    with pytest.raises(ModelLoadError, match=r"needs about 28\.\d GiB on cpu, but only 1\.0 GiB"):
        check_room(str(tmp_path), "target", torch.device("cpu"), need, 2**30)
    check_room(str(tmp_path), "target", torch.device("cpu"), need, 2**40)
    loads: list[str] = []
    registry = ModelRegistry(allow_custom=True, allow_local_paths=True, free=lambda d: 2**30,
                             loader=lambda *a, **k: loads.append(a[0]))
    with pytest.raises(ModelLoadError, match="needs about"):
        registry.pair(CUSTOM, str(tmp_path), str(tmp_path))
    assert loads == []


def test_missing_model_and_two_gpu_preset_fail_clearly(tmp_path):
    registry = ModelRegistry(allow_custom=True, allow_local_paths=True)
    with pytest.raises(ModelLoadError, match="Could not read the config"):
        registry.pair(CUSTOM, str(tmp_path / "nothing"), str(tmp_path / "nothing"))
    import torch

    if torch.cuda.device_count() < 2:
        with pytest.raises(ModelLoadError, match="needs 2 GPUs"):
            registry.pair("qwen-0.5b-7b-2gpu")
    assert [k for _, k in ModelRegistry(allow_custom=False).choices()] == [
        "default", "smollm2-eagle3", "smollm2", "smollm2-int4", "smollm2-int8", "qwen-0.5b-1.5b", "qwen-0.5b-7b-2gpu"]


def test_models_are_loaded_once_and_shared(builtin_pair):
    calls: list[tuple[str, str]] = []
    draft, target = builtin_pair

    def loader(source, role, device):
        calls.append((source, role))
        return draft if role == "draft" else target

    registry = ModelRegistry(loader=loader)
    first, second = registry.pair("default"), registry.pair("default")
    assert first.target is second.target and calls == [(BUILTIN, "draft"), (BUILTIN, "target")]


@pytest.mark.parametrize("env, allowed", [
    ({}, True), ({"SPACE_ID": "me/specplay"}, False),
    ({"SPACE_ID": "me/specplay", "SPECPLAY_ALLOW_CUSTOM_MODELS": "1"}, True),
    ({"SPECPLAY_ALLOW_CUSTOM_MODELS": "0"}, False),
])
def test_custom_models_default_off_on_a_space(env, allowed):
    assert allow_custom_default(env) is allowed


def test_a_bad_custom_models_setting_is_an_error():
    with pytest.raises(ValueError, match="SPECPLAY_ALLOW_CUSTOM_MODELS"):
        allow_custom_default({"SPECPLAY_ALLOW_CUSTOM_MODELS": "maybe"})


def test_reset_lets_go_of_a_replayed_trace(ctx):
    """Nothing keeps a replayed trace's records once Reset replaces it: the round and position records
    alive (counted by the garbage collector) go back to what the fresh live run holds."""
    import gc

    from engine.records import PositionRecord, RoundRecord

    example = min((Path(__file__).resolve().parent.parent / "assets" / "traces").glob("*.jsonl"))
    s = ctx.pool.open("a")

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, (RoundRecord, PositionRecord)) for o in gc.get_objects())

    controller.reset(ctx, s, request())
    base = alive()
    controller.load_replay(s, example, "example")
    controller.run_to_end(ctx, s, request())
    render_frame(s.view(), s.cursor)
    held = alive() - base
    controller.reset(ctx, s, request())
    assert held > 10                      # the replay held its records
    assert alive() == base


def test_a_damaged_gguf_as_custom_target_is_one_sentence_and_the_old_run_stays(builtin_pair, tmp_path):
    """A visitor (on a server that allows local paths) names a GGUF cut short: Reset says where the file breaks,
    the file is neither loaded nor converted, and the run before it is still there to look at."""
    from engine.sources import BUILTIN_DIR, cache_root
    from tests.test_gguf_file import small_gguf

    draft, target = builtin_pair
    loads = []
    registry = ModelRegistry(allow_custom=True, allow_local_paths=True,
                             loader=lambda source, role, device: loads.append(source) or
                             (draft if role == "draft" else target))
    small = Context(registry, SessionPool(2, 64 * 2**20, 60.0, root=tmp_path), AppSettings(max_new_tokens=64))
    s = small.pool.open("a")
    controller.step(small, s, request(max_new_tokens=8.0))
    gguf = small_gguf(tmp_path / "mine.gguf")
    gguf.write_bytes(gguf.read_bytes()[:-40])
    with pytest.raises(ModelLoadError, match=r"mine.gguf is cut short: tensor 'second.weight' ends at byte offset"):
        controller.reset(small, s, request(preset=CUSTOM, custom_draft=str(BUILTIN_DIR / "draft"),
                                           custom_target=str(gguf)))
    assert str(gguf) not in loads and s.view().previous and len(s.view().rounds) == 1   # the target never loaded
    assert not list((cache_root() / "models").glob("mine-*"))                              # nor was it converted


def test_a_step_that_waits_for_the_default_pair_to_load_says_so(ctx):
    """The page shows no timer for a Step where its browser runs beside the server, so a Step that first waits for
    the default pair's load (a new machine's first minute) says so in a notice; once it is loaded, or for a pair
    a Step would not load, nothing is said."""
    import dataclasses
    import warnings

    from playground.ui import LOADING_NOTICE, Handlers

    handlers = Handlers(ctx)
    values = dataclasses.astuple(request())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # gr.Info outside an event only warns
        assert handlers.loading_notice(values) == LOADING_NOTICE
        assert handlers.loading_notice(dataclasses.astuple(request(preset="no such pair"))) is None
        ctx.registry.pair("default")
        assert handlers.loading_notice(values) is None

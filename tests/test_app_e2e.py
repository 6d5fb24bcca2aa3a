"""End to end: launch the app on a free port and drive it through gradio_client like a visitor would."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from tests.conftest import launched_app

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "assets" / "traces").glob("*.jsonl"))
STATUS, STREAM, BADGE, SUMMARY, POSITION, DETAIL, TREE, KV_TARGET = range(8)
SCRUBBER = -1


@pytest.fixture(scope="module")
def server(builtin_pair, tmp_path_factory):
    with launched_app(builtin_pair, tmp_path_factory.mktemp("sessions"), max_sessions=2, max_new_tokens=64) as served:
        yield served


@pytest.fixture(autouse=True)
def no_sessions_left_over(server):
    """Closed clients' sessions end on Gradio's unload event, a heartbeat later; do not wait for it."""
    server[1].close_all()


def open_page(url: str, pool) -> Client:
    """A client whose heartbeat the server has seen, as a browser page's is before anyone can upload: the
    server takes uploads only from an address with a page open."""
    client = Client(url, verbose=False)
    deadline = time.monotonic() + 60
    while not pool.connected(client.session_hash) and time.monotonic() < deadline:
        time.sleep(0.02)
    return client


def step(client: Client, n: int = 1) -> tuple:
    for _ in range(n):
        out = client.predict(api_name="/step")
    return out


def test_step_back_and_replay_through_the_api(server):
    url, pool = server
    client = Client(url, verbose=False)
    out = step(client, 3)
    assert "Round 3 of 3" in out[STATUS]
    assert out[STREAM].count('class="round-sep"') == 3 and "chip-accepted" in out[STREAM]
    assert out[SCRUBBER]["value"] == 3 and out[SCRUBBER]["maximum"] == 3
    assert "round 3, " in out[DETAIL] and out[KV_TARGET] == {"__type__": "update"}  # hidden tab: left as is
    out = client.predict(api_name="/show_kv")     # the KV tab selected: drawn now, and by every event after
    assert out[KV_TARGET]["type"] == "plotly" and out[DETAIL]["__type__"] == "update"
    out = client.predict(api_name="/back")
    assert "Round 2 of 3" in out[STATUS] and out[KV_TARGET]["type"] == "plotly"
    assert "Round 3 of 3" in step(client)[STATUS]          # replays round 3
    assert "Round 1 of 3" in client.predict(1, api_name="/scrub")[STATUS]
    client.close()


def by_label(client: Client, endpoint: str, **values_by_label) -> dict:
    """Keyword arguments for an endpoint, naming its parameters by their components' labels."""
    params = client.view_api(print_info=False, return_format="dict")["named_endpoints"][endpoint]["parameters"]
    names = {p["label"]: p["parameter_name"] for p in params}
    return {names[label]: value for label, value in values_by_label.items()}


def call(client: Client, endpoint: str, *args, **values_by_label) -> tuple[tuple, list[str]]:
    """(outputs, the warnings and notes the visitor was shown) of one call."""
    kwargs = by_label(client, endpoint, **values_by_label) if values_by_label else {}
    job = client.submit(*args, **kwargs, api_name=endpoint)
    out = job.result()
    shown, updates = [], job.communicator.updates
    while not updates.empty():
        update = updates.get_nowait()
        if getattr(update, "log", None):
            shown.append(update.log[0])
    return out, shown


def test_bad_input_leaves_the_previous_run_visible_and_the_session_working(server, tmp_path):
    url, _ = server
    client = Client(url, verbose=False)
    step(client, 2)
    impossible = ({"Prompt": "   "}, {"K min (heuristic)": 6, "K max (heuristic)": 3},
                  {"K schedule": "heuristic", "K (drafts per round)": 12, "K max (heuristic)": 8},
                  {"K (drafts per round)": 0})
    for bad in impossible:
        out, shown = call(client, "/reset", **bad)
        assert "Previous run" in out[STATUS] and "Round 2 of 2" in out[STATUS], bad   # kept, and marked
        assert shown, bad
    out, shown = call(client, "/step")
    assert "Round 2 of 2" in out[STATUS] and any("This is the previous run" in m for m in shown)
    out, _ = call(client, "/reset")
    assert "Round 0 of 0" in out[STATUS] and "Previous run" not in out[STATUS]
    assert "Round 2 of 2" in step(client, 2)[STATUS]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"type": "header", "stream": null, "data": {"version": 1}}\n{oops\n')
    out = client.predict(handle_file(str(broken)), api_name="/replay_upload")
    assert "Round 2 of 2" in out[STATUS] and "live" in out[STATUS]
    client.close()


SEED_RULE = "Seed must be a whole number from 0 to 9223372036854775807, got "


@pytest.mark.parametrize("values, message", [
    ({"Seed": "abc"}, SEED_RULE + "'abc'."),
    ({"Seed": 2**70}, SEED_RULE + "1180591620717411303424."),
    ({"K (drafts per round)": "four"}, "K must be a whole number from 1 to 32, got 'four'."),
], ids=["seed-text", "seed-2^70", "k-text"])
def test_bad_api_values_get_a_sentence_not_a_generic_error(server, values, message):
    url, _ = server
    client = Client(url, verbose=False)
    out, shown = call(client, "/reset", **values)         # no AppError: the handler itself answered
    assert any(message in m for m in shown), shown
    assert "No run yet" in out[STATUS]
    assert "Round 1 of 1" in step(client)[STATUS]         # the session still works
    client.close()


def raw_reset(url: str, client: Client, **literals: str) -> tuple[list, list[str]]:
    """POST /gradio_api/call/reset as a bare HTTP caller would, with some values written as raw JSON text
    (NaN, Infinity or a "\\ud800" escape, which gradio_client refuses to send). Returns (outputs, the
    warnings shown), read from the session's message stream."""
    import uuid

    import httpx

    params = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/reset"]["parameters"]
    values = [literals.get(p["label"], json.dumps(p["parameter_default"])) for p in params]
    session = uuid.uuid4().hex
    body = f'{{"session_hash": "{session}", "data": [{", ".join(values)}]}}'
    shown: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        http.post("/gradio_api/call/reset", content=body, headers={"content-type": "application/json"}
                  ).raise_for_status()
        with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                message = json.loads(line[len("data: "):]) if line.startswith("data: ") else {}
                if message.get("msg") == "log":
                    shown.append(message["log"])
                if message.get("msg") == "process_completed":
                    assert message["success"], message
                    return message["output"]["data"][1:], shown   # [0] is the session's gr.State
    raise AssertionError("the reply ended without a result")


@pytest.mark.parametrize("label, literal, message", [
    ("Seed", "NaN", SEED_RULE + "nan."),
    ("Seed", "Infinity", SEED_RULE + "inf."),
    ("Top-k (0 = off)", "Infinity", "Top-k must be a whole number of at least 0, got inf."),
    ("Temperature (0 = greedy)", "NaN", "Temperature must be a finite number of at least 0 (0 = greedy), got nan."),
    ("K (drafts per round)", "-Infinity", "K must be a whole number from 1 to 32, got -inf."),
    ("Prompt", '"def f():\\ud800"', "The prompt contains '\\ud800' at character 9, which is not valid Unicode"),
], ids=["seed-nan", "seed-inf", "top-k-inf", "temperature-nan", "k-minus-inf", "surrogate"])
def test_values_only_a_bare_api_caller_can_send_get_a_sentence_too(server, label, literal, message):
    url, _ = server
    client = Client(url, verbose=False)
    out, shown = raw_reset(url, client, **{label: literal})
    assert "No run yet" in out[STATUS] and any(message in m for m in shown), shown
    client.close()


def test_a_deeply_nested_trace_is_refused_in_traces_and_compare(server, tmp_path):
    url, _ = server
    client = Client(url, verbose=False)
    step(client)
    header = EXAMPLES[0].read_bytes().split(b"\n")[0] if EXAMPLES else b"{}"
    nested = tmp_path / "nested.jsonl"
    nested.write_bytes(header + b"\n" + b"[" * 10_000 + b"]" * 10_000 + b"\n")
    out, shown = call(client, "/replay_upload", handle_file(str(nested)))
    assert "Round 1 of 1" in out[STATUS] and any("nested more than" in m for m in shown), shown
    out, shown = call(client, "/compare", handle_file(str(nested)), None, None, str(EXAMPLES[-1]) if EXAMPLES else None)
    assert any("nested more than" in m for m in shown), shown
    client.close()


def test_run_to_end_then_replay_an_example_and_compare(server):
    if len(EXAMPLES) < 2:
        pytest.skip("needs the example traces in assets/traces (python -m playground.make_examples)")
    url, _ = server
    client = Client(url, verbose=False)
    out = client.predict(api_name="/run_to_end")
    assert "finished" in out[STATUS]
    out = client.predict(str(EXAMPLES[0]), api_name="/replay_example")
    assert f"replaying {EXAMPLES[0].name}" in out[STATUS] and "Round 0 of" in out[STATUS]
    assert "Round 1 of" in step(client)[STATUS]
    table, *_ = client.predict(None, str(EXAMPLES[0]), None, str(EXAMPLES[1]), api_name="/compare")
    assert EXAMPLES[0].name in table and EXAMPLES[1].name in table
    client.close()


def test_a_slow_model_load_does_not_hold_up_another_visitors_reset(builtin_pair, tmp_path):
    from playground.registry import ModelRegistry
    from tests.test_playground_registry import WAIT, SlowLoader

    slow = SlowLoader(builtin_pair)
    registry = ModelRegistry(allow_custom=True, loader=slow, inspect=lambda source, role, device: 1)
    registry.pair("default")
    try:
        with launched_app(builtin_pair, tmp_path, max_sessions=4, max_new_tokens=16, registry=registry) as (url, _):
            a, b = Client(url, verbose=False), Client(url, verbose=False)
            loading = a.submit(**by_label(a, "/reset", **{"Model pair": "custom", "Custom draft id or path": "slow",
                                                           "Custom target id or path": "slow"}), api_name="/reset")
            assert slow.started.wait(WAIT)
            out = b.submit(api_name="/reset").result(timeout=WAIT)      # not queued behind a's load
            assert "Round 0 of 0" in out[STATUS] and not slow.gate.is_set() and not loading.done()
            slow.gate.set()
            assert "Round 0 of 0" in loading.result(timeout=WAIT)[STATUS]
            a.close()
            b.close()
    finally:
        slow.gate.set()


def test_api_callers_that_never_come_back_cannot_lock_visitors_out(builtin_pair, tmp_path):
    """Raw /gradio_api/call requests have no heartbeat: their sessions go a lease after their last use,
    while a connected visitor's session, held by its heartbeat, stays."""
    import httpx

    with launched_app(builtin_pair, tmp_path, max_sessions=8, max_new_tokens=16, session_lease_s=2.0) as (url, pool):
        visitor = Client(url, verbose=False)
        assert "Round 1 of 1" in step(visitor)[STATUS]
        params = visitor.view_api(print_info=False, return_format="dict")["named_endpoints"]["/reset"]["parameters"]
        with httpx.Client(base_url=url, timeout=60) as http:
            for _ in range(8):      # the probe's attack: eight bare Resets, then gone
                event = http.post("/gradio_api/call/reset", json={"data": [p["parameter_default"] for p in params]})
                reply = http.get(f"/gradio_api/call/reset/{event.json()['event_id']}").text
                # a slow reply may be preceded by heartbeats; it must end complete, never in an error
                events = [line for line in reply.splitlines() if line.startswith("event: ")]
                assert events[-1] == "event: complete" and "event: error" not in events, reply[:200]
        assert len(pool) > 1                  # they did open sessions
        deadline = time.monotonic() + 60
        while len(pool) > 1 and time.monotonic() < deadline:    # the sweeper runs every lease / 4
            time.sleep(0.1)
        [kept] = pool.sessions()
        assert pool.held(kept.key) and kept.run is not None
        assert "Round 2 of 2" in step(visitor)[STATUS]           # the visitor never noticed
        late = Client(url, verbose=False)
        assert "Round 1 of 1" in step(late)[STATUS]
        visitor.close()
        late.close()


def test_closing_the_client_ends_its_session(server):
    url, pool = server
    client = Client(url, verbose=False)
    step(client)
    [session] = pool.sessions()
    run_pool = session.run.spec.target_runner.pool.manager
    client.close()   # its heartbeat stops: Gradio fires the app's unload event
    deadline = time.monotonic() + 120

    def ended() -> bool:   # the pool lets go of the session first, then the session frees its run
        return len(pool) == 0 and session.run is None and run_pool.free_blocks == run_pool.num_blocks

    while not ended() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended(), (len(pool), session.run, run_pool.free_blocks)


def test_the_session_limit_gives_a_message_not_a_crash(server):
    url, pool = server
    clients = [Client(url, verbose=False) for _ in range(3)]
    replies = [call(c, "/step") for c in clients]
    statuses = [out[STATUS] for out, _ in replies]
    assert len(pool) == 2
    assert sum("Round 1 of 1" in s for s in statuses) == 2
    assert sum("No run yet" in s for s in statuses) == 1
    assert any("The playground is full: all 2 sessions are in use" in m and "at the latest in about" in m
               for _, shown in replies for m in shown)
    for c in clients:
        c.close()


def test_concurrent_visitors_are_isolated(builtin_pair, tmp_path):
    """Four visitors step at once, two seeds between them: the same seed gives byte-identical streams."""
    import threading

    with launched_app(builtin_pair, tmp_path, max_sessions=4, max_new_tokens=32) as (url, _):
        clients = [Client(url, verbose=False) for _ in range(4)]
        streams: list[list[str]] = [[] for _ in clients]

        def visit(i: int) -> None:
            clients[i].predict(**by_label(clients[i], "/reset", Seed=i % 2), api_name="/reset")
            for _ in range(4):
                streams[i].append(clients[i].predict(api_name="/step")[STREAM])

        threads = [threading.Thread(target=visit, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert streams[0] == streams[2] and streams[1] == streams[3] and streams[0] != streams[1]
        assert all(len(s) == 4 for s in streams)
        for c in clients:
            c.close()


def test_script_in_a_trace_is_shown_as_text(server, tmp_path):
    if not EXAMPLES:
        pytest.skip("needs the example traces in assets/traces")
    url, pool = server
    lines = [json.loads(line) for line in EXAMPLES[0].read_text().splitlines()]
    attack = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    for obj in lines:
        if obj["type"] == "round":
            obj["data"]["emitted_text"] = attack
            obj["data"]["final"]["text"] = attack
            for p in obj["data"]["positions"]:
                p["text"] = attack
    hostile = tmp_path / "<b>hostile<b>.jsonl"
    hostile.write_text("".join(json.dumps(o) + "\n" for o in lines))
    client = open_page(url, pool)
    client.predict(handle_file(str(hostile)), api_name="/replay_upload")
    out = client.predict(api_name="/run_to_end")
    assert "&lt;script&gt;" in out[STREAM] and "<script" not in out[STREAM] and "<img" not in out[STREAM]
    assert "<b>hostile" not in out[STATUS]
    table, *_ = client.predict(handle_file(str(hostile)), None, None, str(EXAMPLES[-1]), api_name="/compare")
    assert "<b>hostile" not in table and "<script" not in table
    client.close()


def test_files_outside_the_examples_cannot_be_read(server):
    import httpx

    url, _ = server
    for path in ("/etc/passwd", "../../../../etc/passwd", str(Path(__file__).resolve())):
        reply = httpx.get(f"{url}gradio_api/file={path}", timeout=30)
        assert reply.status_code in (403, 404) and "root:" not in reply.text, path
    client = Client(url, verbose=False)
    step(client)
    with pytest.raises(AppError, match="not in the list of choices"):    # Gradio's own check, as a message
        client.predict("/etc/passwd", api_name="/replay_example")
    assert "Round 2 of 2" in step(client)[STATUS]            # the session carries on
    client.close()

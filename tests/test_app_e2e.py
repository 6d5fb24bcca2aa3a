"""End to end: launch the app on a free port and drive it through gradio_client like a visitor would."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from tests.conftest import launched_app

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "assets" / "traces").glob("*.jsonl"))
STATUS, STREAM, BADGE, SUMMARY, POSITION, DETAIL, KV_TARGET = range(7)
SCRUBBER = -1


@pytest.fixture(scope="module")
def server(builtin_pair, tmp_path_factory):
    with launched_app(builtin_pair, tmp_path_factory.mktemp("sessions"), max_sessions=2, max_new_tokens=64) as served:
        yield served


@pytest.fixture(autouse=True)
def no_sessions_left_over(server):
    """Closed clients' sessions end on Gradio's unload event, a heartbeat later; do not wait for it."""
    server[1].close_all()


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
    assert out[DETAIL]["type"] == "plotly" and out[KV_TARGET] == {"__type__": "update"}  # hidden tab: left as is
    out = client.predict(api_name="/show_kv")     # the KV tab selected: drawn now, and by every event after
    assert out[KV_TARGET]["type"] == "plotly" and out[DETAIL] == {"__type__": "update"}
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


def test_bad_input_leaves_the_session_working(server, tmp_path):
    url, _ = server
    client = Client(url, verbose=False)
    step(client, 2)
    impossible = ({"Prompt": "   "}, {"K min (heuristic)": 6, "K max (heuristic)": 3},
                  {"K schedule": "heuristic", "K (drafts per round)": 12, "K max (heuristic)": 8})
    for bad in impossible:
        out = client.predict(**by_label(client, "/reset", **bad), api_name="/reset")
        assert "Round 2 of 2" in out[STATUS], bad       # the run from before the bad input is intact
    with pytest.raises(AppError, match="less than minimum value 1"):  # Gradio's own bound check, as a message
        client.predict(**by_label(client, "/reset", **{"K (drafts per round)": 0}), api_name="/reset")
    assert "Round 3 of 3" in step(client)[STATUS]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"type": "header", "stream": null, "data": {"version": 1}}\n{oops\n')
    out = client.predict(handle_file(str(broken)), api_name="/replay_upload")
    assert "Round 3 of 3" in out[STATUS] and "live" in out[STATUS]
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


def test_closing_the_client_ends_its_session(server):
    url, pool = server
    client = Client(url, verbose=False)
    step(client)
    [session] = pool.sessions()
    run_pool = session.run.spec.target_runner.pool.manager
    client.close()   # its heartbeat stops: Gradio fires the app's unload event
    deadline = time.monotonic() + 120
    while len(pool) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pool) == 0 and session.run is None and run_pool.free_blocks == run_pool.num_blocks


def test_the_session_limit_gives_a_message_not_a_crash(server):
    url, pool = server
    clients = [Client(url, verbose=False) for _ in range(3)]
    statuses = [step(c)[STATUS] for c in clients]
    assert len(pool) == 2
    assert sum("Round 1 of 1" in s for s in statuses) == 2
    assert sum("No run yet" in s for s in statuses) == 1
    for c in clients:
        c.close()

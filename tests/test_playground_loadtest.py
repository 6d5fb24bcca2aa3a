"""playground.loadtest: its bounds, its isolation check, and one small real run against the app on loopback."""
from __future__ import annotations

import pytest

from playground import loadtest
from playground.loadtest import Visitor, isolation, reply_data


@pytest.mark.parametrize("argv, message", [
    (["--host", "0.0.0.0"], "--host must be a loopback address"),
    (["--host", "example.org"], "--host must be a loopback address"),
    (["--clients", "65"], "--clients must be from 1 to 64"),
    (["--steps", "0"], "--steps must be from 1 to 200"),
    (["--time-limit", "99999"], "--time-limit must be from 1 to 1800 seconds"),
])
def test_it_only_reaches_loopback_and_is_bounded(capsys, argv, message):
    with pytest.raises(SystemExit):
        loadtest.parse_args(argv)
    assert message in capsys.readouterr().err
    assert loadtest.parse_args(["--host", "::1"]).host == "::1"


def test_the_isolation_check_catches_crosstalk_and_vacuous_runs():
    def v(name, seed, *streams):
        return Visitor(name, seed, streams=list(streams))

    good = [v("a", 0, "x1", "x2"), v("b", 0, "x1", "x2"), v("c", 1, "y1", "y2")]
    assert isolation(good, [v("api", 0, "x1")]) == []
    crossed = [v("a", 0, "x1", "x2"), v("b", 0, "x1", "y2"), v("c", 1, "y1", "y2")]
    assert isolation(crossed, []) == ["seed 0: b saw a different stream from a"]
    same = [v("a", 0, "x1"), v("c", 1, "x1")]
    assert "proves nothing" in isolation(same, [])[0]
    assert "api saw a different stream" in isolation(good, [v("api", 0, "z1")])[0]


def test_a_small_run_passes_every_check(capsys, monkeypatch):
    # a bare caller has no heartbeat: its lease (6 s) must outlast a queued Step on a busy machine; a visitor's
    # session ends when its heartbeat stops, which the server notices within Gradio's heartbeat interval (15 s by
    # default, the test's longest wait: 2 s in the server it starts)
    monkeypatch.setenv("GRADIO_HEARTBEAT_INTERVAL", "2")
    rc = loadtest.main(["--clients", "2", "--api-callers", "1", "--steps", "1", "--session-lease", "6",
                        "--time-limit", "300", "--target", "builtin"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "errors: 0" in out and "isolation:" in out and ": OK" in out and "no session folder left: OK" in out
    assert "p50" in out and "server RSS" in out and "pair 'builtin" in out


def test_the_hostile_verdict_fails_on_any_answer_that_is_not_its_refusal(tmp_path):
    attacks = loadtest.Attacks("http://127.0.0.1:1/", None, tmp_path)
    attacks.reset_s, attacks.traces = [5.2], 3
    attacks.uploads = {"from 127.0.0.2: 403": 4, "from 127.0.0.1: 200": 2, "from 127.0.0.1: 507": 1}
    assert attacks.held()
    attacks.uploads["from 127.0.0.2: 200"] = 1            # an upload with no page open got through
    assert not attacks.held()
    del attacks.uploads["from 127.0.0.2: 200"]
    attacks.wrong.append("hung model's Step: Round 1 of 1")  # a Step that waited out the hung Reset
    assert not attacks.held()
    attacks.wrong.clear()
    attacks.traces = 0                                      # no surrogate trace was refused with its sentence
    assert not attacks.held()


def test_a_reply_is_read_past_its_heartbeats_and_an_error_is_quoted():
    reply = 'event: heartbeat\ndata: null\n\nevent: heartbeat\ndata: null\n\nevent: complete\ndata: [null, "Round 1"]\n\n'
    assert reply_data("step", reply) == [None, "Round 1"]
    with pytest.raises(RuntimeError, match="step: event: heartbeat"):
        reply_data("step", "event: heartbeat\ndata: null\n\n")            # never completed
    with pytest.raises(RuntimeError, match="event: error"):
        reply_data("step", "event: heartbeat\ndata: null\n\nevent: error\ndata: null\n\n")

"""playground.serve: `python app.py` as a process, tried as a hostile visitor would: start-up sweeps a killed
server's folders, a hung Hub endpoint freezes nobody, refusals are one log line each, SIGTERM leaves nothing."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file

from playground.loadtest import HungEndpoint, custom_values, wait_until_up
from playground.sessions import OWNER_LOCK, ROOT_PREFIX

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_hung_hub_endpoint_freezes_nobody_and_refusals_are_one_line_each(tmp_path):
    """A custom id whose Hub endpoint accepts and never answers: the visitor who asked is refused within the
    deadline, their own Step is refused as busy at once, another visitor steps meanwhile, and SIGTERM still
    ends the server while a hung load is under way, leaving no folder (a killed server's are swept at
    start-up). Malformed calls, a trace with a lone surrogate and an upload without a page open are each
    refused with a sentence and one log line, never a traceback."""
    tmp = tmp_path / "tmp"
    killed = tmp / (ROOT_PREFIX + "killed")       # what kill -9 leaves: a folder whose owner lock nobody holds
    (killed / "s-x").mkdir(parents=True)
    (killed / OWNER_LOCK).touch()
    hub = HungEndpoint()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "GRADIO_ANALYTICS_ENABLED")}
    env.update(TMPDIR=str(tmp), HF_ENDPOINT=f"http://127.0.0.1:{hub.port}")
    server = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--allow-custom-models",
                               "--hub-timeout", "3", "--target", "builtin"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_until_up(url, server, time.monotonic() + 180)   # a bound against a hang, not a timing
        assert not killed.exists()
        upload = httpx.post(url + "gradio_api/upload", files={"files": ("t.jsonl", b"{}\n")}, timeout=30)
        assert upload.status_code == 403 and "open playground page" in upload.text   # no page open yet
        a, b = Client(url, verbose=False), Client(url, verbose=False)
        hung = a.submit(**custom_values(a, "someone/not-a-model"), api_name="/reset")
        assert hub.accepted.acquire(timeout=60), "the app never reached the endpoint"
        assert a.predict(api_name="/step")[0].startswith("**⚠ Step refused: This session is busy: Reset is still")
        assert "Round 1 of" in b.predict(api_name="/step")[0]           # the other visitor is not held up
        [root] = tmp.glob(ROOT_PREFIX + "*")
        assert list(root.glob("s-*/trace-*.jsonl"))                     # its session's folder and trace
        status = hung.result(timeout=60)[0]
        assert "Reset failed" in status and "did not finish within 3 s" in status, status

        with pytest.raises(Exception, match="not in the list of choices"):
            b.predict("x", "default", "", "", "v9", "model", 4, "constant", 1, 8, 0, 0, 1, 0, 8, api_name="/reset")
        bad = httpx.post(url + "gradio_api/call/step", json={"data": []}, timeout=30)
        assert "error" in httpx.get(url + f"gradio_api/call/step/{bad.json()['event_id']}", timeout=60).text

        trace = tmp_path / "surrogate.jsonl"
        text = (REPO / "assets/traces/v2_k4_greedy.jsonl").read_text()
        trace.write_text(text.replace('"text": "', '"text": "\\ud800', 1))
        status = b.predict(handle_file(str(trace)), api_name="/replay_upload")[0]
        assert "Replay refused" in status and "not valid Unicode text (a lone surrogate)" in status, status
        assert "Round 2 of" in b.predict(api_name="/step")[0]          # the session goes on

        a.submit(**custom_values(a, "someone/other-model"), api_name="/reset")
        assert hub.accepted.acquire(timeout=60)
        server.send_signal(signal.SIGTERM)                               # with that load still hung
        assert server.wait(timeout=30) == 0
        a.close()
        b.close()
    finally:
        if server.poll() is None:
            server.kill()
        hub.close()
    out = server.stdout.read()
    assert "Traceback" not in out, out[-3000:]
    refusals = [line for line in out.splitlines() if "refused" in line]
    assert len(refusals) == 6, refusals   # upload, busy Step, Reset, choice, input count, trace: one line each
    assert list(tmp.glob(ROOT_PREFIX + "*")) == []
    assert [p for p in tmp.rglob("*") if p.is_file()] == []   # the upload cache went with the sessions

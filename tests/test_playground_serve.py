"""playground.serve: `python app.py` as a process: start-up sweeps a killed server's folders, SIGTERM leaves none."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gradio_client import Client

from playground.loadtest import wait_until_up
from playground.sessions import OWNER_LOCK, ROOT_PREFIX

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_removes_the_session_folders_and_start_up_sweeps_a_killed_servers(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    killed = tmp / (ROOT_PREFIX + "killed")       # what kill -9 leaves: a folder whose owner lock nobody holds
    (killed / "s-x").mkdir(parents=True)
    (killed / OWNER_LOCK).touch()
    port = free_port()
    env = {**os.environ, "TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    server = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until_up(url, server, time.monotonic() + 180)   # a bound against a hang, not a timing
        assert not killed.exists()
        client = Client(url, verbose=False)
        assert "Round 1 of" in client.predict(api_name="/step")[0]
        [root] = tmp.glob(ROOT_PREFIX + "*")
        assert list(root.glob("s-*/trace-*.jsonl"))       # the session's folder and its trace exist
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0
        client.close()
    finally:
        if server.poll() is None:
            server.kill()
    assert list(tmp.glob(ROOT_PREFIX + "*")) == []

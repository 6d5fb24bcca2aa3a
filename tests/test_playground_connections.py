"""playground.connections: the heartbeat watch attaches a session while its heartbeat request is open, and the
client address trusts only the configured proxies."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from playground.connections import HeartbeatWatch, client_address
from playground.sessions import SessionPool


def test_a_heartbeat_request_holds_its_session_until_it_ends(tmp_path):
    pool = SessionPool(4, 2**20, 60.0, tmp_path)
    seen: list[tuple[str, bool]] = []
    failing = {"on": False}

    async def app(scope, receive, send):
        seen.append((scope["path"], pool.held("abc123")))
        if failing["on"]:
            raise ConnectionResetError("the client went away")

    watch = HeartbeatWatch(app, pool)
    asyncio.run(watch({"type": "http", "path": "/gradio_api/heartbeat/abc123"}, None, None))
    asyncio.run(watch({"type": "http", "path": "/gradio_api/queue/join"}, None, None))
    failing["on"] = True
    with pytest.raises(ConnectionResetError):
        asyncio.run(watch({"type": "http", "path": "/sub/gradio_api/heartbeat/abc123"}, None, None))
    assert seen == [("/gradio_api/heartbeat/abc123", True), ("/gradio_api/queue/join", False),
                    ("/sub/gradio_api/heartbeat/abc123", True)]
    assert not pool.held("abc123")
    pool.shutdown()


def test_the_client_address_trusts_only_as_many_forwarded_hops_as_configured():
    request = SimpleNamespace(client=SimpleNamespace(host="10.0.0.9"),
                              headers={"x-forwarded-for": "6.6.6.6, 203.0.113.7"})   # spoofed, then the proxy's
    assert client_address(request, 0) == "10.0.0.9"
    assert client_address(request, 1) == "203.0.113.7"
    assert client_address(request, 2) == "6.6.6.6"
    assert client_address(SimpleNamespace(client=None, headers={}), 1) == "" and client_address(None) == ""

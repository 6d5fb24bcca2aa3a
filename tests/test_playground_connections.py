"""playground.connections: the heartbeat watch attaches a session while its heartbeat request is open, and the
client address trusts only the configured proxies."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from playground.connections import HeartbeatWatch, client_address, scope_address
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


def upload_scope(client: str, length: int | None = 10, app=None) -> dict:
    headers = [(b"content-length", str(length).encode())] if length is not None else []
    return {"type": "http", "method": "POST", "path": "/gradio_api/upload", "client": (client, 5000),
            "headers": headers, "app": app}


def test_uploads_need_an_open_page_at_their_address_a_declared_size_and_room(tmp_path):
    pool = SessionPool(4, 2**20, 60.0, tmp_path)
    folder = tmp_path / "uploads"
    folder.mkdir()
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        if "heartbeat" in scope["path"]:
            assert watch.connected("10.0.0.1") and not watch.connected("10.0.0.2")
            assert watch.refuse_upload(upload_scope("10.0.0.1", app=SimpleNamespace(uploaded_file_dir=folder))) is None
            assert watch.refuse_upload(upload_scope("10.0.0.1", 2000))[0] == 413
            (folder / "big").write_bytes(b"x" * 101)
            assert watch.refuse_upload(upload_scope("10.0.0.1", app=SimpleNamespace(uploaded_file_dir=folder)))[0] \
                == 507

    watch = HeartbeatWatch(app, pool, max_upload_bytes=1000, upload_quota_bytes=100)
    assert watch.refuse_upload(upload_scope("10.0.0.1"))[0] == 403      # no page open there
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    asyncio.run(watch(upload_scope("10.0.0.1"), None, send))
    assert reached == [] and sent[0]["status"] == 403                     # refused before Gradio reads it
    heartbeat = {"type": "http", "path": "/gradio_api/heartbeat/k1", "client": ("10.0.0.1", 5000), "headers": []}
    asyncio.run(watch(heartbeat, None, None))
    assert reached == ["/gradio_api/heartbeat/k1"] and not watch.connected("10.0.0.1")   # it ended: gone again
    pool.shutdown()


def test_the_upload_guard_finds_the_visitor_behind_the_trusted_proxy():
    scope = {"client": ("10.0.0.9", 1), "headers": [(b"x-forwarded-for", b"6.6.6.6, 203.0.113.7")]}
    assert scope_address(scope, 1) == "203.0.113.7" and scope_address(scope, 0) == "10.0.0.9"
    assert scope_address({"client": None, "headers": []}, 1) == ""

"""Who is connected: the heartbeat connections that keep sessions alive, the uploads they may send, and the
address a request comes from.

Every Gradio client (the browser page, gradio_client) keeps one long request open to
`.../gradio_api/heartbeat/<session hash>` for as long as it is connected, and Gradio fires the
app's unload event when that request ends. `HeartbeatWatch`, an ASGI middleware, tells the
SessionPool when each such request starts and ends, so a session lives exactly as long as a client
holds it (see playground.sessions); an API caller that never opens one has only its lease.

The same middleware guards `.../gradio_api/upload`, which Gradio serves to anyone: an upload is
refused unless its address holds a heartbeat connection (a page is open there), unless it declares
more than the upload bound, and while the upload folder is over its quota. Gradio itself stops
an upload that grows past the bound (launch's max_file_size), and deletes old uploads on a
schedule and at exit (the Blocks' delete_cache).
"""
from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from playground.sessions import SessionPool

log = logging.getLogger("specplay")
HEARTBEAT_PATH = re.compile(r"/gradio_api/heartbeat/([^/]+)/?$")
UPLOAD_PATH = re.compile(r"/gradio_api/upload/?$")


class HeartbeatWatch:
    """ASGI middleware: attach a session key to the pool while its heartbeat request is open, and let
    uploads through only from addresses that hold one (see the module)."""

    def __init__(self, app: ASGIApp, pool: SessionPool, proxy_hops: int = 0, max_upload_bytes: int | None = None,
                 upload_quota_bytes: int | None = None) -> None:
        self.app, self.pool, self.proxy_hops = app, pool, proxy_hops
        self.max_upload_bytes, self.upload_quota_bytes = max_upload_bytes, upload_quota_bytes
        self._open: dict[str, int] = {}    # address -> heartbeat connections open from it
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        match = HEARTBEAT_PATH.search(path)
        if match is not None:
            await self._heartbeat(match.group(1), scope, receive, send)
        elif UPLOAD_PATH.search(path) and scope.get("method") == "POST" and (refusal := self.refuse_upload(scope)):
            log.info("refused an upload from %s: %s", scope_address(scope, self.proxy_hops) or "?", refusal[1])
            await PlainTextResponse(refusal[1], status_code=refusal[0])(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _heartbeat(self, key: str, scope: Scope, receive: Receive, send: Send) -> None:
        address = scope_address(scope, self.proxy_hops)
        self.pool.attach(key)
        with self._lock:
            self._open[address] = self._open.get(address, 0) + 1
        try:
            await self.app(scope, receive, send)   # returns when the client goes away
        finally:
            with self._lock:
                left = self._open.pop(address, 0) - 1
                if left > 0:
                    self._open[address] = left
            self.pool.detach(key)

    def connected(self, address: str) -> bool:
        with self._lock:
            return self._open.get(address, 0) > 0

    def refuse_upload(self, scope: Scope) -> tuple[int, str] | None:
        """(HTTP status, sentence) when this upload must not reach the disk, else None."""
        if not self.connected(scope_address(scope, self.proxy_hops)):
            return 403, ("Uploads need an open playground page: open the playground in a browser (or connect "
                         "with gradio_client), then upload the trace from there.")
        declared = _content_length(scope)
        if self.max_upload_bytes is not None and declared is not None and declared > self.max_upload_bytes:
            return 413, (f"The upload is {declared / 2**20:.1f} MiB; this server takes files of at most "
                         f"{self.max_upload_bytes / 2**20:.0f} MiB.")
        folder = getattr(scope.get("app"), "uploaded_file_dir", None)
        if self.upload_quota_bytes is not None and folder and folder_bytes(Path(folder)) > self.upload_quota_bytes:
            return 507, ("The server's upload space is full for now; uploads are deleted after a few minutes, "
                         "so try again shortly.")
        return None


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (0 when it does not exist)."""
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:   # a file deleted while counting: count again next time
        return 0


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def heartbeat_middleware(pool: SessionPool, proxy_hops: int = 0, max_upload_bytes: int | None = None,
                         upload_quota_bytes: int | None = None) -> Middleware:
    """The middleware entry for `demo.launch(app_kwargs={"middleware": [...]})`."""
    return Middleware(HeartbeatWatch, pool=pool, proxy_hops=proxy_hops, max_upload_bytes=max_upload_bytes,
                      upload_quota_bytes=upload_quota_bytes)


def client_address(request: Any, proxy_hops: int = 0) -> str:
    """The address a Gradio request came from, "" when unknown (see `visitor_address`)."""
    peer = getattr(getattr(request, "client", None), "host", None) or ""
    headers = getattr(request, "headers", None) or {}
    return visitor_address(peer, str(headers.get("x-forwarded-for", "")), proxy_hops)


def scope_address(scope: Scope, proxy_hops: int = 0) -> str:
    """The address an ASGI request came from, as `client_address` finds it for a Gradio request."""
    client = scope.get("client")
    forwarded = b",".join(v for n, v in scope.get("headers") or () if n == b"x-forwarded-for")
    return visitor_address(client[0] if client else "", forwarded.decode("latin-1"), proxy_hops)


def visitor_address(peer: str, forwarded_for: str, proxy_hops: int) -> str:
    """The visitor's address from the connection's `peer` and its X-Forwarded-For header.

    With `proxy_hops` = N > 0 the server sits behind N proxies that each append the address they were
    reached from to X-Forwarded-For (a Hugging Face Space has one): the visitor is the N-th entry from
    the right. Entries further left are whatever the visitor chose to send, so they are never trusted.
    """
    if proxy_hops <= 0:
        return peer
    chain = [part.strip() for part in forwarded_for.split(",") if part.strip()]
    return chain[-proxy_hops] if len(chain) >= proxy_hops else (chain[0] if chain else peer)

"""Who is connected: the heartbeat connections that keep sessions alive, and the address a request comes from.

Every Gradio client (the browser page, gradio_client) keeps one long request open to
`.../gradio_api/heartbeat/<session hash>` for as long as it is connected, and Gradio fires the
app's unload event when that request ends. `HeartbeatWatch`, an ASGI middleware, tells the
SessionPool when each such request starts and ends, so a session lives exactly as long as a client
holds it (see playground.sessions); an API caller that never opens one has only its lease.
"""
from __future__ import annotations

import re
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from playground.sessions import SessionPool

HEARTBEAT_PATH = re.compile(r"/gradio_api/heartbeat/([^/]+)/?$")


class HeartbeatWatch:
    """ASGI middleware: attach a session key to the pool while its heartbeat request is open."""

    def __init__(self, app: ASGIApp, pool: SessionPool) -> None:
        self.app, self.pool = app, pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = HEARTBEAT_PATH.search(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        key = match.group(1)
        self.pool.attach(key)
        try:
            await self.app(scope, receive, send)   # returns when the client goes away
        finally:
            self.pool.detach(key)


def heartbeat_middleware(pool: SessionPool) -> Middleware:
    """The middleware entry for `demo.launch(app_kwargs={"middleware": [...]})`."""
    return Middleware(HeartbeatWatch, pool=pool)


def client_address(request: Any, proxy_hops: int = 0) -> str:
    """The address a Gradio request came from, "" when unknown.

    With `proxy_hops` = N > 0 the server sits behind N proxies that each append the address they were
    reached from to X-Forwarded-For (a Hugging Face Space has one): the visitor is the N-th entry from
    the right. Entries further left are whatever the visitor chose to send, so they are never trusted.
    """
    peer = getattr(getattr(request, "client", None), "host", None) or ""
    if proxy_hops <= 0:
        return peer
    headers = getattr(request, "headers", None) or {}
    chain = [part.strip() for part in str(headers.get("x-forwarded-for", "")).split(",") if part.strip()]
    return chain[-proxy_hops] if len(chain) >= proxy_hops else (chain[0] if chain else peer)

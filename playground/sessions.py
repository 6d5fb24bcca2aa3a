"""Per-browser sessions: each owns its run, its KV pools and its trace files; a pool bounds them.

Models are shared (see registry); everything a run writes to is the session's own. The pool caps
concurrent sessions and the KV memory they reserve together, and closes sessions that end (tab
closed: Gradio's unload event; state expired: gr.State's delete_callback) or sit idle too long.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.compared import ComparedRun
from playground.view import Cursor, Panel, RunInfo, RunView, view_from_run


class SessionLimitReached(RuntimeError):
    """The server is at its bound on sessions or KV memory; the message says what to do."""


@dataclass(eq=False)
class Session:
    """One browser tab's engine state: a live run or a replayed trace, and where the viewer stands."""

    key: str
    workdir: Path
    run: ComparedRun | None = None
    info: RunInfo | None = None
    replay: RunView | None = None
    cursor: Cursor = field(default_factory=Cursor)
    panel: Panel = Panel.DETAIL     # the tab shown, the one each event renders (see ui.Handlers.render)
    trace_path: Path | None = None
    kv_bytes: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one event at a time per session

    def view(self) -> RunView | None:
        if self.replay is not None:
            return self.replay
        if self.run is None or self.info is None:
            return None
        return view_from_run(self.run, self.info)

    @property
    def live(self) -> bool:
        return self.run is not None and self.replay is None

    def drop_run(self) -> None:
        """Close the run (freeing its KV blocks); its trace file stays for download until the next run."""
        if self.run is not None:
            self.run.close()
        self.run, self.info, self.replay, self.kv_bytes = None, None, None, 0
        self.cursor = Cursor()

    def new_trace_path(self) -> Path:
        """A fresh trace file in the session's folder; the previous run's trace is deleted (disk stays bounded)."""
        if self.trace_path is not None and self.trace_path.parent == self.workdir:
            self.trace_path.unlink(missing_ok=True)
        self.trace_path = self.workdir / f"trace-{uuid.uuid4().hex[:8]}.jsonl"
        return self.trace_path


class SessionPool:
    """Opens, bounds and closes sessions. Thread-safe: Gradio runs handlers on worker threads."""

    def __init__(self, max_sessions: int, kv_budget_bytes: int, idle_ttl_s: float, root: Path | None = None) -> None:
        self.max_sessions, self.kv_budget_bytes, self.idle_ttl_s = max_sessions, kv_budget_bytes, idle_ttl_s
        self.root = Path(tempfile.mkdtemp(prefix="specplay-sessions-", dir=root))
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def open(self, key: str) -> Session:
        """The session for a browser key, creating it if there is room (idle sessions are evicted first)."""
        with self._lock:
            if key in self._sessions:
                session = self._sessions[key]
                session.last_used = time.monotonic()
                return session
            self._evict_idle()
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimitReached(
                    f"The playground is full: {self.max_sessions} sessions are active. Try again in a few "
                    "minutes; meanwhile the Compare tab works on the example traces without a session.")
            session = Session(key, Path(tempfile.mkdtemp(prefix="s-", dir=self.root)))
            self._sessions[key] = session
            return session

    def reserve_kv(self, session: Session, nbytes: int) -> None:
        """Account a new run's KV pools to the session, within the server-wide budget."""
        with self._lock:
            others = sum(s.kv_bytes for s in self._sessions.values() if s is not session)
            if others + nbytes > self.kv_budget_bytes:
                raise SessionLimitReached(
                    f"This run needs {nbytes / 2**20:.0f} MiB of KV cache, but only "
                    f"{max(0, self.kv_budget_bytes - others) / 2**20:.0f} MiB of the server's "
                    f"{self.kv_budget_bytes / 2**20:.0f} MiB budget is free. Ask for fewer new tokens or a "
                    "shorter prompt.")
            session.kv_bytes = nbytes

    def close(self, session: Session | None) -> None:
        """End a session: close its run and delete its files. Safe to call twice (unload, then expiry)."""
        if session is None:
            return
        with self._lock:
            if self._sessions.get(session.key) is session:
                del self._sessions[session.key]
        with session.lock:
            session.drop_run()
        shutil.rmtree(session.workdir, ignore_errors=True)

    def close_key(self, key: str) -> None:
        self.close(self._sessions.get(key))

    def close_all(self) -> None:
        for session in self.sessions():
            self.close(session)

    def shutdown(self) -> None:
        self.close_all()
        shutil.rmtree(self.root, ignore_errors=True)

    def _evict_idle(self) -> None:
        now = time.monotonic()
        for key, s in list(self._sessions.items()):
            # A session busy in a handler is not idle, whatever its clock says: skip it.
            if now - s.last_used > self.idle_ttl_s and s.lock.acquire(blocking=False):
                try:
                    del self._sessions[key]
                    s.drop_run()
                finally:
                    s.lock.release()
                shutil.rmtree(s.workdir, ignore_errors=True)

"""Per-browser sessions: each owns its run, its KV pools and its trace files; a pool bounds them.

Models are shared (see registry); everything a run writes to is the session's own. The pool caps
concurrent sessions, the sessions one client address may hold, and the KV memory they reserve
together. A session lives while a connection keeps it: Gradio's heartbeat (a browser tab, a
gradio_client) holds it open (playground.heartbeats tells the pool), and each event renews it. One
that no heartbeat holds is reclaimed `lease_s` after its last event (an API caller that never comes
back), one that is held but unused after `idle_ttl_s`; a closed tab ends its session at once
(Gradio's unload event).

On disk, the pool's folder holds one folder per session, and a lock file the pool holds for as long
as it lives (the kernel lets go of it when the process dies, even on kill -9), so a server starting
later can tell the folders of a dead server from those of a live one and sweep them.
"""
from __future__ import annotations

import ctypes
import logging
import math
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.compared import ComparedRun
from playground.view import Cursor, Panel, RunInfo, RunView, view_from_run

try:
    import fcntl
except ImportError:  # not POSIX: no owner lock, so no sweeping of other servers' folders either
    fcntl = None

log = logging.getLogger("specplay")
ROOT_PREFIX = "specplay-sessions-"
OWNER_LOCK = ".owner.lock"


class SessionLimitReached(RuntimeError):
    """The server is at its bound on sessions or KV memory; the message says what to do."""


class SessionBusy(RuntimeError):
    """Another event of the same session still runs (a Reset loading models, a long run); the message says which."""


SHUTDOWN_WAIT_S = 2.0   # how long closing a session at shutdown waits for a handler that still holds it


@dataclass(eq=False)
class Session:
    """One browser tab's engine state: a live run or a replayed trace, and where the viewer stands."""

    key: str
    workdir: Path
    client: str = ""                  # the address that opened it (see SessionPool's per-client bound)
    run: ComparedRun | None = None
    info: RunInfo | None = None
    replay: RunView | None = None
    previous: RunView | None = None   # what was shown when a Reset failed, frozen (see keep_as_previous)
    cursor: Cursor = field(default_factory=Cursor)
    panel: Panel = Panel.DETAIL     # the tab shown, the one each event renders (see ui.Handlers.render)
    trace_path: Path | None = None
    kv_bytes: int = 0
    last_used: float = field(default_factory=time.monotonic)   # on the pool's clock
    lock: threading.Lock = field(default_factory=threading.Lock)  # one event at a time per session (see `hold`)
    holder: str | None = None         # what holds the lock now ("Reset", "Step", ...), for the busy message

    @contextmanager
    def hold(self, action: str, wait_s: float) -> Iterator[Session]:
        """Run `action` as the session's one event: wait at most `wait_s` for the event before it, else raise
        SessionBusy naming it. A Step passes 0 while a slow event holds the session, so that it never waits
        in the shared decoding slot for a Reset that is still loading (see playground.ui.Handlers.guarded)."""
        got = self.lock.acquire(timeout=wait_s) if wait_s > 0 else self.lock.acquire(blocking=False)
        if not got:
            raise SessionBusy(f"This session is busy: {self.holder or 'another action'} is still running. "
                              f"Try {action} again when it has finished.")
        self.holder = action
        try:
            yield self
        finally:
            self.holder = None
            self.lock.release()

    def view(self) -> RunView | None:
        if self.previous is not None:
            return self.previous
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
        self.run, self.info, self.replay, self.previous, self.kv_bytes = None, None, None, None, 0
        self.cursor = Cursor()

    def keep_as_previous(self, shown: RunView | None, cursor: Cursor, reason: str) -> None:
        """The one state a failed Reset leaves: what was shown before it (`shown`, at `cursor`) stays visible,
        frozen and marked as the previous run, and no engine is left that could continue it (its KV is
        freed). With nothing shown before, the session simply has no run."""
        self.drop_run()
        if shown is not None:
            self.previous = replace(shown, previous=reason)
            self.cursor = cursor

    def new_trace_path(self) -> Path:
        """A fresh, unused trace file name in the session's folder (see `use_trace`)."""
        return self.workdir / f"trace-{uuid.uuid4().hex[:8]}.jsonl"

    def use_trace(self, path: Path | None) -> None:
        """Make `path` the session's trace; the one before is deleted if it is the session's own (disk stays
        bounded: one trace per session)."""
        if self.trace_path is not None and self.trace_path != path and self.trace_path.parent == self.workdir:
            self.trace_path.unlink(missing_ok=True)
        self.trace_path = path


class SessionPool:
    """Opens, bounds, renews and reclaims sessions. Thread-safe: Gradio runs handlers on worker threads and
    heartbeats on its event loop. `now` is the clock (monotonic seconds), injectable for tests."""

    def __init__(self, max_sessions: int, kv_budget_bytes: int, idle_ttl_s: float, root: Path | None = None, *,
                 lease_s: float = 60.0, per_client: int | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions, self.kv_budget_bytes, self.idle_ttl_s = max_sessions, kv_budget_bytes, idle_ttl_s
        self.lease_s, self.per_client = lease_s, per_client or max_sessions
        self.parent = Path(root) if root is not None else Path(tempfile.gettempdir())
        self.root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir=self.parent))
        self._owner = _hold_owner_lock(self.root)
        self._now = now
        self._sessions: dict[str, Session] = {}
        self._held: dict[str, int] = {}   # key -> heartbeat connections open now
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def open(self, key: str, client: str = "") -> Session:
        """The session for a key, renewed; or a new one if there is room, after reclaiming expired ones.
        Raises SessionLimitReached saying when to retry."""
        with self._lock:
            session = self._sessions.get(key)
            if session is not None:
                session.last_used = self._now()
                return session
        self.sweep()
        with self._lock:
            session = self._sessions.get(key)   # opened by a concurrent event of the same visitor meanwhile
            if session is not None:
                session.last_used = self._now()
                return session
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimitReached(self._full_message())
            mine = [s for s in self._sessions.values() if s.client == client]
            if client and len(mine) >= self.per_client:
                raise SessionLimitReached(self._per_client_message(client, mine))
            session = Session(key, Path(tempfile.mkdtemp(prefix="s-", dir=self.root)), client,
                              last_used=self._now())
            self._sessions[key] = session
            return session

    # -- connections ----------------------------------------------------------------------------------------
    def attach(self, key: str) -> None:
        """A heartbeat connection for `key` opened: while one is open, the session is not reclaimed for
        want of a heartbeat (only for idling past idle_ttl_s)."""
        with self._lock:
            self._held[key] = self._held.get(key, 0) + 1

    def connected(self, key: str) -> bool:
        """Whether a heartbeat connection for `key` is open."""
        with self._lock:
            return key in self._held

    def detach(self, key: str) -> None:
        """A heartbeat connection for `key` closed; the session's lease runs from now."""
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)
            session = self._sessions.get(key)
            if session is not None:
                session.last_used = self._now()

    def held(self, key: str) -> bool:
        with self._lock:
            return self._held.get(key, 0) > 0

    # -- reclaiming -----------------------------------------------------------------------------------------
    def expires_in(self, session: Session) -> float:
        """Seconds until `session` may be reclaimed if nothing renews it (0 when it already may be)."""
        with self._lock:
            return self._expires_in(session)

    def _expires_in(self, session: Session) -> float:   # with self._lock held
        limit = self.idle_ttl_s if self._held.get(session.key, 0) > 0 else min(self.lease_s, self.idle_ttl_s)
        return max(0.0, session.last_used + limit - self._now())

    def sweep(self) -> list[str]:
        """Close every session whose time is up (see the module); returns their keys. A session busy in a
        handler is never reclaimed, whatever its clock says."""
        with self._lock:
            due = [s for s in self._sessions.values() if self._expires_in(s) <= 0]
        return [s.key for s in due if self._reclaim(s)]

    def _reclaim(self, session: Session) -> bool:
        """Close `session` if no handler holds it and it is still due (an event may have renewed it)."""
        if not session.lock.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if self._sessions.get(session.key) is not session or self._expires_in(session) > 0:
                    return False
                del self._sessions[session.key]
            session.drop_run()
        finally:
            session.lock.release()
        shutil.rmtree(session.workdir, ignore_errors=True)
        return_freed_memory()
        return True

    def _full_message(self) -> str:   # with self._lock held
        wait = min((self._expires_in(s) for s in self._sessions.values()), default=0.0)
        return (f"The playground is full: all {self.max_sessions} sessions are in use. One frees up as soon as "
                f"its visitor closes the tab, and at the latest in {_duration(wait)}, when the least recently "
                "used one is reclaimed: try again then. Meanwhile the Compare tab works on the example traces "
                "without a session.")

    def _per_client_message(self, client: str, mine: list[Session]) -> str:   # with self._lock held
        wait = min(self._expires_in(s) for s in mine)
        return (f"Your address ({client}) already holds {len(mine)} sessions, the most this server allows one "
                f"visitor. Close another playground tab, or wait: your least recently used session is reclaimed "
                f"in {_duration(wait)} at the latest, sooner once its tab is closed.")

    # -- KV and closing -------------------------------------------------------------------------------------
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

    def close(self, session: Session | None, wait_s: float | None = None) -> None:
        """End a session: close its run and delete its files. Safe to call twice (unload, then expiry).
        With `wait_s` (shutdown), a handler that still holds the session after that long (a hung load) is
        left to the process's exit: its folder goes, its run is not touched under the handler's feet."""
        if session is None:
            return
        with self._lock:
            if self._sessions.get(session.key) is session:
                del self._sessions[session.key]
        if session.lock.acquire(timeout=-1 if wait_s is None else wait_s):
            try:
                session.drop_run()
            finally:
                session.lock.release()
        else:
            log.warning("session %s is still busy with %s at shutdown; its run is left to the exit",
                        session.key[:8], session.holder or "an event")
        shutil.rmtree(session.workdir, ignore_errors=True)
        return_freed_memory()

    def close_key(self, key: str) -> None:
        with self._lock:
            session = self._sessions.get(key)
        self.close(session)

    def close_all(self, wait_s: float | None = None) -> None:
        for session in self.sessions():
            self.close(session, wait_s)

    def shutdown(self, wait_s: float = SHUTDOWN_WAIT_S) -> None:
        """Close every session and remove the pool's folder (clean shutdown leaves nothing on disk). A session
        still held by a handler is waited for `wait_s` at most, so a hung handler cannot hold up exit."""
        self.close_all(wait_s)
        shutil.rmtree(self.root, ignore_errors=True)
        if self._owner is not None:
            self._owner.close()
            self._owner = None

    def sweep_abandoned(self) -> list[Path]:
        """Remove the session folders of servers that died without shutting down (their owner lock is free),
        beside this pool's own; folders of live servers, and any folder without an owner lock, are left."""
        removed = []
        for folder in sorted(self.parent.glob(ROOT_PREFIX + "*")):
            if folder != self.root and folder.is_dir() and _owner_is_gone(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        return removed


class Sweeper:
    """Reclaims expired sessions every `interval` seconds on a daemon thread, between start() and stop()."""

    def __init__(self, pool: SessionPool, interval: float = 10.0) -> None:
        self.pool, self.interval = pool, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specplay-session-sweeper", daemon=True)

    def start(self) -> Sweeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                closed = self.pool.sweep()
                if closed:
                    log.info("reclaimed %d session(s) no connection renewed", len(closed))
            except Exception:  # a bug: keep sweeping
                log.exception("session sweep failed")


def return_freed_memory() -> None:
    """Ask the C allocator to hand freed heap pages back to the system (glibc's malloc_trim; a no-op
    elsewhere). What a closed session freed through malloc (its figures, parsed requests) otherwise stays
    in the server's RSS: measured, a wave of ten visitors left 132 MB behind without it and 60 MB with it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _duration(seconds: float) -> str:
    seconds = max(1, math.ceil(seconds))
    if seconds < 90:
        return f"about {seconds} s"
    return f"about {math.ceil(seconds / 60)} minutes"


def _hold_owner_lock(root: Path):
    """Open and exclusively lock the folder's owner file, for the life of the returned file object."""
    if fcntl is None:
        return None
    owner = (root / OWNER_LOCK).open("w")
    fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return owner


def _owner_is_gone(folder: Path) -> bool:
    """Whether the server that made `folder` has exited: its owner lock can be taken (then it is let go)."""
    if fcntl is None or not (folder / OWNER_LOCK).is_file():
        return False
    try:
        with (folder / OWNER_LOCK).open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except BlockingIOError:
        return False
    except OSError:
        return False

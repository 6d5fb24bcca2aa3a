"""playground.sessions: sessions tied to connections, bounded per client, reclaimed on time, swept after a crash.

Time is a fake clock handed to the pool, so nothing here sleeps or depends on how fast the machine is.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from playground.sessions import OWNER_LOCK, ROOT_PREFIX, SessionBusy, SessionLimitReached, SessionPool, Sweeper


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def pool_of(tmp_path, clock, **kw) -> SessionPool:
    return SessionPool(kw.pop("max_sessions", 8), 2**30, kw.pop("idle_ttl_s", 1800.0), tmp_path, now=clock, **kw)


def test_a_session_no_heartbeat_holds_is_reclaimed_a_lease_after_its_last_event(tmp_path, clock):
    pool = pool_of(tmp_path, clock, lease_s=60.0)
    api = pool.open("api-call", "10.0.0.1")
    clock.t += 59
    assert pool.sweep() == [] and len(pool) == 1
    pool.open("api-call", "10.0.0.1")       # an event renews it
    clock.t += 59
    assert pool.sweep() == []
    clock.t += 2
    assert pool.sweep() == ["api-call"] and len(pool) == 0 and not api.workdir.exists()


def test_a_held_session_lives_until_it_idles_past_the_timeout_and_its_lease_starts_at_disconnect(tmp_path, clock):
    pool = pool_of(tmp_path, clock, lease_s=60.0, idle_ttl_s=600.0)
    pool.attach("tab")                      # the heartbeat can connect before the first event
    tab = pool.open("tab", "10.0.0.1")
    clock.t += 300
    assert pool.sweep() == [] and pool.held("tab")
    clock.t += 301
    assert pool.sweep() == ["tab"]          # held, but unused for longer than the idle timeout
    tab = pool.open("tab", "10.0.0.1")
    clock.t += 500
    pool.detach("tab")                      # the tab went away (e.g. a network drop before unload)
    assert not pool.held("tab") and pool.expires_in(tab) == 60.0
    clock.t += 61
    assert pool.sweep() == ["tab"]


def test_two_heartbeats_for_one_key_hold_it_until_both_close(tmp_path, clock):
    pool = pool_of(tmp_path, clock, lease_s=10.0)
    pool.attach("k")
    pool.attach("k")
    pool.open("k")
    pool.detach("k")
    clock.t += 100
    assert pool.sweep() == [] and pool.held("k")
    pool.detach("k")
    clock.t += 11
    assert pool.sweep() == ["k"]


def test_one_address_holds_only_a_few_sessions_and_is_told_when_to_retry(tmp_path, clock):
    pool = pool_of(tmp_path, clock, per_client=2, lease_s=60.0)
    pool.open("a1", "10.0.0.1")
    clock.t += 15
    pool.open("a2", "10.0.0.1")
    clock.t += 5
    with pytest.raises(SessionLimitReached) as info:
        pool.open("a3", "10.0.0.1")
    assert "Your address (10.0.0.1) already holds 2 sessions" in str(info.value)
    assert "reclaimed in about 40 s at the latest" in str(info.value)
    assert pool.open("b1", "10.0.0.2").client == "10.0.0.2"    # others are not affected
    clock.t += 40
    assert pool.open("a3", "10.0.0.1").key == "a3"            # as promised: a1's lease ran out


def test_the_full_message_tells_the_truth_about_when_to_retry(tmp_path, clock):
    pool = pool_of(tmp_path, clock, max_sessions=2, lease_s=60.0, idle_ttl_s=1200.0)
    pool.attach("held")
    pool.open("held", "10.0.0.1")
    pool.open("api", "10.0.0.2")
    clock.t += 20
    with pytest.raises(SessionLimitReached) as info:
        pool.open("late", "10.0.0.3")
    assert "all 2 sessions are in use" in str(info.value) and "at the latest in about 40 s" in str(info.value)
    clock.t += 40
    pool.attach("late")
    assert pool.open("late", "10.0.0.3").key == "late"   # the API session's lease ran out, as the message said
    with pytest.raises(SessionLimitReached, match="at the latest in about 19 minutes"):   # 1200 s - 60 s
        pool.open("later", "10.0.0.4")


def test_a_session_busy_in_a_handler_is_not_reclaimed(tmp_path, clock):
    pool = pool_of(tmp_path, clock, lease_s=1.0)
    busy = pool.open("busy")
    clock.t += 10
    with busy.lock:
        assert pool.sweep() == []
    assert pool.sweep() == ["busy"]


def test_the_sweeper_reclaims_without_anyone_opening_a_session(tmp_path, clock):
    pool = pool_of(tmp_path, clock, lease_s=1.0)
    pool.open("gone")
    clock.t += 2
    done = threading.Event()
    sweeper = Sweeper(pool, interval=0.01).start()
    try:
        for _ in range(6000):               # a bound against a hang, not a duration under test
            if len(pool) == 0:
                done.set()
                break
            threading.Event().wait(0.01)
    finally:
        sweeper.stop()
    assert done.is_set()


def test_shutdown_removes_every_session_folder(tmp_path, clock):
    pool = pool_of(tmp_path, clock)
    folders = [pool.open(k).workdir for k in ("a", "b")]
    assert all(f.exists() for f in folders)
    pool.shutdown()
    assert not pool.root.exists() and list(tmp_path.iterdir()) == []


def test_start_up_sweeps_the_folders_of_a_killed_server_only(tmp_path, clock):
    script = ("import sys, time; from pathlib import Path; from playground.sessions import SessionPool; "
              "p = SessionPool(2, 2**20, 60.0, Path(sys.argv[1])); p.open('x'); print(p.root, flush=True); "
              "time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dead_root = child.stdout.readline().strip()
    live = pool_of(tmp_path, clock)                     # a server still running beside us
    checker = pool_of(tmp_path, clock)
    assert checker.sweep_abandoned() == []              # the child is alive: its folder stays
    checker.shutdown()
    child.send_signal(signal.SIGKILL)
    child.wait()
    unowned = tmp_path / (ROOT_PREFIX + "no-owner-file")   # e.g. written by an older version: left alone
    unowned.mkdir()
    fresh = pool_of(tmp_path, clock)
    assert [str(p) for p in fresh.sweep_abandoned()] == [dead_root]
    assert live.root.exists() and (live.root / OWNER_LOCK).exists() and unowned.exists() and fresh.root.exists()


def test_shutdown_does_not_wait_forever_for_a_hung_handler(tmp_path, clock):
    """A handler stuck in a hung call still holds its session: shutdown waits a bounded time, then removes
    the folders anyway and leaves that run to the process's exit."""
    pool = pool_of(tmp_path, clock)
    stuck, free = pool.open("stuck"), pool.open("free")
    with stuck.hold("Reset", 0):
        with pytest.raises(SessionBusy, match="busy: Reset is still running. Try Step again"):
            with stuck.hold("Step", 0):
                pass
        pool.shutdown(wait_s=0.05)
    assert not pool.root.exists() and not stuck.workdir.exists() and not free.workdir.exists()
    with stuck.hold("Step", 0):      # released: the next event gets it
        assert stuck.holder == "Step"
    assert stuck.holder is None

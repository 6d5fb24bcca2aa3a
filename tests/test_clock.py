"""The compute gate (engine.clock.ComputeGate): work given to it runs in turn, on its one compute thread, whose
OpenMP team is the only one in a server (playground.settings.one_team gives every other thread one thread)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from engine.clock import ComputeGate, in_turn, settle_heap
from playground.settings import one_team


def test_work_given_to_the_gate_runs_on_its_one_thread_one_at_a_time_and_its_errors_reach_the_caller():
    gate, lock, running, seen = ComputeGate(), threading.Lock(), [0], []

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            seen.append((threading.current_thread().name, running[0]))
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return i * i

    results: dict[int, int] = {}
    callers = [threading.Thread(target=lambda i=i: results.update({i: gate.run(lambda: work(i))})) for i in range(6)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert results == {i: i * i for i in range(6)}
    assert {name for name, _ in seen} == {"specplay-compute"} and max(n for _, n in seen) == 1

    def fails() -> None:
        raise ValueError("a prompt too long")
    with pytest.raises(ValueError, match="a prompt too long"):
        gate.run(fails)
    assert gate.run(lambda: threading.current_thread().name) == "specplay-compute"   # the thread serves on
    nested: list[int] = []                                  # work that asks for the gate again runs in its turn
    asker = threading.Thread(target=lambda: nested.append(gate.run(lambda: gate.run(lambda: 7))), daemon=True)
    asker.start()
    asker.join(timeout=30)                                  # (a bound against a deadlock, not a timing)
    assert nested == [7]
    assert in_turn(None, lambda: threading.current_thread().name) == threading.current_thread().name


def test_a_server_gives_every_thread_one_openmp_thread_but_the_compute_thread_its_count(tmp_path):
    """In a fresh process, as `python app.py` starts: OMP_NUM_THREADS=1 before torch loads, and the compute thread
    alone computes with the count asked for, whatever other threads computed before it."""
    script = tmp_path / "team.py"
    script.write_text(
        "import os, threading\n"
        "from playground.settings import one_team\n"
        "os.environ['OMP_NUM_THREADS'] = '2'\n"
        "threads = one_team(os.environ)\n"
        "import torch\n"
        "from engine.clock import ComputeGate, team_of\n"
        "torch.softmax(torch.randn(64, 50000), -1)\n"       # the main thread computes first
        "other = []\n"
        "t = threading.Thread(target=lambda: other.append(torch.get_num_threads()))\n"
        "t.start(); t.join()\n"
        "gate = ComputeGate(threads)\n"
        "print(threads, torch.get_num_threads(), other[0], gate.run(torch.get_num_threads), team_of(2))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    threads, main, other, compute, libgomp = out.stdout.split()
    if libgomp != "True":
        pytest.skip("torch's OpenMP runtime here is not libgomp: every thread keeps the process's count")
    assert (threads, main, other, compute) == ("2", "1", "1", "2")


def test_one_team_keeps_the_count_asked_for_and_leaves_other_threads_one():
    env = {"OMP_NUM_THREADS": "3"}
    assert one_team(env) == 3 and env["OMP_NUM_THREADS"] == "1"
    env = {}
    assert one_team(env) == len(os.sched_getaffinity(0)) and env["OMP_NUM_THREADS"] == "1"


def test_a_compute_thread_that_ended_is_replaced_rather_than_waited_for():
    gate = ComputeGate()
    assert gate.run(lambda: 1) == 1
    ended = threading.Thread(target=lambda: None, name="specplay-compute")
    ended.start()
    ended.join()
    gate._thread = ended                     # as if the compute thread had ended
    assert gate.run(lambda: 2) == 2 and gate._thread is not ended and gate._thread.is_alive()


def test_a_settled_heap_keeps_what_was_alive_out_of_full_collections():
    """settle_heap: what is alive at the call no longer sits in any generation a full collection scans; a frozen
    object whose last reference goes is still freed, and a cycle made afterwards is still collected."""
    class Thing:
        pass

    kept, dropped = Thing(), Thing()
    dropped_ref = weakref.ref(dropped)
    try:
        assert settle_heap() >= 2
        assert all(o is not kept for o in gc.get_objects())
        del dropped
        assert dropped_ref() is None
        cycle = Thing()
        cycle.me = cycle
        cycle_ref = weakref.ref(cycle)
        assert any(o is cycle for o in gc.get_objects())
        del cycle
        gc.collect()
        assert cycle_ref() is None
    finally:
        gc.unfreeze()

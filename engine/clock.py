"""The engine's clock: where a round's time goes, phase by phase, from one injectable time source.

Every time the engine reports (round phases, each model forward) is read from the `now` function it
was given, `time.perf_counter` by default; a test or a bench passes its own instead of patching
methods. On CUDA, forwards are synchronised at both ends (`sync_cuda`), so their times are the
device's rather than the launch's.
"""
from __future__ import annotations

import gc
import platform
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import TypeVar

import torch

Now = Callable[[], float]   # seconds, monotonic
T = TypeVar("T")


def settle_heap() -> int:
    """Collect once, then move every object still alive into the collector's permanent generation (`gc.freeze`):
    models, tokenizers and the app's own object graph are never scanned again by a full collection. Returns how
    many objects are frozen.

    Python runs a full collection when enough objects have piled up since the last one, and each scans every
    tracked object. With SmolLM2, its EAGLE head and the app loaded that is some 600,000 objects, and one such
    collection took 319 ms on the AVX2 EPYC; landing inside a timed round it cut a run's measured speed-up from
    1.30× to 1.04×, on whichever prompt of a sequence the allocations happened to bring it. Frozen objects that
    later become garbage are still freed by their reference counts; only cycles among them would stay, so call this
    after loading, never in a loop."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PhaseClock:
    """Accumulates milliseconds per named phase of one round (a phase may be entered several times)."""

    def __init__(self, now: Now = time.perf_counter) -> None:
        self.now = now
        self.start = now()
        self.ms: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.now()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (self.now() - t0) * 1000

    def get(self, name: str) -> float:
        return self.ms.get(name, 0.0)

    def total_ms(self) -> float:
        return (self.now() - self.start) * 1000


class ComputeGate:
    """One timed computation at a time on a process's cores, first come first served, all on one thread.

    A timed round and a background measurement (calibration) that ran side by side would each be timed
    sharing the cores with the other: on two cores a target step read twice its cost. Whoever times work holds
    the gate for it, a round for the whole round and the calibration for one forward at a time, so neither ever
    runs beside the other and the calibration goes on between rounds. Tickets keep the order fair: a waiting
    round goes before the calibration's next forward, and the other way round. Not reentrant.

    `run` also does the work on the gate's own thread, whoever asks. torch's CPU threads are OpenMP's, and
    OpenMP keeps a team of threads for every thread that has computed in parallel: once a server's worker
    threads had each computed, the process held more such threads than cores, and OpenMP then stops letting
    idle team threads spin between parallel regions, so each of a forward's 200-odd regions waited for a thread
    to wake (SmolLM2 target-only on an AVX2-only AMD EPYC, 2 cores: 65 tokens/s from one thread; 38-41 from
    the same thread once a second thread had computed, 64 again once that thread had ended; a script). One
    compute thread keeps one team."""

    def __init__(self, threads: int | None = None) -> None:
        """`threads`: how many OpenMP threads the compute thread computes with (`team_of`), where the process
        leaves every other thread one (`python app.py` does, so no other thread ever keeps a team); None: as the
        process has it."""
        self.threads = threads
        self._turn = threading.Condition()
        self._issued = 0
        self._serving = 0
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._taken: Future | None = None      # the work the compute thread took last

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._turn:
            ticket = self._issued
            self._issued += 1
            self._turn.wait_for(lambda: self._serving == ticket)
        try:
            yield
        finally:
            with self._turn:
                self._serving += 1
                self._turn.notify_all()

    def run(self, work: Callable[[], T]) -> T:
        """`work()` in turn (as under `held`), on the gate's compute thread; its result, or its exception. Called
        from work already running there, it runs at once (that work holds the turn). A compute thread that has
        ended (it never should) is replaced, and work it took with it fails with a RuntimeError, not a hang."""
        if threading.current_thread() is self._thread:
            return work()
        with self.held():
            done: Future = Future()
            self._work.put((work, done))
            while True:
                thread = self._thread
                if thread is None or not thread.is_alive():
                    if thread is not None and self._taken is done:
                        raise RuntimeError("the compute thread ended while it ran this work")
                    self._thread = threading.Thread(target=self._serve, name="specplay-compute", daemon=True)
                    self._thread.start()
                try:
                    return done.result(timeout=1.0)
                except FutureTimeout:    # still running, or its thread is gone: look again
                    continue

    def _serve(self) -> None:
        if self.threads is not None:
            team_of(self.threads)
        while True:
            work, done = self._work.get()
            self._taken = done
            try:
                done.set_result(work())
            except BaseException as exc:   # the caller raises it
                done.set_exception(exc)


def team_of(threads: int) -> bool:
    """Let the calling thread compute with `threads` OpenMP threads, leaving torch's count for every other
    thread as it is (torch sets a thread's count from its process-wide one when the thread first computes, and
    its own setter changes that process-wide count); False where torch's OpenMP runtime is not GNU's libgomp
    (the thread then computes with the process-wide count)."""
    import ctypes

    torch.zeros(2).sum()   # torch's set-up of this thread first, so that it does not undo the count below
    try:
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(threads)
    except (OSError, AttributeError):
        return False
    return torch.get_num_threads() == threads


def in_turn(gate: "ComputeGate | None", work: Callable[[], T]) -> T:
    """`work()` on `gate`'s compute thread in its turn, or right here without a gate."""
    return gate.run(work) if gate is not None else work()


class ForwardTimer:
    """Times model forwards on one device: synchronised at both ends on CUDA (`sync_cuda`), read from `now`.
    The one way a forward is timed: the runner's, the EAGLE head's, the bench's hooks on `generate`, the
    cache bench."""

    def __init__(self, device: torch.device, now: Now = time.perf_counter) -> None:
        self.device, self.now = torch.device(device), now
        self._t0 = 0.0

    def start(self) -> None:
        sync_cuda(self.device)
        self._t0 = self.now()

    def stop(self) -> float:
        """Milliseconds since `start`, the device's queued work included."""
        sync_cuda(self.device)
        return (self.now() - self._t0) * 1000

    @contextmanager
    def time(self, into: list[float]) -> Iterator[None]:
        """Append the milliseconds the block took to `into`."""
        self.start()
        yield
        into.append(self.stop())


def sync_cuda(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read afterwards includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_vendor() -> str:
    """The CPU's vendor id as /proc/cpuinfo gives it ("AuthenticAMD", "GenuineIntel"), or "" where there is
    none to read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags); without
    them torch emulates bf16 products, slower than fp32 ones."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def machine_name() -> str:
    """What a measurement ran on, for its report: the CPU's model name (from /proc/cpuinfo where there is
    one), the torch thread count, and the GPU when CUDA is present. Figures move with the machine, and
    the machines a project runs on change; every report says which one it was."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    text = f"{platform.system()} {cpu}, {torch.get_num_threads()} torch threads"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return text

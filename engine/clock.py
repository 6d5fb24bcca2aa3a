"""The engine's clock: where a round's time goes, phase by phase, from one injectable time source.

Every time the engine reports (round phases, each model forward) is read from the `now` function it
was given, `time.perf_counter` by default; a test or a bench passes its own instead of patching
methods. On CUDA, forwards are synchronised at both ends (`sync_cuda`), so their times are the
device's rather than the launch's.
"""
from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Now = Callable[[], float]   # seconds, monotonic


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
    """One timed computation at a time on a process's cores, first come first served.

    A timed round and a background measurement (calibration) that ran side by side would each be timed
    sharing the cores with the other: on two cores a target step read twice its cost. Whoever times work holds
    the gate for it, a round for the whole round and the calibration for one forward at a time, so neither ever
    runs beside the other and the calibration goes on between rounds. Tickets keep the order fair: a waiting
    round goes before the calibration's next forward, and the other way round. Not reentrant."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._issued = 0
        self._serving = 0

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

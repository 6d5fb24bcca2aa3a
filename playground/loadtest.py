"""`python -m playground.loadtest`: start the app on loopback, drive it with many visitors at once, and report.

The app runs as a child process (`python app.py` on 127.0.0.1, a free port, its own temp folder,
Hub access off). N gradio_client visitors reset and step their own runs concurrently; M bare API
callers do the same over plain HTTP (`/gradio_api/call/...` with their own session hash). It
prints Step latency (p50/p95, as a visitor waits for it, queueing included), the highest queue
place a visitor was shown, errors, isolation checks and the server's RSS before, at its peak and
after, and checks that SIGTERM leaves no session folder behind. Everything is bounded: at most
MAX_CLIENTS visitors, MAX_STEPS steps, and a wall-clock limit after which the run stops and fails.

With --hostile the visitors run twice, calm and then beside three attackers, and the report puts
their Step p50/p95 side by side: a visitor who resets to a custom model on a Hub endpoint that
accepts and never answers (a local listener the server is pointed at) and steps meanwhile; a
visitor who replays a trace holding a lone surrogate; and an upload flood, from 127.0.0.2 (no page
open there) and from 127.0.0.1 (files just under the bound, past the upload quota). At the end
SIGTERM is sent while a hung load is under way.

Isolation: visitors get one of SEED_GROUPS seeds in turn, at temperature 1. Visitors with the same
seed must see byte-identical token streams after every step, whoever else is stepping meanwhile,
and different seeds must differ (else the check would prove nothing). The bare callers use the
default settings, and must see exactly what a visitor with those settings sees.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.watch import is_loopback

REPO = Path(__file__).resolve().parent.parent
MAX_CLIENTS, MAX_API_CALLERS, MAX_STEPS, MAX_SECONDS = 64, 16, 200, 1800
SEED_GROUPS = 4
HUNG_HUB_TIMEOUT_S = 5                  # the app's --hub-timeout in the hostile run
FLOOD_FILE_MIB, FLOOD_FILES = 24, 12    # uploads from 127.0.0.1, just under the app's 32 MiB bound: past its quota
STATUS, STREAM = 0, 1     # gradio_client outputs (the session's gr.State is not among them)


@dataclass
class Visitor:
    """What one visitor (or bare caller) saw: a stream per step, the time each step took, and its errors."""

    name: str
    seed: int
    streams: list[str] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    max_queue_place: int = 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m playground.loadtest", description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8, help=f"gradio_client visitors, 1..{MAX_CLIENTS} (default 8)")
    ap.add_argument("--api-callers", type=int, default=2,
                    help=f"bare HTTP API callers beside them, 0..{MAX_API_CALLERS} (default 2)")
    ap.add_argument("--steps", type=int, default=20, help=f"Steps per visitor, 1..{MAX_STEPS} (default 20)")
    ap.add_argument("--time-limit", type=float, default=600, help=f"seconds for the whole run, at most {MAX_SECONDS}")
    ap.add_argument("--host", default="127.0.0.1", help="a loopback address (nothing else is allowed)")
    ap.add_argument("--session-lease", type=float, default=60.0,
                    help="the app's --session-lease: how long a bare caller's session outlives its last call")
    ap.add_argument("--target", default=None,
                    help="the app's --target: the default pair's target, e.g. smollm2 or builtin (default: the app's)")
    ap.add_argument("--hostile", action="store_true",
                    help="run the visitors calm, then beside a hung custom model, a bad trace and an upload flood")
    a = ap.parse_args(argv)
    checks = [(1 <= a.clients <= MAX_CLIENTS, f"--clients must be from 1 to {MAX_CLIENTS}"),
              (0 <= a.api_callers <= MAX_API_CALLERS, f"--api-callers must be from 0 to {MAX_API_CALLERS}"),
              (1 <= a.steps <= MAX_STEPS, f"--steps must be from 1 to {MAX_STEPS}"),
              (0 < a.time_limit <= MAX_SECONDS, f"--time-limit must be from 1 to {MAX_SECONDS} seconds"),
              (0 < a.session_lease <= MAX_SECONDS, f"--session-lease must be from 1 to {MAX_SECONDS} seconds"),
              (is_loopback(a.host), f"--host must be a loopback address such as 127.0.0.1, got {a.host!r}")]
    for ok, message in checks:
        if not ok:
            ap.error(message)
    return a


# -- the server ------------------------------------------------------------------------------------------------
def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(host: str, port: int, sessions: int, lease_s: float, tmp: Path,
                 hung_hub: int | None = None, target: str | None = None) -> subprocess.Popen:
    """`python app.py` on loopback, Hub access off; or, with `hung_hub` (a port), with custom models on and
    the Hub pointed at that port (HUNG_HUB_TIMEOUT_S for a config read). `target`: the app's --target."""
    env = {**os.environ, "TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [sys.executable, "app.py", "--host", host, "--port", str(port), "--max-sessions", str(sessions),
            "--max-sessions-per-client", str(sessions), "--session-lease", str(lease_s),
            *(["--target", target] if target else []), "--no-allow-custom-models"]
    if hung_hub is not None:
        env = {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{hung_hub}"
        argv[-1:] = ["--allow-custom-models", "--hub-timeout", str(HUNG_HUB_TIMEOUT_S)]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_until_up(url: str, server: subprocess.Popen, deadline: float) -> None:
    """Poll `url` until it answers 200; the server's output (stderr, else stdout) if it exits first."""
    import httpx

    while time.monotonic() < deadline:
        if server.poll() is not None:
            output = server.stderr or server.stdout
            raise RuntimeError(f"the app exited at start-up:\n{output.read()[-2000:] if output else ''}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError("the app did not start within the time limit")


def rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class PeakRss:
    """Samples a process's RSS on a thread until stopped; `peak` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except OSError:
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def session_folders(tmp: Path) -> list[Path]:
    return [p for root in tmp.glob("specplay-sessions-*") for p in root.glob("s-*")]


# -- the visitors -----------------------------------------------------------------------------------------------
# Set whatever the pair recommends (SmolLM2: T 0.2), so that seeds make streams differ (see the module).
LOAD_SETTINGS = {"Temperature (0 = greedy)": 1.0, "Top-p (1 = off)": 1.0}


def endpoint_values(client, changes: dict, endpoint: str = "/reset") -> dict:
    """Keyword arguments for an endpoint: its defaults, with `changes` (by the controls' labels) applied."""
    params = client.view_api(print_info=False, return_format="dict")["named_endpoints"][endpoint]["parameters"]
    values = {p["parameter_name"]: p["parameter_default"] for p in params}
    names = {p["label"]: p["parameter_name"] for p in params}
    values.update({names[label]: value for label, value in changes.items()})
    return values


def reset_values(client, seed: int, new_tokens: int, endpoint: str = "/reset") -> dict:
    """Keyword arguments for /reset (or /step): the defaults, with LOAD_SETTINGS, this visitor's seed and length."""
    return endpoint_values(client, {**LOAD_SETTINGS, "Seed": seed, "Max new tokens": new_tokens}, endpoint)


def run_visitor(url: str, visitor: Visitor, steps: int, new_tokens: int, deadline: float,
                start: threading.Barrier) -> None:
    from gradio_client import Client

    try:
        client = Client(url, verbose=False)
        try:
            client.predict(**reset_values(client, visitor.seed, new_tokens), api_name="/reset")
            step_values = reset_values(client, visitor.seed, new_tokens, "/step")   # Step with the run's settings
            start.wait(timeout=max(1.0, deadline - time.monotonic()))
            for _ in range(steps):
                if time.monotonic() > deadline:
                    visitor.errors.append("stopped at the time limit")
                    return
                visitor.streams.append(timed_step(client, visitor, step_values))
        finally:
            client.close()
    except Exception as exc:  # reported, not raised: one visitor's failure is a finding
        visitor.errors.append(f"{type(exc).__name__}: {exc}")


def timed_step(client, visitor: Visitor, values: dict) -> str:
    """One Step as a visitor waits for it, noting the queue place Gradio showed meanwhile."""
    t0 = time.perf_counter()
    job = client.submit(**values, api_name="/step")
    while not job.done():
        status = job.status()
        if status.rank is not None:
            visitor.max_queue_place = max(visitor.max_queue_place, status.rank + 1)
        time.sleep(0.02)
    out = job.result()
    visitor.step_ms.append((time.perf_counter() - t0) * 1000)
    for update in drain(job):
        log = getattr(update, "log", None)   # status updates carry the warnings shown; outputs do not
        if log and log[1] == "warning":
            visitor.errors.append(f"warning: {update.log[0]}")
    if "Round" not in out[STATUS]:
        visitor.errors.append(f"unexpected status: {out[STATUS][:120]}")
    return out[STREAM]


def drain(job) -> list:
    updates, queue = [], job.communicator.updates
    while not queue.empty():
        updates.append(queue.get_nowait())
    return updates


def with_length(params: list[dict], new_tokens: int) -> list:
    """/reset's positional values: every default, with LOAD_SETTINGS and "Max new tokens" set to new_tokens."""
    chosen = {**LOAD_SETTINGS, "Max new tokens": new_tokens}
    return [chosen.get(p["label"], p["parameter_default"]) for p in params]


def run_api_caller(url: str, visitor: Visitor, steps: int, new_tokens: int, deadline: float,
                   defaults: list[dict], start: threading.Barrier) -> None:
    """A bare HTTP caller with its own session hash: POST /gradio_api/call/<name>, then read the result."""
    import httpx

    session = f"loadtest-{uuid.uuid4().hex}"
    try:
        with httpx.Client(base_url=url, timeout=max(5.0, deadline - time.monotonic())) as http:
            values = with_length(defaults, new_tokens)
            call(http, "reset", values, session)
            start.wait(timeout=max(1.0, deadline - time.monotonic()))
            for _ in range(steps):
                if time.monotonic() > deadline:
                    visitor.errors.append("stopped at the time limit")
                    return
                t0 = time.perf_counter()
                out = call(http, "step", [False, *values], session)
                visitor.step_ms.append((time.perf_counter() - t0) * 1000)
                visitor.streams.append(out[1 + STREAM])   # [0] is the session's gr.State
    except Exception as exc:
        visitor.errors.append(f"{type(exc).__name__}: {exc}")


def call(http, name: str, data: list, session: str) -> list:
    event = http.post(f"/gradio_api/call/{name}", json={"data": data, "session_hash": session})
    event.raise_for_status()
    reply = http.get(f"/gradio_api/call/{name}/{event.json()['event_id']}").text
    return reply_data(name, reply)


def reply_data(name: str, reply: str) -> list:
    """The outputs of a /gradio_api/call stream: its `complete` event's data. Heartbeats (sent while a call
    waits, every GRADIO_HEARTBEAT_INTERVAL) and progress events before it are skipped; any other ending
    is an error that quotes the reply."""
    for block in reply.strip().split("\n\n"):
        kind, _, payload = block.strip().partition("\ndata: ")
        if kind.strip() == "event: complete":
            return json.loads(payload.strip())
        if kind.strip() not in ("event: heartbeat", "event: generating"):
            break
    raise RuntimeError(f"{name}: {reply[:200]}")


# -- the checks -------------------------------------------------------------------------------------------------
def isolation(visitors: list[Visitor], callers: list[Visitor]) -> list[str]:
    """The failed isolation checks (empty when all hold); see the module."""
    failures = []
    groups: dict[int, list[Visitor]] = {}
    for v in visitors:
        groups.setdefault(v.seed, []).append(v)
    for seed, members in groups.items():
        first = members[0]
        for other in members[1:]:
            if other.streams != first.streams:
                failures.append(f"seed {seed}: {other.name} saw a different stream from {first.name}")
    finals = {seed: m[0].streams[-1] for seed, m in groups.items() if m[0].streams}
    if len(finals) > 1 and len(set(finals.values())) < len(finals):
        failures.append("different seeds produced identical streams: the check above proves nothing")
    reference = groups.get(0, [None])[0]
    for caller in callers:
        n = min(len(caller.streams), len(reference.streams)) if reference is not None else 0
        if n and caller.streams[:n] != reference.streams[:n]:
            failures.append(f"{caller.name} saw a different stream from {reference.name} (same settings)")
    return failures


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


# -- main -------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    deadline = time.monotonic() + a.time_limit
    new_tokens = min(256, 5 * a.steps + 1)      # a round emits at most K + 1 = 5 tokens: the run outlasts the steps
    port = free_port(a.host)
    url = f"http://{a.host}:{port}/"
    with tempfile.TemporaryDirectory(prefix="specplay-loadtest-") as tmp_name:
        tmp = Path(tmp_name)
        hung = HungEndpoint() if a.hostile else None
        # a hostile run opens every visitor's session twice (bare callers' outlive the calm run by a lease)
        sessions = (2 * (a.clients + a.api_callers) + 5) if a.hostile else a.clients + a.api_callers + 2
        server = start_server(a.host, port, sessions, a.session_lease, tmp, hung.port if hung else None, a.target)
        try:
            return drive(a, url, server, tmp, new_tokens, deadline, hung)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            if hung is not None:
                hung.close()


def drive(a: argparse.Namespace, url: str, server: subprocess.Popen, tmp: Path, new_tokens: int,
          deadline: float, hung: HungEndpoint | None = None) -> int:
    from gradio_client import Client

    wait_until_up(url, server, deadline)
    warm = Client(url, verbose=False)      # loads the pair and warms the caches before "before" is measured
    pair = re.search(r"target `([^`]+)`", warm.predict(api_name="/step")[STATUS])
    defaults = warm.view_api(print_info=False, return_format="dict")["named_endpoints"]["/reset"]["parameters"]
    warm.close()
    rss_before = rss_mb(server.pid)
    peak = PeakRss(server.pid)
    calm = run_visitors(a, url, new_tokens, deadline, defaults)
    attacks = None
    if hung is not None:
        attacks = Attacks(url, hung, tmp)
        attacks.start()
        hostile = run_visitors(a, url, new_tokens, deadline, defaults, "hostile")
        attacks.stop()
    left = time.monotonic()
    while session_folders(tmp) and time.monotonic() < deadline:   # visitors' end on unload, callers' on their lease
        time.sleep(0.25)
    reclaimed_after = time.monotonic() - left
    rss_after, rss_peak = rss_mb(server.pid), peak.stop()
    left_open = len(session_folders(tmp))
    if attacks is not None:
        attacks.hang_one_more()      # SIGTERM goes in while a load is hung
    t0 = time.monotonic()
    server.send_signal(signal.SIGTERM)
    exited = server.wait(timeout=max(5.0, deadline - time.monotonic()))
    stopped_s = time.monotonic() - t0
    clean = exited == 0 and not list(tmp.glob("specplay-sessions-*"))
    runs = [calm] if attacks is None else [calm, hostile]
    failures = [f for run in runs for f in isolation(run.visitors, run.callers)]
    report(a, pair.group(1) if pair else "the default pair", runs, failures, (rss_before, rss_peak, rss_after),
           (left_open, reclaimed_after), clean, stopped_s)
    if attacks is not None:
        attacks.report()
    errors = sum(len(v.errors) for run in runs for v in run.visitors + run.callers)
    timed_out = any(run.timed_out for run in runs)
    attacked_ok = attacks is None or attacks.held()
    return 0 if not (errors or failures or timed_out or not clean or not attacked_ok) else 1


@dataclass
class Run:
    """One round of visitors: what each saw, and how long it took."""

    label: str
    visitors: list[Visitor]
    callers: list[Visitor]
    wall: float
    timed_out: bool


def run_visitors(a: argparse.Namespace, url: str, new_tokens: int, deadline: float, defaults: list[dict],
                 label: str = "calm") -> Run:
    visitors = [Visitor(f"visitor {i}", i % SEED_GROUPS) for i in range(a.clients)]
    seed = int(next(p["parameter_default"] for p in defaults if p["label"] == "Seed"))
    callers = [Visitor(f"api caller {i}", seed) for i in range(a.api_callers)]
    start = threading.Barrier(len(visitors) + len(callers))
    threads = [threading.Thread(target=run_visitor, args=(url, v, a.steps, new_tokens, deadline, start), daemon=True)
               for v in visitors]
    threads += [threading.Thread(target=run_api_caller, args=(url, c, a.steps, new_tokens, deadline, defaults, start),
                                 daemon=True) for c in callers]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return Run(label, visitors, callers, time.monotonic() - t0, any(t.is_alive() for t in threads))


# -- the attackers (--hostile) --------------------------------------------------------------------------------
class HungEndpoint:
    """A local "Hub" on 127.0.0.1 that accepts every connection and never answers; `accepted` counts them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.accepted = threading.Semaphore(0)
        threading.Thread(target=self._run, daemon=True, name="hung hub").start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted.release()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


class Attacks:
    """The three attackers of --hostile, each on its own thread, bounded in count and time; `report()` says what
    the server answered them and `held()` whether every answer was the refusal it should be."""

    def __init__(self, url: str, hung: HungEndpoint, tmp: Path) -> None:
        self.url, self.hung, self.tmp = url, hung, tmp
        self._stop = threading.Event()
        self.reset_s: list[float] = []           # a hung custom Reset, until its refusal
        self.busy_ms: list[float] = []           # that session's Step meanwhile, until its refusal
        self.wrong: list[str] = []               # any answer that was not the expected refusal
        self.traces = 0                          # surrogate traces refused with the sentence
        self.uploads: dict[str, int] = {}        # "from 127.0.0.x: status" -> count
        self.upload_peak_mib = 0.0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._hung_model, self._bad_trace,
                                                                            self._flood)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _hung_model(self) -> None:
        """Reset to a new hung id, Step the same session while it hangs, and read both refusals."""
        from gradio_client import Client

        client = Client(self.url, verbose=False)
        for i in range(20):
            if self._stop.is_set():
                break
            t0 = time.perf_counter()
            job = client.submit(**custom_values(client, f"someone/not-a-model-{i}"), api_name="/reset")
            hanging = self.hung.accepted.acquire(timeout=5) and not job.done()   # the server waits on the endpoint
            t1 = time.perf_counter()
            step = client.predict(api_name="/step")[STATUS]
            if hanging and not job.done():
                self.busy_ms.append((time.perf_counter() - t1) * 1000)
                if "Step refused: This session is busy" not in step:
                    self.wrong.append(f"hung model's Step: {step[:160]}")
            status = job.result()[STATUS]
            self.reset_s.append(time.perf_counter() - t0)
            if "Reset failed" not in status:
                self.wrong.append(f"hung model's Reset: {status[:160]}")
        client.close()

    def _bad_trace(self) -> None:
        from gradio_client import Client, handle_file

        client = Client(self.url, verbose=False)
        trace = self.tmp / "surrogate.jsonl"
        text = (REPO / "assets" / "traces" / "v2_k4_greedy.jsonl").read_text()
        trace.write_text(text.replace('"text": "', '"text": "\\ud800', 1))
        for _ in range(20):
            if self._stop.wait(0.5):
                break
            try:
                status = client.predict(handle_file(str(trace)), api_name="/replay_upload")[STATUS]
            except Exception as exc:  # the upload itself refused (the flood filled the quota): an answer too
                self._count(f"from 127.0.0.1: {type(exc).__name__}" if "507" not in str(exc) else "from 127.0.0.1: 507")
                continue
            if "Replay refused" in status and "lone surrogate" in status:
                self.traces += 1
            else:
                self.wrong.append(f"surrogate trace: {status[:160]}")
        client.close()

    def _flood(self) -> None:
        import httpx

        small, big = b"x" * 2**20, b"x" * (FLOOD_FILE_MIB * 2**20 - 16)   # a counter in front: each file new
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as far, \
                httpx.Client(timeout=120) as near:
            for i in range(FLOOD_FILES * 4):
                if self._stop.is_set():
                    return
                self._upload(far, "127.0.0.2", small)
                if i % 4 == 0:   # Gradio names an upload by its content: identical files would share one
                    self._upload(near, "127.0.0.1", b"%016d" % i + big)
                self.upload_peak_mib = max(self.upload_peak_mib, upload_mib(self.tmp))

    def _upload(self, http, source: str, data: bytes) -> None:
        try:
            code = str(http.post(self.url + "gradio_api/upload", files={"files": ("flood.bin", data)}).status_code)
        except Exception as exc:  # a refused or reset connection is an answer too
            code = type(exc).__name__
        self._count(f"from {source}: {code}")

    def _count(self, key: str) -> None:
        with self._lock:
            self.uploads[key] = self.uploads.get(key, 0) + 1

    def hang_one_more(self) -> None:
        """Start one more hung Reset and return once the server is waiting on the endpoint."""
        from gradio_client import Client

        client = Client(self.url, verbose=False)
        client.submit(**custom_values(client, "someone/another-model"), api_name="/reset")
        self.hung.accepted.acquire(timeout=60)

    def held(self) -> bool:
        far = sum(n for k, n in self.uploads.items() if k.startswith("from 127.0.0.2"))
        return bool(not self.wrong and self.reset_s and self.traces > 0
                and self.uploads.get("from 127.0.0.2: 403", 0) == far > 0)

    def report(self) -> None:
        print(f"  hostile: hung custom model ({len(self.reset_s)} Resets, each a new id): refused after p50 "
              f"{percentile(self.reset_s, 50):.1f} s, at most {max(self.reset_s, default=0):.1f} s (--hub-timeout "
              f"{HUNG_HUB_TIMEOUT_S} s); {len(self.busy_ms)} Steps of that session while it hung refused as busy "
              f"in p50 {percentile(self.busy_ms, 50):.0f} ms")
        print(f"  hostile: surrogate traces refused with their sentence: {self.traces}")
        print(f"  hostile: upload flood: {', '.join(f'{k} x{n}' for k, n in sorted(self.uploads.items()))}; "
              f"upload folder at most {self.upload_peak_mib:.0f} MiB")
        for line in self.wrong[:10]:
            print(f"    unexpected: {line}")


def custom_values(client, target: str) -> dict:
    """/reset's keyword arguments for the custom pair (target, target + "-draft")."""
    return endpoint_values(client, {"Model pair": "custom", "Custom draft id or path": target + "-draft",
                                    "Custom target id or path": target})


def upload_mib(tmp: Path) -> float:
    """What the app's upload folders hold now (they sit inside its session folder)."""
    from playground.connections import folder_bytes

    return sum(folder_bytes(p) for p in tmp.glob("specplay-sessions-*/uploads")) / 2**20


def report(a, pair: str, runs: list[Run], failures, rss, sessions, clean, stopped_s) -> None:
    first = runs[0]
    print(f"specplay load test: {a.clients} gradio_client visitors + {a.api_callers} bare API callers, "
          f"{a.steps} Steps each, pair {pair!r} on {os.cpu_count()} CPU(s), decoding concurrency 1")
    for run in runs:
        steps = [ms for v in run.visitors for ms in v.step_ms]
        api = [ms for c in run.callers for ms in c.step_ms]
        label = "" if len(runs) == 1 else f"{run.label + ',':8} "
        print(f"  {label}Step latency (visitors, queueing included): p50 {percentile(steps, 50):.0f} ms, "
              f"p95 {percentile(steps, 95):.0f} ms over {len(steps)} Steps")
        if api:
            print(f"  {label}Step latency (bare API callers):            p50 {percentile(api, 50):.0f} ms, "
                  f"p95 {percentile(api, 95):.0f} ms over {len(api)} Steps")
        errors = [f"{v.name}: {e}" for v in run.visitors + run.callers for e in v.errors]
        print(f"  {label}highest queue place shown to a visitor: "
              f"{max((v.max_queue_place for v in run.visitors), default=0)}; wall time {run.wall:.1f} s; "
              f"errors: {len(errors)}" + ("; stopped at the time limit" if run.timed_out else ""))
        for line in errors[:10]:
            print(f"    {line}")
    groups = len({v.seed for v in first.visitors})
    print(f"  isolation: {groups} seed group(s) over {len(first.visitors)} visitors, byte-identical within a group, "
          f"distinct across; API callers match the visitors with their settings: "
          + ("OK" if not failures else "FAILED"))
    for line in failures:
        print(f"    {line}")
    before, peak, after = rss
    left_open, reclaimed_after = sessions
    print(f"  sessions: all reclaimed {reclaimed_after:.0f} s after the last client left (a visitor's when its "
          f"heartbeat ends, a bare caller's a lease after its last call)" if not left_open else
          f"  sessions: {left_open} still open at the time limit")
    print(f"  server RSS: {before:.0f} MB before, {peak:.0f} MB at peak, {after:.0f} MB after "
          f"({after - before:+.0f} MB)")
    print(f"  SIGTERM: exit 0 in {stopped_s:.1f} s and no session folder left: {'OK' if clean else 'FAILED'}")


if __name__ == "__main__":
    sys.exit(main())

"""Watching a real engine: vLLM's, llama.cpp's and SGLang's speculative-decoding metrics, read from their
Prometheus `/metrics` text and turned into the playground's figures, with `python -m engine watch URL`.

vLLM (v1) exports counters per model (label `model_name`): drafts, draft tokens, accepted tokens,
accepted tokens per draft position, generated tokens. llama.cpp's server (started with `--metrics`)
exports the same counters under its own prefix, for its one model and without the label (named
"llama.cpp" here); its drafts are its verify steps, its per-position count as vLLM's does. Over an
interval, from their increases:
acceptance rate = Δaccepted / Δdraft_tokens, mean acceptance length = 1 + Δaccepted / Δdrafts, the
rate at position i = Δper_position[i] / Δdrafts, and tokens/s from Δ / seconds. A counter that goes
down means the server restarted: the interval then counts from zero (its new value is the increase).
SGLang exports gauges instead (`sglang:spec_accept_length`, `sglang:spec_accept_rate`): read as they are.

Only the addresses an operator allows are fetched (loopback unless `allowed` names more), with a
timeout and a bound on the answer's size; each way a fetch can fail has its own sentence.
"""
from __future__ import annotations

import argparse
import ipaddress
import math
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from engine.metrics import conditional_rates, expected_tokens_from_rates

MAX_METRICS_BYTES = 4 * 2**20    # a /metrics page is tens of kB; this bounds a hostile or wrong endpoint
FETCH_TIMEOUT_S = 5.0
VLLM = "vllm:spec_decode_num_"
LLAMACPP = "llamacpp:spec_decode_num_"
GENERATED = {"vllm:generation_tokens_total": "", "llamacpp:tokens_predicted_total": "llama.cpp"}
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?\s*')


class WatchError(RuntimeError):
    """The metrics could not be read or hold no speculative decoding; the message says which, for a person."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments and blank lines skipped). Raises WatchError
    when a line is neither, so that an HTML page or a JSON answer is told apart from metrics."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise WatchError(f"the answer is not Prometheus metrics text (line {number}: {line[:60]!r}); point "
                             "the URL at the server's /metrics")
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(2) or "")}
        try:
            value = float(m.group(3))
        except ValueError:
            raise WatchError(f"line {number} of the metrics has a value that is not a number: {m.group(3)!r}") \
                from None
        samples.append(Sample(m.group(1), labels, value))
    return samples


@dataclass(frozen=True, slots=True)
class Counters:
    """One model's speculative-decoding readings at one moment (vLLM counters, or SGLang gauges)."""

    model: str
    at: float                              # seconds, the watcher's monotonic clock
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()
    generated: float = 0.0
    accept_length: float | None = None     # SGLang's gauge
    accept_rate: float | None = None       # SGLang's gauge


def counters(samples: list[Sample], at: float) -> dict[str, Counters]:
    """Readings by model name, summed over vLLM's engines; raises WatchError when no model speculates."""
    found: dict[str, dict] = {}
    for s in samples:
        model = s.labels.get("model_name", "")
        prefix = next((p for p in (VLLM, LLAMACPP) if s.name.startswith(p)), None)
        if prefix is not None and s.name.endswith("_total"):
            model = model or ("llama.cpp" if prefix == LLAMACPP else "")
            field_name = {"drafts_total": "drafts", "draft_tokens_total": "draft_tokens",
                          "accepted_tokens_total": "accepted"}.get(s.name[len(prefix):])
            entry = found.setdefault(model, {"per_position": {}})
            if field_name:
                entry[field_name] = entry.get(field_name, 0.0) + s.value
            elif s.name == prefix + "accepted_tokens_per_pos_total" and s.labels.get("position", "").isdigit():
                i = int(s.labels["position"])
                entry["per_position"][i] = entry["per_position"].get(i, 0.0) + s.value
        elif s.name in GENERATED:
            entry = found.setdefault(model or GENERATED[s.name], {"per_position": {}})
            entry["generated"] = entry.get("generated", 0.0) + s.value
        elif s.name in ("sglang:spec_accept_length", "sglang:spec_accept_rate"):
            entry = found.setdefault(model, {"per_position": {}})
            entry["accept_length" if s.name.endswith("length") else "accept_rate"] = s.value
    speculating = {m: e for m, e in found.items() if "drafts" in e or "accept_length" in e}
    if not speculating:
        raise WatchError("the server exports no speculative-decoding metrics: speculation is off (start vLLM "
                         "with --speculative-config, llama.cpp's server with --metrics and --spec-type or a draft "
                         "model, SGLang with --speculative-algorithm)")
    out = {}
    for model, e in speculating.items():
        positions = e.pop("per_position")
        out[model] = Counters(model, at, per_position=tuple(positions.get(i, 0.0) for i in range(len(positions))), **e)
    return out


@dataclass(frozen=True, slots=True)
class Interval:
    """What one model did between two readings: the playground's figures, from the counters' increases."""

    model: str
    seconds: float
    drafts: float
    acceptance_rate: float | None          # accepted / draft tokens
    mean_acceptance_length: float | None   # 1 + accepted / drafts: tokens per verify step
    position_rates: tuple[float, ...]      # accepted at position i / drafts
    drafted_per_s: float
    accepted_per_s: float
    generated_per_s: float
    restarted: bool = False                # a counter went down: the server restarted, counted from zero
    gauges: dict[str, float] = field(default_factory=dict)   # SGLang's, as read

    @property
    def conditional_rates(self) -> tuple[float, ...]:
        """P(position i accepted | position i - 1 accepted): vLLM's rate at i counts every draft (accepted
        at i / drafts), the engine's per-position rates are conditional (engine.metrics). NaN past a 0."""
        return tuple(conditional_rates(self.position_rates))

    def predicted_speedup(self, c: float, r: float, k: int | None = None) -> float | None:
        """Leviathan's speed-up E / (cK + r) from the measured per-position rates (engine.metrics'
        E(rates, K), with no i.i.d. assumption), at the K drafted or another; c is the draft's cost and r
        the verify's, each relative to one target step. At the K drafted, E is the mean acceptance length."""
        k = k or len(self.position_rates)
        if not self.position_rates or not any(math.isfinite(a) for a in self.conditional_rates):
            return None
        return expected_tokens_from_rates(self.conditional_rates, k) / (c * k + r)


def interval(before: Counters, after: Counters) -> Interval:
    """`after` against `before` (the same model); see the module for the figures and for restarts."""
    seconds = max(after.at - before.at, 1e-9)
    pairs = [(before.drafts, after.drafts), (before.draft_tokens, after.draft_tokens),
             (before.accepted, after.accepted), (before.generated, after.generated)]
    pairs += list(zip(before.per_position, after.per_position))
    restarted = any(b > a for b, a in pairs)
    base = Counters(after.model, before.at) if restarted else before
    drafts, draft_tokens = after.drafts - base.drafts, after.draft_tokens - base.draft_tokens
    accepted = after.accepted - base.accepted
    old = base.per_position + (0.0,) * (len(after.per_position) - len(base.per_position))
    rates = tuple((a - b) / drafts for a, b in zip(after.per_position, old)) if drafts else ()
    gauges = {k: v for k, v in (("accept_length", after.accept_length), ("accept_rate", after.accept_rate))
              if v is not None}
    return Interval(after.model, seconds, drafts, accepted / draft_tokens if draft_tokens else None,
                    1 + accepted / drafts if drafts else None, rates, draft_tokens / seconds, accepted / seconds,
                    (after.generated - base.generated) / seconds, restarted, gauges)


# -- fetching --------------------------------------------------------------------------------------------
def check_allowed(url: str, allowed: tuple[str, ...] = (), flag: str = "--allow-host", verb: str = "watched") -> None:
    """WatchError unless `url` is http(s) to a loopback address or to a host named in `allowed` (`flag`: the
    option that names more, as the refusal tells the operator; `verb`: what is done to a server)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WatchError(f"{url!r} is not an http(s) URL such as http://127.0.0.1:8000/metrics")
    host = parts.hostname
    if host in allowed or is_loopback(host):
        return
    raise WatchError(f"{host} is not allowed: only loopback addresses are {verb} unless the operator names "
                     f"the host ({flag} {host})")


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def fetch(url: str, allowed: tuple[str, ...] = (), timeout: float | None = None,
          max_bytes: int = MAX_METRICS_BYTES) -> str:
    """The text at `url`, within `timeout` seconds (FETCH_TIMEOUT_S) and `max_bytes` bytes; WatchError with a
    sentence otherwise."""
    timeout = FETCH_TIMEOUT_S if timeout is None else timeout
    check_allowed(url, allowed)
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never through a proxy
    try:
        with opener.open(request, timeout=timeout) as answer:
            body = answer.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise WatchError(f"{url} answered HTTP {exc.code}; is this the server's /metrics?") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            raise WatchError(f"nothing is listening at {url} (connection refused): is the server running?") from None
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise WatchError(f"{url} did not answer within {timeout:g} s") from None
        raise WatchError(f"could not reach {url}: {reason}") from None
    except (socket.timeout, TimeoutError):
        raise WatchError(f"{url} did not answer within {timeout:g} s") from None
    if len(body) > max_bytes:
        raise WatchError(f"{url} sent more than {max_bytes // 2**20} MiB; a /metrics page is far smaller")
    return body.decode("utf-8", errors="replace")


def read(url: str, allowed: tuple[str, ...] = (), at: float | None = None) -> dict[str, Counters]:
    """Fetch and parse one reading of every speculating model at `url`."""
    return counters(parse_prometheus(fetch(url, allowed)), time.monotonic() if at is None else at)


# -- watching over time ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Point:
    """One interval of one model, placed on the watch's time line (seconds since the first reading)."""

    t: float
    interval: Interval


class Watcher:
    """Polls one server's metrics and keeps, per model, its intervals (the last `keep`) and the whole watch.

    `poll` reads once; every model read before gets a new interval. The whole watch is the increase from
    the first reading (or from the last restart, when a counter went down: the counters start at zero
    again) to the latest. A model that appears later starts its own watch then. Owned by one caller (a
    visitor's page, the terminal command): nothing here is shared.
    """

    def __init__(self, url: str, allowed: tuple[str, ...] = (), keep: int = 720,
                 reader=read, flag: str = "--allow-host") -> None:
        check_allowed(url, allowed, flag)
        self.url, self.allowed, self.keep = url, allowed, keep
        self._read = reader
        self.start: float | None = None
        self.first: dict[str, Counters] = {}
        self.last: dict[str, Counters] = {}
        self.points: dict[str, list[Point]] = {}
        self.restarts: dict[str, int] = {}

    def poll(self, at: float | None = None) -> dict[str, Interval]:
        """One reading; the new interval of every model read before. WatchError as `read` raises it."""
        now = self._read(self.url, self.allowed, at)
        taken = next(iter(now.values())).at
        self.start = taken if self.start is None else self.start
        fresh = {}
        for model, reading in now.items():
            before = self.last.get(model)
            self.last[model] = reading
            if before is None:
                self.first[model] = reading
                continue
            iv = interval(before, reading)
            if iv.restarted:
                self.first[model] = Counters(model, before.at)
                self.restarts[model] = self.restarts.get(model, 0) + 1
            points = self.points.setdefault(model, [])
            points.append(Point(reading.at - self.start, iv))
            del points[: max(0, len(points) - self.keep)]
            fresh[model] = iv
        return fresh

    @property
    def models(self) -> list[str]:
        return sorted(self.last)

    def total(self, model: str) -> Interval | None:
        """The whole watch of `model` (since its first reading or its last restart); None before two readings."""
        if model not in self.points:
            return None
        return interval(self.first[model], self.last[model])


# -- python -m engine watch ---------------------------------------------------------------------------------
def line(iv: Interval, c: float | None, r: float | None) -> str:
    """One interval as the terminal shows it."""
    def num(x: float | None, fmt: str = ".3f") -> str:
        return "—" if x is None or not math.isfinite(x) else format(x, fmt)
    rates = " ".join(num(x, ".2f") for x in iv.position_rates) or "—"
    parts = [f"{iv.model}: {iv.drafts:.0f} drafts", f"acceptance {num(iv.acceptance_rate)}",
             f"mean length {num(iv.mean_acceptance_length, '.2f')}", f"per position [{rates}]",
             f"drafted {iv.drafted_per_s:.1f}/s", f"accepted {iv.accepted_per_s:.1f}/s",
             f"generated {iv.generated_per_s:.1f} tok/s"]
    parts += [f"{k.replace('_', ' ')} {v:.3f} (gauge)" for k, v in iv.gauges.items()]
    if c is not None and r is not None:
        parts.append(f"predicted speed-up {num(iv.predicted_speedup(c, r), '.2f')}x (c={c:g}, r={r:g})")
    return " · ".join(parts) + (" · the server restarted: counted from zero" if iv.restarted else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine watch", description=__doc__.splitlines()[0])
    ap.add_argument("url", help="the server's metrics, e.g. http://127.0.0.1:8000/metrics")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between readings (default 5)")
    ap.add_argument("--count", type=int, default=0, help="stop after this many intervals (default: never)")
    ap.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                    help="a host other than loopback that may be watched (repeat for more)")
    ap.add_argument("--c", type=float, help="draft cost relative to a target step, for the predicted speed-up")
    ap.add_argument("--r", type=float, help="verify cost (K+1 tokens) relative to a target step")
    a = ap.parse_args(argv)
    if not 0.2 <= a.interval <= 3600:
        ap.error("--interval must be from 0.2 to 3600 seconds")
    allowed = tuple(a.allow_host)
    try:
        watcher = Watcher(a.url, allowed)
        watcher.poll()
        done = 0
        while not a.count or done < a.count:
            time.sleep(a.interval)
            for iv in watcher.poll().values():
                print(line(iv, a.c, a.r), flush=True)
            done += 1
    except WatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

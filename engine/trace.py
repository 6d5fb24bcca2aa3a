"""Run traces as JSON Lines: a header, one line per round (spec and baseline streams), and summaries.

A trace is written while the run happens, one flushed line per event, so an interrupted run still
leaves a readable file: `load_trace` tolerates a truncated last line and reports complete=False.

Line format: {"type": "header" | "round" | "summary", "stream": "spec" | "baseline" | null,
"data": {...}}. The first line is the header. Loading never evaluates anything: every line is
parsed with `json.loads` and checked against the record dataclasses' own type hints (required
and unknown keys, types, Outcome values, finite numbers, bounded lists) before a record is built.
"""
from __future__ import annotations

import json
import math
import os
import platform
import types
import typing
from dataclasses import asdict, dataclass, fields, is_dataclass
from datetime import datetime, timezone
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any, Callable

from engine.calibration import RCurve
from engine.config import K_BOUND, SpecConfig
from engine.models import LoadedModel
from engine.prompts import ChatPrompt
from engine.records import Outcome, RoundRecord, RunSummary
from engine.sampling import SamplingParams

TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)   # version 1 traces are upgraded as they are read (see `_upgrade_v1_round`)
MAX_TRACE_BYTES = 64 * 2**20
MAX_LIST_LEN = 1 << 20          # no list in a sane trace comes near this; a bound keeps a hostile file cheap
STREAMS = ("spec", "baseline")
LINE_TYPES = ("header", "round", "summary", "calibration")


class TraceError(ValueError):
    """A trace file cannot be read: the message says which line and what is wrong."""


@dataclass(frozen=True, slots=True)
class TraceHeader:
    """What produced a trace: prompt, settings, models, placement and software versions."""

    version: int
    created: str                 # ISO 8601, UTC
    prompt: str
    prompt_ids: list[int]
    config: dict                 # SpecConfig as JSON (enums as values, sampling nested)
    target: str
    draft: str | None            # None when no draft model was used (target-only or n-gram runs)
    devices: dict[str, str]      # role ("target", "draft") -> device
    dtypes: dict[str, str]       # role -> dtype
    versions: dict[str, str]     # python, torch, transformers, specplay
    seed: int
    chat: ChatPrompt | None = None   # the chat turn the prompt ids were templated from (None: raw text)
    eagle: str | None = None     # the EAGLE head the run drafted with, when it used one


@dataclass(frozen=True)
class Trace:
    """A loaded trace. complete is True when the spec stream's summary was written."""

    header: TraceHeader
    rounds: list[RoundRecord]
    baseline: list[RoundRecord]
    summary: RunSummary | None
    baseline_summary: RunSummary | None
    complete: bool
    calibration: RCurve | None = None   # the target's measured r(n), when the run had one


# ---------------------------------------------------------------------------- header

def config_to_dict(config: SpecConfig) -> dict:
    """SpecConfig -> JSON-ready dict: enums become their values, sampling a nested dict."""
    out = {f.name: getattr(config, f.name) for f in fields(config)}
    for name, value in out.items():
        if isinstance(value, Enum):
            out[name] = value.value
    out["sampling"] = asdict(config.sampling)
    return out


def config_from_dict(data: dict) -> SpecConfig:
    """Inverse of `config_to_dict`; SpecConfig's own validation applies. Raises TraceError."""
    if not isinstance(data, dict) or not isinstance(data.get("sampling"), dict):
        raise TraceError("config must be an object with a nested sampling object")
    try:
        sampling = SamplingParams(**data["sampling"])
        return SpecConfig(**{**data, "sampling": sampling})
    except (TypeError, ValueError) as exc:
        raise TraceError(f"config is not a valid SpecConfig: {exc}") from None


def _specplay_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("specplay")
    except metadata.PackageNotFoundError:
        return "dev"


def make_header(prompt: str, prompt_ids: list[int], config: SpecConfig, target: LoadedModel,
                draft: LoadedModel | None, chat: ChatPrompt | None = None, eagle: str | None = None) -> TraceHeader:
    """The header for a run. The draft is recorded only if the run uses it (model drafter, not target mode)."""
    import torch
    import transformers

    used = draft if draft is not None and config.uses_draft_model else None
    roles = {"target": target} | ({"draft": used} if used is not None else {})
    return TraceHeader(
        version=TRACE_VERSION, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        prompt=prompt, prompt_ids=[int(t) for t in prompt_ids], config=config_to_dict(config),
        target=target.name, draft=used.name if used is not None else None,
        devices={role: str(m.device) for role, m in roles.items()},
        dtypes={role: str(m.dtype).replace("torch.", "") for role, m in roles.items()},
        versions={"python": platform.python_version(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "specplay": _specplay_version()},
        seed=config.seed, chat=chat, eagle=eagle if config.uses_eagle else None)


# ---------------------------------------------------------------------------- records <-> dicts

def _to_json(value: Any) -> Any:
    """Dataclasses -> dicts, enums -> values, recursively (asdict would keep the enums)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def round_to_dict(record: RoundRecord) -> dict:
    """RoundRecord -> JSON-ready dict (nested dataclasses as dicts, Outcome as its string)."""
    return _to_json(record)


def summary_to_dict(summary: RunSummary) -> dict:
    """RunSummary -> strict-JSON dict: a NaN per-position rate (position never checked) becomes null."""
    out = _to_json(summary)
    out["per_position_acceptance"] = [None if math.isnan(r) else r for r in summary.per_position_acceptance]
    return out


def round_from_dict(data: dict) -> RoundRecord:
    """Validate a dict (as written by `round_to_dict`) and rebuild the RoundRecord. Raises TraceError."""
    record = _decode(RoundRecord, data, "round")
    _check_round(record)
    return record


def summary_from_dict(data: dict) -> RunSummary:
    """Validate a dict (as written by `summary_to_dict`) and rebuild the RunSummary. Raises TraceError."""
    return _decode(RunSummary, data, "summary")


def calibration_from_dict(data: Any) -> RCurve:
    """Validate a calibration line's data and rebuild the RCurve (its own checks apply). Raises TraceError."""
    try:
        return _decode(RCurve, data, "calibration")
    except ValueError as exc:
        if isinstance(exc, TraceError):
            raise
        raise TraceError(f"calibration: {exc}") from None


def _decode_rates(value: Any, where: str) -> list[float]:
    """per_position_acceptance: rates in [0, 1], null standing for NaN (a position never checked)."""
    rates = _decode(list[float | None], value, where)
    if any(r is not None and not 0.0 <= r <= 1.0 for r in rates):
        raise TraceError(f"{where}: acceptance rates must lie in [0, 1]")
    return [math.nan if r is None else r for r in rates]


# Fields whose JSON form needs more than their type hint says. Read-only mapping, not a registry.
_FIELD_DECODERS: types.MappingProxyType[tuple[type, str], Callable[[Any, str], Any]] = types.MappingProxyType(
    {(RunSummary, "per_position_acceptance"): _decode_rates})


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _decode(tp: Any, value: Any, where: str) -> Any:
    """Check `value` (parsed JSON) against type hint `tp` and build it. `where` names the field in errors."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(tp)):
            return None
        return _decode(options[0], value, where)
    if origin is list:
        return _decode_list(typing.get_args(tp)[0], value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise TraceError(f"{where}: expected an object, got {_type_name(value)}")
        return {k: _decode(typing.get_args(tp)[1], v, f"{where}.{k}") for k, v in value.items()}
    if is_dataclass(tp):
        return _decode_dataclass(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, Enum):
        allowed = [e.value for e in tp]
        if value not in allowed:
            raise TraceError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
        return tp(value)
    return _decode_scalar(tp, value, where)


def _decode_list(item: Any, value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise TraceError(f"{where}: expected a list, got {_type_name(value)}")
    if len(value) > MAX_LIST_LEN:
        raise TraceError(f"{where}: list of {len(value)} items exceeds the limit of {MAX_LIST_LEN}")
    return [_decode(item, v, f"{where}[{i}]") for i, v in enumerate(value)]


@cache
def _hints(cls: type) -> dict[str, Any]:
    # Records use postponed annotations; resolving them once per class keeps big traces fast.
    return typing.get_type_hints(cls)


def _decode_dataclass(cls: type, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise TraceError(f"{where}: expected an object, got {_type_name(value)}")
    hints = _hints(cls)
    names = [f.name for f in fields(cls)]
    missing = [n for n in names if n not in value]
    if missing:
        raise TraceError(f"{where}: missing key(s) {', '.join(missing)}")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {', '.join(unknown)}")
    kwargs = {}
    for name in names:
        decode = _FIELD_DECODERS.get((cls, name))
        sub = f"{where}.{name}"
        kwargs[name] = decode(value[name], sub) if decode else _decode(hints[name], value[name], sub)
    return cls(**kwargs)


def _decode_scalar(tp: Any, value: Any, where: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise TraceError(f"{where}: expected true or false, got {_type_name(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TraceError(f"{where}: expected an integer, got {_type_name(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TraceError(f"{where}: expected a number, got {_type_name(value)}")
        if not math.isfinite(value):
            raise TraceError(f"{where}: {value} is not a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TraceError(f"{where}: expected a string, got {_type_name(value)}")
        return value
    if tp is dict:  # an untyped dict field (the header's config): checked separately
        if not isinstance(value, dict):
            raise TraceError(f"{where}: expected an object, got {_type_name(value)}")
        return value
    raise TypeError(f"no decoder for {tp!r} at {where}")  # a new record field type: extend _decode


def _check_round(r: RoundRecord) -> None:
    """Cross-field sanity: the counts a renderer relies on agree with each other."""
    if not 0 <= r.k <= K_BOUND:
        raise TraceError(f"round.k: {r.k} is outside [0, {K_BOUND}]")
    if r.tree is not None:
        _check_tree(r)
    elif len(r.positions) != r.k:
        raise TraceError(f"round.positions: {len(r.positions)} positions for k={r.k}")
    if not 0 <= r.accepted <= r.k:
        raise TraceError(f"round.accepted: {r.accepted} is outside [0, k={r.k}]")
    if not 1 <= len(r.emitted) <= r.depth + 1:
        raise TraceError(f"round.emitted: {len(r.emitted)} tokens for k={r.k} (expected 1..{r.depth + 1})")
    if r.final.outcome not in (Outcome.CORRECTED, Outcome.BONUS):
        raise TraceError(f"round.final.outcome: {r.final.outcome.value!r} (expected corrected or bonus)")
    if min(r.emitted) < 0 or r.tokens_total < 0 or r.index < 0:
        raise TraceError("round: token ids, index and tokens_total must be non-negative")
    if any(p.outcome in (Outcome.CORRECTED, Outcome.BONUS, Outcome.PENDING) for p in r.positions):
        raise TraceError("round.positions: a draft's outcome must be accepted, rejected or unchecked")


def _upgrade_v1_round(data: Any) -> Any:
    """A version-1 round dict in version 2's shape. Version 1 marked a draft after the rejection as
    REJECTED with checked=false (now UNCHECKED), named no drafter "none" (now null), did not record
    who proposed a hybrid round (a hybrid round without draft forwards was a copy), and timed no
    single forward: its verify phase stands in for the target's forward, v1's commit phase for its
    commit forward, and each draft forward gets the round's draft time divided evenly, which is how
    version 1 read c."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    positions = []
    for p in data.get("positions") or []:
        if isinstance(p, dict):
            p = _with_pending(p)
            if p.pop("checked", True) is False:
                p["outcome"] = Outcome.UNCHECKED.value
        positions.append(p)
    data["positions"] = positions
    if isinstance(data.get("final"), dict):
        data["final"] = _with_pending(data["final"])
    data.setdefault("tree", None)   # version 1 drafted chains only
    if isinstance(data.get("kv"), list):
        data["kv"] = [{**kv, "moved": kv.get("moved", [])} if isinstance(kv, dict) else kv for kv in data["kv"]]
    drafter = None if data.get("drafter") == "none" else data.get("drafter")
    data["drafter"] = drafter
    copied = drafter == "ngram" or (drafter == "hybrid" and data.get("draft_forwards") == 0)
    data["proposer"] = None if not data.get("k") else ("ngram" if copied else "model")
    t, n = data.get("timings"), data.get("draft_forwards")
    if isinstance(t, dict) and isinstance(n, int) and not isinstance(n, bool):
        t = dict(t)
        t.setdefault("target_forward_ms", t.get("verify_ms", 0.0))
        draft_ms = t.get("draft_ms", 0.0)
        t.setdefault("commit_forward_ms", t.get("commit_ms", 0.0) if data.get("mode") == "v1" else 0.0)
        t.setdefault("draft_forward_ms", [draft_ms / n] * n if n > 0 and isinstance(draft_ms, (int, float)) else [])
        data["timings"] = t
    return data


def _check_tree(r: RoundRecord) -> None:
    """A tree round's nodes are numbered 1..k, each under an earlier node one depth up, and its path
    descends from the root through them."""
    nodes = r.tree.nodes
    if len(nodes) != r.k or [n.index for n in nodes] != list(range(1, r.k + 1)) or r.positions:
        raise TraceError(f"round.tree: {len(nodes)} nodes numbered 1..{len(nodes)} for k={r.k} and no positions")
    depth = {0: 0}
    for n in nodes:
        if not 0 <= n.parent < n.index or n.depth != depth[n.parent] + 1:
            raise TraceError(f"round.tree.nodes[{n.index}]: parent {n.parent} and depth {n.depth} do not make a tree")
        depth[n.index] = n.depth
    parent = 0
    for node in r.tree.path:
        if not 1 <= node <= r.k or nodes[node - 1].parent != parent:
            raise TraceError(f"round.tree.path: {r.tree.path} does not descend from the root")
        parent = node


def _with_pending(record: dict) -> dict:
    """Version 1 decoded each token alone and marked no unfinished bytes (engine.text): "" for each."""
    out = {**record, "pending": record.get("pending", "")}
    if isinstance(out.get("candidates"), list):
        out["candidates"] = [{**c, "pending": c.get("pending", "")} if isinstance(c, dict) else c
                             for c in out["candidates"]]
    return out


def header_from_dict(data: dict) -> TraceHeader:
    """Validate and build the header; the version must be one of READABLE_VERSIONS. Raises TraceError."""
    if isinstance(data, dict) and data.get("version") not in READABLE_VERSIONS:
        raise TraceError(f"trace version {data.get('version')!r} is not supported (this build reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))})")
    if isinstance(data, dict) and data.get("version") == 1:
        data = {"chat": None, "eagle": None, **data}   # version 1 had neither chat prompts nor EAGLE heads
    header = _decode(TraceHeader, data, "header")
    config_from_dict(header.config)
    return header


# ---------------------------------------------------------------------------- writing

class TraceWriter:
    """Appends a run to a JSON Lines file: the header at once, then rounds and summaries as they come.

    Every line is flushed as it is written (and fsynced with fsync=True), so a killed run leaves a
    file `load_trace` can read. Strict JSON: a non-finite number is a bug and raises ValueError.
    """

    def __init__(self, path: str | Path, header: TraceHeader, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._file = self.path.open("w", encoding="utf-8", newline="\n")
        self._write("header", None, _to_json(header))

    def write_round(self, record: RoundRecord, stream: str) -> None:
        """Append one round of `stream` ("spec" or "baseline")."""
        self._check_stream(stream)
        self._write("round", stream, round_to_dict(record))

    def write_summary(self, summary: RunSummary, stream: str) -> None:
        """Append the run summary of `stream`; the spec summary marks the trace complete."""
        self._check_stream(stream)
        self._write("summary", stream, summary_to_dict(summary))

    def write_calibration(self, curve: RCurve) -> None:
        """Append the target's measured r(n); the last one written is the one a replay uses."""
        self._write("calibration", None, _to_json(curve))

    def _check_stream(self, stream: str) -> None:
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, not {stream!r}")

    def _write(self, kind: str, stream: str | None, data: dict) -> None:
        if self._file is None:
            raise ValueError(f"trace {self.path} is closed")
        line = json.dumps({"type": kind, "stream": stream, "data": data}, allow_nan=False, ensure_ascii=False)
        self._file.write(line + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- loading

def _read_bytes(source: str | Path | bytes) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        if len(source) > MAX_TRACE_BYTES:
            raise TraceError(f"trace is {len(source):,} bytes, over the {MAX_TRACE_BYTES:,}-byte limit")
        return bytes(source)
    path = Path(source)
    try:
        size = path.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceError(f"{path} is {size:,} bytes, over the {MAX_TRACE_BYTES:,}-byte trace limit")
        with path.open("rb") as f:
            data = f.read(MAX_TRACE_BYTES + 1)  # the file may grow while we read it
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_TRACE_BYTES:
        raise TraceError(f"{path} is over the {MAX_TRACE_BYTES:,}-byte trace limit")
    return data


def _parse_lines(data: bytes) -> tuple[list[tuple[int, dict]], bool]:
    """(line number, parsed object) for each non-blank line, and whether a truncated last line was dropped.

    Only the last line may be cut short, and only if it has no newline: that is what an
    interrupted writer leaves. Any other unparsable line is an error.
    """
    raw = data.split(b"\n")
    out, truncated = [], False
    for number, line in enumerate(raw, start=1):
        if not line.strip():
            continue
        last_unterminated = number == len(raw)  # after the final "\n" the split leaves b""
        try:
            obj = json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, TraceError) as exc:
            if last_unterminated and not isinstance(exc, TraceError):
                truncated = True
                break
            raise TraceError(f"line {number}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"line {number}: expected a JSON object, got {_type_name(obj)}")
        out.append((number, obj))
    return out, truncated


def _reject_constant(name: str) -> None:
    raise TraceError(f"{name} is not allowed (numbers must be finite)")


def _line_fields(number: int, obj: dict) -> tuple[str, str | None, Any]:
    kind, stream = obj.get("type"), obj.get("stream")
    if kind not in LINE_TYPES:
        raise TraceError(f"line {number}: unknown line type {kind!r}; expected one of {', '.join(LINE_TYPES)}")
    if kind not in ("header", "calibration") and stream not in STREAMS:
        raise TraceError(f"line {number}: stream must be one of {', '.join(STREAMS)}, got {stream!r}")
    if "data" not in obj:
        raise TraceError(f"line {number}: missing key 'data'")
    return kind, stream, obj["data"]


def load_trace(source: str | Path | bytes) -> Trace:
    """Read and validate a trace from a path (str or Path) or the file's bytes.

    Raises TraceError (with the line number) for: files over MAX_TRACE_BYTES, lines that are not
    JSON objects, unknown line types or streams, a missing or repeated header, an unsupported
    version, and any record that fails validation. A truncated last line is dropped and the
    trace loads with complete=False; complete is True only if the spec summary is present.
    """
    lines, truncated = _parse_lines(_read_bytes(source))
    if not lines:
        raise TraceError("line 1: no complete header line (the file ends mid-line)" if truncated
                         else "the trace is empty: no header line")
    number, first = lines[0]
    if first.get("type") != "header":
        raise TraceError(f"line {number}: the first line must be the header, got type {first.get('type')!r}")
    header = _at_line(number, header_from_dict, _line_fields(number, first)[2])
    v1 = header.version == 1
    rounds: dict[str, list[RoundRecord]] = {s: [] for s in STREAMS}
    summaries: dict[str, RunSummary] = {}
    calibration = None
    for number, obj in lines[1:]:
        kind, stream, data = _line_fields(number, obj)
        if kind == "header":
            raise TraceError(f"line {number}: a second header; a trace holds one run")
        if kind == "calibration":
            calibration = _at_line(number, calibration_from_dict, data)
        elif kind == "round":
            rounds[stream].append(_at_line(number, round_from_dict, _upgrade_v1_round(data) if v1 else data))
        elif stream in summaries:
            raise TraceError(f"line {number}: a second {stream} summary")
        else:
            summaries[stream] = _summary_at(number, data, rounds[stream]) if v1 else \
                _at_line(number, summary_from_dict, data)
    return Trace(header, rounds["spec"], rounds["baseline"], summaries.get("spec"),
                 summaries.get("baseline"), complete="spec" in summaries, calibration=calibration)


def _summary_at(number: int, data: Any, rounds: list[RoundRecord]) -> RunSummary:
    """A version-1 summary, recomputed from its stream's rounds (version 1 had no alpha); the byte
    counts, which rounds do not hold, are kept."""
    from engine.metrics import summarize

    if not isinstance(data, dict) or not rounds:
        raise TraceError(f"line {number}: a summary with no rounds before it")
    weights = _at_line(number, lambda d: _decode(dict[str, int], d, "summary.weight_bytes"), data.get("weight_bytes"))
    kv = _at_line(number, lambda d: _decode(dict[str, int], d, "summary.kv_bytes"), data.get("kv_bytes"))
    return summarize(rounds, weights, kv)


def _at_line(number: int, build: Callable[[Any], Any], data: Any) -> Any:
    try:
        return build(data)
    except TraceError as exc:
        raise TraceError(f"line {number}: {exc}") from None


# ---------------------------------------------------------------------------- tables

ROUND_COLUMNS = ("index", "mode", "drafter", "proposer", "k", "accepted", "emitted", "emitted_text", "final_token",
                 "final_outcome", "prefill_ms", "draft_ms", "verify_ms", "commit_ms", "other_ms", "total_ms",
                 "target_forwards", "draft_forwards", "tokens_total", "elapsed_s", "finished")


def _round_row(r: RoundRecord) -> dict:
    t = r.timings
    return {"index": r.index, "mode": r.mode.value, "drafter": r.drafter.value if r.drafter else "none",
            "proposer": r.proposer.value if r.proposer else "", "k": r.k, "accepted": r.accepted,
            "emitted": len(r.emitted), "emitted_text": r.emitted_text, "final_token": r.final.token,
            "final_outcome": r.final.outcome.value, "prefill_ms": t.prefill_ms, "draft_ms": t.draft_ms,
            "verify_ms": t.verify_ms, "commit_ms": t.commit_ms, "other_ms": t.other_ms, "total_ms": t.total_ms,
            "target_forwards": r.target_forwards, "draft_forwards": r.draft_forwards,
            "tokens_total": r.tokens_total, "elapsed_s": r.elapsed_s, "finished": r.finished}


def rounds_dataframe(rounds: list[RoundRecord]):
    """One row per round, columns ROUND_COLUMNS ("emitted" is the count of tokens emitted that round).

    Returns a pandas.DataFrame (pandas is imported here, not at module import).
    """
    import pandas as pd

    return pd.DataFrame([_round_row(r) for r in rounds], columns=list(ROUND_COLUMNS))


def export_csv(rounds: list[RoundRecord], path: str | Path) -> Path:
    """Write `rounds_dataframe(rounds)` as CSV (no index column) and return the path."""
    path = Path(path)
    rounds_dataframe(rounds).to_csv(path, index=False)
    return path

"""Run traces as JSON Lines: a header, one line per round (spec and baseline streams), and summaries.

A trace is written while the run happens, one flushed line per event, so an interrupted run still
leaves a readable file: `load_trace` tolerates a truncated last line and reports complete=False.

Line format: {"type": "header" | "round" | "summary", "stream": "spec" | "baseline" | null,
"data": {...}}. The first line is the header. Loading never evaluates anything: the file is read
one line at a time, each line's nesting is bounded before `json.loads` parses it, and the result is
checked against the record dataclasses' own type hints (engine.typed_json: required and unknown keys,
types, Outcome values, finite numbers, bounded lists, ids that are not negative) before a record is
built. Files, rounds and nesting are bounded (MAX_TRACE_BYTES, MAX_ROUNDS, MAX_DEPTH), each with its
own message.
"""
from __future__ import annotations

import io
import json
import math
import os
import platform
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, is_dataclass
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import IO, Any

from engine import typed_json
from engine.calibration import RCurve
from engine.clock import machine_name
from engine.config import K_BOUND, SpecConfig, TreeSpec
from engine.models import LoadedModel
from engine.prompts import ChatPrompt
from engine.records import Outcome, RoundRecord, RunSummary
from engine.sampling import SamplingParams

TRACE_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)   # older traces are upgraded as they are read (see `_upgrade_round`)
# A maximal trace must load and replay in a few seconds on a small CPU (see tests/test_trace.py):
# about 16 MiB is some 2,500 rounds with candidates recorded, far more than a visitor's run.
MAX_TRACE_BYTES = 16 * 2**20
MAX_ROUNDS = 8192               # per stream: a 256-token run has at most 256 baseline rounds
MAX_DEPTH = 16                  # a round line nests 6 levels (line, round, positions, position, candidates, candidate)
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
    dtypes: dict[str, str]       # role -> dtype ("int8": the forward multiplies with int8 copies)
    versions: dict[str, str]     # python, torch, transformers, specplay
    seed: int
    chat: ChatPrompt | None = None   # the chat turn the prompt ids were templated from (None: raw text)
    eagle: str | None = None     # the EAGLE head the run drafted with, when it used one
    machine: str | None = None   # what it ran on (engine.clock.machine_name); None in traces before version 4
    layers: str | None = None    # where the target's layers ran: "C++", "Python" (LoadedModel.layers_in); None
                                 # for transformers' forward, and in traces before version 5
    codes: str | None = None     # what an fp32 target's products read its matrices from ("Q4_1 and Q8_0 codes",
                                 # LoadedModel.codes); None: the fp32 matrices themselves, or a trace before version 6


@dataclass(frozen=True)
class Trace:
    """A loaded trace. complete is True when the spec stream's summary was written."""

    header: TraceHeader
    config: SpecConfig                  # the header's config, parsed and checked once
    rounds: list[RoundRecord]
    baseline: list[RoundRecord]
    summary: RunSummary | None
    baseline_summary: RunSummary | None
    complete: bool
    calibration: RCurve | None = None   # the target's measured r(n), when the run had one


# ---------------------------------------------------------------------------- header

def config_to_dict(config: SpecConfig) -> dict:
    """SpecConfig -> JSON-ready dict: enums become their values, sampling and a tree nested dicts."""
    out = {f.name: getattr(config, f.name) for f in fields(config)}
    for name, value in out.items():
        if isinstance(value, Enum):
            out[name] = value.value
    out["sampling"] = asdict(config.sampling)
    if config.tree is not None:
        out["tree"] = {**asdict(config.tree), "widths": list(config.tree.widths)}
    return out


def config_from_dict(data: dict) -> SpecConfig:
    """Inverse of `config_to_dict`; SpecConfig's own validation applies. Raises TraceError."""
    if not isinstance(data, dict) or not isinstance(data.get("sampling"), dict):
        raise TraceError("config must be an object with a nested sampling object")
    try:
        sampling = SamplingParams(**data["sampling"])
        tree = data.get("tree")
        if tree is not None:
            if not isinstance(tree, dict):
                raise ValueError("tree must be an object")
            # traces written before calibrated growth existed grew their trees by raw q; older traces also
            # named the tree's verification rule, which was always the recursive one outside the lab
            tree = {k: v for k, v in tree.items() if k != "rule"}
            tree = TreeSpec(**{"calibrated": False, **tree, "widths": tuple(tree.get("widths", ()))})
        return SpecConfig(**{**data, "sampling": sampling, "tree": tree})
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
        dtypes={role: m.format for role, m in roles.items()},
        versions={"python": platform.python_version(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "specplay": _specplay_version()},
        seed=config.seed, chat=chat, eagle=eagle if config.uses_eagle else None, machine=machine_name(),
        layers=target.layers_in, codes=target.codes)


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
    return _decode(RCurve, data, "calibration")


def _decode_rates(value: Any) -> list[float]:
    """per_position_acceptance: rates in [0, 1], null standing for NaN (a position never checked)."""
    rates = typed_json.decoder(list[float | None])(value)
    if any(r is not None and not 0.0 <= r <= 1.0 for r in rates):
        raise typed_json.Invalid("acceptance rates must lie in [0, 1]")
    return [math.nan if r is None else r for r in rates]


# Fields whose JSON form needs more than their type hint says. Read-only mapping, not a registry.
_FIELD_DECODERS: types.MappingProxyType[tuple[type, str], Callable[[Any], Any]] = types.MappingProxyType(
    {(RunSummary, "per_position_acceptance"): _decode_rates})


def _decode(tp: Any, value: Any, where: str) -> Any:
    """Check `value` (parsed JSON) against type hint `tp` and build it. `where` names the field in errors."""
    try:
        return typed_json.decode(tp, value, where, _FIELD_DECODERS)
    except typed_json.Invalid as exc:
        raise TraceError(exc.at(where)) from None


def _check_round(r: RoundRecord) -> None:
    """Cross-field sanity: the counts a renderer relies on agree with each other, and ids are not negative."""
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
    if any(p.outcome in (Outcome.CORRECTED, Outcome.BONUS, Outcome.PENDING) for p in r.positions):
        raise TraceError("round.positions: a draft's outcome must be accepted, rejected or unchecked")
    for where, value in _counts_and_ids(r):
        if value < 0:
            raise TraceError(f"round.{where}: {value} is negative; token ids, indices, counts and KV slots "
                             "are integers >= 0")


def _counts_and_ids(r: RoundRecord) -> Iterator[tuple[str, int]]:
    """(field path, value) of every integer in a round that must not be negative."""
    yield from (("index", r.index), ("tokens_total", r.tokens_total), ("target_forwards", r.target_forwards),
                ("draft_forwards", r.draft_forwards), ("final.token", r.final.token), ("final.row", r.final.row))
    yield from ((f"emitted[{i}]", t) for i, t in enumerate(r.emitted))
    for i, p in enumerate(r.positions):
        yield f"positions[{i}].token", p.token
        yield from ((f"positions[{i}].candidates[{j}].token", c.token) for j, c in enumerate(p.candidates))
    yield from ((f"final.candidates[{j}].token", c.token) for j, c in enumerate(r.final.candidates))
    for i, kv in enumerate(r.kv):
        for name in ("block_table", "written", "rolled_back", "blocks_allocated", "blocks_freed"):
            yield from ((f"kv[{i}].{name}[{j}]", v) for j, v in enumerate(getattr(kv, name)))
        yield from ((f"kv[{i}].{name}", getattr(kv, name)) for name in ("block_size", "num_blocks", "length",
                                                                         "prompt_len", "pool_bytes"))


def _upgrade_round(data: Any, version: int) -> Any:
    """A round dict of an older version in this version's shape: version 2's tree nodes had no copies
    (trees were drafted by the model alone)."""
    if version == 1:
        data = _upgrade_v1_round(data)
    tree = data.get("tree") if isinstance(data, dict) else None
    if version < 3 and isinstance(tree, dict) and isinstance(tree.get("nodes"), list):
        nodes = [{"copied": False, **n} if isinstance(n, dict) else n for n in tree["nodes"]]
        data = {**data, "tree": {**tree, "nodes": nodes}}
    return data


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
    """Validate and build the header; the version must be one of READABLE_VERSIONS. Raises TraceError. Its
    config (JSON as written) is parsed once, by the reader, into Trace.config."""
    if isinstance(data, dict) and data.get("version") not in READABLE_VERSIONS:
        raise TraceError(f"trace version {data.get('version')!r} is not supported (this build reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))})")
    if isinstance(data, dict) and data.get("version") == 1:
        data = {"chat": None, "eagle": None, **data}   # version 1 had neither chat prompts nor EAGLE heads
    if isinstance(data, dict) and data.get("version") in (1, 2, 3):
        data = {"machine": None, **data}               # nor, before version 4, the machine's name
    if isinstance(data, dict) and data.get("version") in (1, 2, 3, 4):
        data = {"layers": None, **data}                # nor, before version 5, where the target's layers ran
    if isinstance(data, dict) and data.get("version") in (1, 2, 3, 4, 5):
        data = {"codes": None, **data}                 # nor, before version 6, whether products read codes
    header = _decode(TraceHeader, data, "header")
    negative = next((i for i, t in enumerate(header.prompt_ids) if t < 0), None)
    if negative is not None:
        raise TraceError(f"header.prompt_ids[{negative}]: {header.prompt_ids[negative]} is negative; token ids are "
                         "integers >= 0")
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

def _open(source: str | Path | bytes) -> IO[bytes]:
    """A binary reader over the trace, refused up front when it is already over MAX_TRACE_BYTES."""
    if isinstance(source, (bytes, bytearray)):
        if len(source) > MAX_TRACE_BYTES:
            raise TraceError(f"trace is {len(source):,} bytes, over the {MAX_TRACE_BYTES:,}-byte limit "
                             f"({_limit_hint()})")
        return io.BytesIO(source)
    path = Path(source)
    try:
        size = path.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceError(f"{path.name} is {size:,} bytes, over the {MAX_TRACE_BYTES:,}-byte trace limit "
                             f"({_limit_hint()})")
        return path.open("rb")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None


def _limit_hint() -> str:
    return f"about {MAX_ROUNDS:,} rounds; record fewer new tokens, or split the run"


def _lines(f: IO[bytes]) -> Iterator[tuple[int, dict | None]]:
    """(line number, parsed object) for each non-blank line, read one at a time; (number, None) for a
    truncated last line, which ends the file.

    Only the last line may be cut short, and only if it has no newline: that is what an interrupted
    writer leaves. Any other unparsable line is an error. The file may grow while it is read (a live
    run's trace), so the byte bound is checked as lines arrive too.
    """
    read = 0
    for number, line in enumerate(f, start=1):
        read += len(line)
        if read > MAX_TRACE_BYTES:
            raise TraceError(f"the trace is over the {MAX_TRACE_BYTES:,}-byte limit ({_limit_hint()})")
        if not line.strip():
            continue
        try:
            obj = _parse(line)
        except TraceError as exc:
            raise TraceError(f"line {number}: {exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if not line.endswith(b"\n"):
                yield number, None
                return
            if isinstance(exc, UnicodeDecodeError):
                raise TraceError(f"line {number}: byte {exc.start + 1} (0x{line[exc.start]:02x}) is not UTF-8; a "
                                 "trace is UTF-8 text, so this file was damaged or is not a trace") from None
            raise TraceError(f"line {number}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"line {number}: expected a JSON object, got {typed_json.type_name(obj)}")
        yield number, obj


_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def json_depth(line: bytes, limit: int) -> int:
    """How deeply arrays and objects nest in one JSON line, counted up to limit + 1 (C-speed byte operations:
    about 7 ms per MB). Escapes and then strings are cut out, leaving only the brackets between them, and
    each pass deletes every innermost [] or {} pair."""
    unescaped = line.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(unescaped.split(b'"')[0::2]).translate(None, _NOT_BRACKETS)
    depth = 0
    while brackets and depth <= limit:
        inner = _INNERMOST.sub(b"", brackets)   # one scan: a pair exposed by this pass waits for the next
        if inner == brackets:   # unbalanced: json.loads will say where
            break
        brackets, depth = inner, depth + 1
    return depth


def _parse(line: bytes) -> Any:
    """One line's JSON. Nesting is checked before parsing, so a hostile line cannot exhaust the stack."""
    if json_depth(line, MAX_DEPTH) > MAX_DEPTH:
        raise TraceError(_too_deep())
    try:
        return json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:   # unbalanced brackets escape the count above; the parser's own limit catches them
        raise TraceError(_too_deep()) from None


def _too_deep() -> str:
    return f"JSON nested more than {MAX_DEPTH} levels deep; a trace line nests at most {MAX_DEPTH}"


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
    """Read and validate a trace from a path (str or Path) or the file's bytes, one line at a time.

    Only the records are kept: each line is parsed, checked and built before the next is read, so a
    trace never sits in memory as text or parsed JSON beside its records. Raises TraceError (with the
    line number) for: files over MAX_TRACE_BYTES, a stream of more than MAX_ROUNDS rounds, JSON nested
    deeper than MAX_DEPTH, lines that are not JSON objects, unknown line types or streams, a missing or
    repeated header, an unsupported version, and any record that fails validation. A truncated last
    line is dropped and the trace loads with complete=False; complete is True only if the spec summary
    is present.
    """
    with _open(source) as f:
        return _read(_lines(f))


def _read(lines: Iterator[tuple[int, dict | None]]) -> Trace:
    start = next(lines, None)
    if start is None:
        raise TraceError("the trace is empty: no header line")
    number, first = start
    if first is None:
        raise TraceError(f"line {number}: no complete header line (the file ends mid-line)")
    if first.get("type") != "header":
        raise TraceError(f"line {number}: the first line must be the header, got type {first.get('type')!r}")
    header = _at_line(number, header_from_dict, _line_fields(number, first)[2])
    config = _at_line(number, config_from_dict, header.config)
    v1 = header.version == 1
    rounds: dict[str, list[RoundRecord]] = {s: [] for s in STREAMS}
    summaries: dict[str, RunSummary] = {}
    calibration = None
    for number, obj in lines:
        if obj is None:
            break
        kind, stream, data = _line_fields(number, obj)
        if kind == "header":
            raise TraceError(f"line {number}: a second header; a trace holds one run")
        if kind == "calibration":
            calibration = _at_line(number, calibration_from_dict, data)
        elif kind == "round":
            if len(rounds[stream]) >= MAX_ROUNDS:
                raise TraceError(f"line {number}: more than {MAX_ROUNDS:,} {stream} rounds; this build replays "
                                 f"at most {MAX_ROUNDS:,} per stream")
            rounds[stream].append(_at_line(number, round_from_dict, _upgrade_round(data, header.version)))
        elif stream in summaries:
            raise TraceError(f"line {number}: a second {stream} summary")
        else:
            summaries[stream] = _summary_at(number, data, rounds[stream]) if v1 else \
                _at_line(number, summary_from_dict, data)
    return Trace(header, config, rounds["spec"], rounds["baseline"], summaries.get("spec"),
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

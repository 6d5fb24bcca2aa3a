"""What the training commands (draft-data, train-eagle3, eval-eagle3) share: the command line a run records,
loading the target once, and refusing a device this machine lacks."""
from __future__ import annotations

import sys
import time

import torch

# options that change how long or how fast a run goes, not what it makes (a bf16 rebuild makes the same data to
# bf16 rounding, and each rebuilt shard's sidecar records it)
RUN_ONLY = ("--minutes", "--threads", "--rebuild-dtype", "--device")


RUN_ONLY_FLAGS = ("--answers-only",)   # the same, taking no value


def command_line(name: str, argv: list[str] | None) -> str:
    """`python -m engine <name> ...` as typed, less the options in RUN_ONLY and RUN_ONLY_FLAGS: the line that
    remakes the same data or head, however many resumed runs it took."""
    words, kept = list(sys.argv[1:] if argv is None else argv), []
    while words:
        word = words.pop(0)
        if word in RUN_ONLY:
            words[:1] = []
        elif word in RUN_ONLY_FLAGS:
            continue
        elif not word.startswith(tuple(o + "=" for o in RUN_ONLY)):
            kept.append(word)
    return " ".join(["python -m engine", name, *kept])


def command_start(source: str, threads: int | None, device: str = "cpu"):
    """What both data and training commands begin with: torch threads, a timestamped log on stderr, and the
    target loaded in float32 on `device` (None, with its sentence printed, when it cannot be)."""

    from engine.cli import quiet_transformers
    from engine.models import ModelLoadError, load_model

    if threads:
        torch.set_num_threads(threads)
    log = lambda m: print(time.strftime("%H:%M:%S"), m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        with quiet_transformers():
            return load_model(source, "target", device=device, dtype="float32"), log
    except ModelLoadError as exc:
        print(exc, file=sys.stderr)
        return None, log


def device_problem(spec: str) -> str | None:
    """Why `spec` names no device these commands can use here, or None."""
    from engine.cli import UsageError, check_device

    try:
        check_device(spec)
    except UsageError as exc:
        return str(exc)
    return None

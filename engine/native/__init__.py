"""C++ where calling from Python costs as much as the work: a target's decoder layers, and an EAGLE head's draft
step, as one call each.

A decoder layer is four matrix products and some 40 small ATen operations (norms, rotary, the cache write,
attention, residuals); called one by one from Python, the small ones cost about as much as int4's products. On
SmolLM2's int4 weights (AMD EPYC, 2 cores, one-row forwards at a 100-token context, both loops alternating in
one process) the 30 layers took 9.8-10.6 ms from Python and 6.1-6.4 ms from C++; a whole fp32 step about 34
against 29 ms. `layers.cpp` makes the Python forward's calls, with the same arguments in the same order, so its
results are that forward's bit for bit (tests/test_native.py); only who calls them changes. Users:
`engine.fused_llama.NativeLayers` (fp32 and int4 targets) and `engine.drafters.eagle.NativeEagleStep`.

Four files compute something of their own, and the Python forward calls the same functions, so both loops still
agree bit for bit:
- `coded.cpp`: fp32 products that read a matrix from the GGUF codes it was dequantized from
  (`engine.fused_llama.CodedWeights`, SmolLM2's fp32 target), and the int4 target's integer products, llama.cpp's
  arithmetic for a Q4_1 matrix and for its Q8_0 head (`Int4Weights`);
- `attention.cpp`: attention one query row at a time (`engine.fused_llama.rows_apart`; the int8 and int4
  targets', and fp32 models' on the CPU), every row of a forward in one call;
- `pointwise.cpp`: the norm, the MLP's gate and the rotary turn of float32 rows, one pass a row (even from C++,
  torch's CPU norm was six calls; at one row these steps took SmolLM2's int4 layers from 7.3 to 4.8 ms).

One more serves sampling and verification, not the layers: `nucleus.cpp`, top-p's processed distribution of float32
logits (`engine.sampling.logits_to_probs` at T > 0 with top-p alone), in place of some fifteen ATen calls a row;
inverse-CDF sampling (`sample_many`), the same float64 running sums as torch's cumsum over the positive tokens only;
and a chain's verdict (`engine.verify.verify`: the accept tests, the residual and its draw), in place of some twenty.

It is compiled once per machine and torch version with torch's extension builder (a C++ compiler and ninja;
about a minute on two cores) into the cache folder, the first time a model that uses it loads (`python -m
engine.native` builds it ahead). Without a compiler, or with SPECPLAY_NATIVE=0, the Python loop runs and
`reason()` says why.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCES = [Path(__file__).with_name(name)
           for name in ("layers.cpp", "coded.cpp", "attention.cpp", "pointwise.cpp", "nucleus.cpp")]
NAME = "specplay_layers"
STALE_LOCK_S = 600     # a build lock older than this was left by a build that died
_lock = threading.Lock()
_built: dict[str, ModuleType | str] = {}     # "module": the compiled module, or "reason": why there is none


def build_folder() -> Path:
    """Where the compiled module lives: per torch version and Python, under the cache folder."""
    from engine.sources import cache_root
    return cache_root() / "native" / f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"


def layers() -> ModuleType | None:
    """The compiled module (`int4_layers`, `eagle_step`), building it on first use; None when it cannot be had
    (`reason()` says why). One build per process, whichever thread asks first."""
    if os.environ.get("SPECPLAY_NATIVE", "").strip() == "0":
        return None
    with _lock:
        if not _built:
            _built.update(_build())
    module = _built.get("module")
    return module if isinstance(module, ModuleType) else None


def reason() -> str | None:
    """Why the int4 layers run in Python, or None when the compiled loop serves them (or was not asked for yet)."""
    if os.environ.get("SPECPLAY_NATIVE", "").strip() == "0":
        return "SPECPLAY_NATIVE=0"
    why = _built.get("reason")
    return why if isinstance(why, str) else None


def _build() -> dict[str, ModuleType | str]:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return {"reason": "this torch build has no packed int4 CPU kernel"}
    try:
        from torch.utils.cpp_extension import load, verify_ninja_availability
        verify_ninja_availability()
    except Exception as exc:   # no ninja: torch's builder needs it
        return {"reason": f"torch's extension builder is not usable here ({_first_line(exc)})"}
    folder = build_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(folder)
        if not any(folder.glob(f"{NAME}*.so")):
            print(f"specplay: compiling the C++ layer loops into {folder} (once, about a minute)", file=sys.stderr,
                  flush=True)
        # -fopenmp: torch's threads share out coded.cpp's products (torch's own OpenMP runtime serves them); a
        # compiler without OpenMP builds it again without (those products then run on one thread).
        # -ffp-contract=off: coded.cpp rebuilds weights with two roundings, as the file's reader does
        for openmp in (["-fopenmp"], []):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")     # the builder warns about compiler versions it has not seen
                    module = load(NAME, [str(s) for s in SOURCES], build_directory=str(folder),
                                  extra_cflags=["-O3", "-ffp-contract=off", *openmp], extra_ldflags=openmp,
                                  verbose=False)
                break
            except Exception as exc:   # no compiler, headers missing, a failed build: the Python loop serves
                failure = exc
        else:
            return {"reason": f"the C++ layers did not build ({_first_line(failure)})"}
    except OSError as exc:   # the cache folder cannot be made
        return {"reason": f"the C++ layers did not build ({_first_line(exc)})"}
    return {"module": module}


def _clear_stale_lock(folder: Path) -> None:
    """torch's builder holds a `lock` file while it compiles and waits for any it finds; a build killed half way
    (Ctrl-C during the first start) leaves one behind, which would make every later start wait forever. A build
    takes well under STALE_LOCK_S, so an older lock is a dead one's."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except OSError:     # no lock, or another process removed it first
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__

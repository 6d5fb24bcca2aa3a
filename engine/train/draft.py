"""`python -m engine train-draft --target smollm2|builtin`: rebuild a target's EAGLE head from scratch.

Phases, each resumable (rerun the command to continue where it stopped):
1. data: the target answers the training prompts (chat targets: the templated chat prompts of
   engine.train.chat_prompts, greedily and sampled; the built-in pair: windows of the standard
   library's training split, continued), and its post-norm features are kept (engine.train.draft_data);
2. training: engine.train.eagle, checkpointed every couple of minutes;
3. evaluation: the real engine with the new head on held-out prompts (chat: the 16 held-out chat
   prompts; built-in: held-out stdlib windows), greedy, K = 4: alpha at each position, tokens per
   round and c; then the model card.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from engine.sources import BUILTIN, REPO_ROOT, SMOLLM2, eagle_folder

WORK = REPO_ROOT / ".cache" / "train-draft"


@dataclass(frozen=True, slots=True)
class DraftEval:
    """The head measured by the engine on held-out prompts (greedy, constant K)."""

    prompts: int
    new_tokens: int
    k: int
    alpha: float                  # accepted / verified positions
    draft_acceptance: float       # accepted / drafted
    position_rates: list[float]
    tokens_per_round: float
    c: float                      # median head forward / median target decode step, the engine's clock
    draft_ms: float
    target_ms: float
    temperature: float = 0.0      # 0: greedy
    tokens_per_s: float | None = None          # the head's run, prompts one after another
    target_tokens_per_s: float | None = None   # target-only on the same prompts, run beside it
    matrices: str = ""            # how the head's draft steps multiplied (EagleRuntime.matrices)
    per_prompt: list[tuple[int, int]] = field(default_factory=list)   # (accepted, verified) by prompt, in order


def training_prompts(target, source: str, count: int | None = None) -> list[list[int]]:
    """Tokenized training prompts: chat turns for a chat target, code windows for the built-in pair."""
    from engine.prompts import ChatPrompt, encode_chat, has_chat_template

    if has_chat_template(target.tokenizer):
        from engine.train.chat_prompts import training_prompts as chat

        prompts = chat()
        return [encode_chat(target.tokenizer, ChatPrompt(p)) for p in prompts[:count]]
    from engine.train.corpus import list_sources

    ids = []
    for f in list_sources("train"):
        ids.extend(target.tokenizer(f.text, add_special_tokens=False)["input_ids"])
        ids.append(target.tokenizer.eos_token_id)
    g = torch.Generator().manual_seed(17)
    starts = torch.randint(0, len(ids) - 200, (count or 3000,), generator=g).tolist()
    lengths = torch.randint(48, 160, (len(starts),), generator=g).tolist()
    return [ids[s: s + n] for s, n in zip(starts, lengths)]


def heldout_prompts(target) -> list[list[int]]:
    """The prompts acceptance is reported on: never used in training."""
    from engine.prompts import ChatPrompt, encode_chat, has_chat_template

    if has_chat_template(target.tokenizer):
        from engine.train.chat_prompts import chat_prompts

        return [encode_chat(target.tokenizer, ChatPrompt(p)) for p in chat_prompts("heldout")]
    from engine.train.builtin_eval import heldout_windows

    return [w.tolist() for w in heldout_windows(16, 128, seed=99)]


def evaluate(target, folder: Path, k: int = 4, new_tokens: int = 64, prompts: list[list[int]] | None = None,
             sampling=None, seed: int = 0, drafter=None) -> DraftEval:
    """Run the engine with the head in `folder` on the held-out prompts (or `prompts`) and measure what it did,
    greedy (or with `sampling`, prompt i seeded seed + i), target-only decoded beside it prompt by prompt.
    `drafter`: DrafterKind.EAGLE (the default) or another that uses the head (EAGLE_HYBRID)."""
    from engine import metrics
    from engine.config import DrafterKind, Mode, SpecConfig
    from engine.drafters.eagle import load_runtime
    from engine.pair import ModelPair
    from engine.speculative import SpeculativeEngine

    runtime = load_runtime(folder, target)
    pair = ModelPair(target, None, runtime)
    # stop at the end of the turn, as in use: the training answers end there, and what a target writes
    # past its EOS is text no head was trained on
    from engine.sampling import SamplingParams

    sampling = sampling or SamplingParams()
    config = SpecConfig(drafter=drafter or DrafterKind.EAGLE, k=k, max_new_tokens=new_tokens, record=False,
                        sampling=sampling)
    rounds, baseline, per_prompt = [], [], []
    tokens, seconds = {Mode.V2: 0, Mode.TARGET: 0}, {Mode.V2: 0.0, Mode.TARGET: 0.0}
    prompts = prompts if prompts is not None else heldout_prompts(target)
    for i, ids in enumerate(prompts):
        for mode, out in ((Mode.V2, rounds), (Mode.TARGET, baseline)):
            engine = SpeculativeEngine(pair, ids, replace(config, mode=mode, seed=seed + i))
            done = engine.run()
            engine.close()
            out += done
            if mode is Mode.V2:
                per_prompt.append(metrics.prompt_counts(done))
            if done:
                tokens[mode] += done[-1].tokens_total
                seconds[mode] += done[-1].elapsed_s
    drafted = metrics.drafted_rounds(rounds)
    step = metrics.target_step_ms(baseline)
    draft = metrics.draft_forward_ms(rounds)
    return DraftEval(len(prompts), new_tokens, k, metrics.alpha(drafted), metrics.draft_acceptance(drafted),
                     metrics.position_rates(drafted), sum(len(r.emitted) for r in drafted) / len(drafted),
                     draft / step, draft, step, sampling.temperature,
                     tokens[Mode.V2] / seconds[Mode.V2] if seconds[Mode.V2] else None,
                     tokens[Mode.TARGET] / seconds[Mode.TARGET] if seconds[Mode.TARGET] else None, runtime.matrices,
                     per_prompt)


def write_card(folder: Path, target_source: str, figures: DraftEval, meta: dict) -> None:
    plan = meta.get("plan", {})
    rates = ", ".join(f"{r:.2f}" for r in figures.position_rates)
    card = f"""# EAGLE-style head for `{target_source}`

One decoder layer ({meta.get('params', 0):,} parameters of its own) that drafts from the target's
post-norm features, with the target's embeddings and a {meta.get('kept')}-token slice of its LM head
reused at load time. Rebuild from scratch: `python -m engine train-draft --target {target_source}`.

## Data
- {meta.get('sequences')} sequences, {meta.get('tokens'):,} tokens (prompts and the target's own answers:
  greedy and sampled at T = 0.7, top-p 0.95), {meta.get('train_sequences')} used for training.
- The held-out prompts acceptance is reported on were never used.

## Training
- {meta.get('steps')} optimiser steps, {plan.get('accumulate')} sequences each ({plan.get('epochs')} epochs),
  AdamW lr {plan.get('lr')} with warm-up and cosine decay; training-time test over {plan.get('depth')} steps;
  soft cross-entropy against the target's distribution over the kept vocabulary plus
  {plan.get('feature_weight')} x smooth-L1 on the first step's feature.
- Held-out loss (training distribution): {meta.get('heldout_loss', float('nan')):.3f}; top-1 agreement with the
  target by unrolled step: {', '.join(f'{a:.2f}' for a in meta.get('heldout_top1_by_step', []))}.

## Measured by the engine ({figures.prompts} held-out prompts, greedy, K = {figures.k}, up to {figures.new_tokens} new tokens, to the end of the turn)
- per-position acceptance α = accepted / verified positions: **{figures.alpha:.3f}**
  (draft acceptance rate, accepted / drafted: {figures.draft_acceptance:.3f})
- α at positions 1..{figures.k}: {rates}
- tokens per drafting round: {figures.tokens_per_round:.2f}
- c = head forward / target decode step: **{figures.c:.3f}** ({figures.draft_ms:.2f} ms / {figures.target_ms:.2f} ms)
"""
    (folder / "MODEL_CARD.md").write_text(card)
    (folder / "card.json").write_text(json.dumps({"eval": asdict(figures), **{k: v for k, v in meta.items()
                                                                               if k != "log"}}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    from engine.cli import quiet_transformers
    from engine.models import load_model
    from engine.train.draft_data import DataPlan, SamplingPass, build
    from engine.train.eagle import EaglePlan, train

    ap = argparse.ArgumentParser(prog="python -m engine train-draft", description=__doc__.split("\n")[0])
    ap.add_argument("--target", choices=(SMOLLM2, BUILTIN), default=SMOLLM2)
    ap.add_argument("--prompts", type=int, default=None, help="training prompts to use (default: all)")
    ap.add_argument("--batch", type=int, default=64, help="sequences generated at once (default: 64)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="answer length cap (default: 192 for chat targets; 96 for the built-in pair, trained on "
                         "256-token windows)")
    ap.add_argument("--epochs", type=float, default=EaglePlan().epochs, help="passes over the training data")
    ap.add_argument("--kept", type=int, default=None, help="pruned vocabulary (default: 8192, or the whole "
                                                             "vocabulary when smaller)")
    ap.add_argument("--minutes", type=float, default=None, help="stop (resumably) after this many minutes")
    ap.add_argument("--skip-data", action="store_true",
                    help="train on the shards generated so far instead of generating the missing ones first")
    ap.add_argument("--data-only", action="store_true", help="stop after generating the data")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--eval-only", action="store_true",
                    help="re-measure the trained head with the engine and rewrite its card; no data, no training")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    deadline = time.time() + a.minutes * 60 if a.minutes else None
    log = lambda m: print(time.strftime("%H:%M:%S"), m, file=sys.stderr, flush=True)  # noqa: E731
    work = WORK / a.target
    with quiet_transformers():
        target = load_model(a.target, "target")
    if not a.skip_data and not a.eval_only:
        log(f"target {target.name}: generating training data under {work / 'data'}")
        prompts = training_prompts(target, a.target, a.prompts)
        new = a.max_new_tokens or (96 if a.target == BUILTIN else 192)
        plan = DataPlan((SamplingPass(), SamplingPass(0.7, 0.95)), a.batch, new)
        tokens = build(target.model, target.tokenizer, prompts, plan, work / "data", target.tokenizer.eos_token_id,
                       log=log, deadline=deadline)
        if deadline is not None and time.time() > deadline:
            log(f"data: {tokens:,} tokens so far; rerun to continue")
            return 0
        if a.data_only:
            log(f"data: {tokens:,} tokens")
            return 0
    kept = a.kept or min(8192, target.vocab_size)
    if not a.eval_only:
        result = train(target, work / "data", work / "train", eagle_folder(a.target),
                       EaglePlan(kept=kept, epochs=a.epochs), log=log, deadline=deadline)
        if not result["finished"]:
            return 0
    if a.skip_eval:
        return 0
    log("evaluating the head with the engine on the held-out prompts")
    figures = evaluate(target, eagle_folder(a.target))
    meta = json.loads((eagle_folder(a.target) / "eagle.json").read_text())["meta"]
    write_card(eagle_folder(a.target), a.target, figures, meta)
    log(f"alpha {figures.alpha:.3f} (by position {', '.join(f'{r:.2f}' for r in figures.position_rates)}), "
        f"{figures.tokens_per_round:.2f} tokens/round, c {figures.c:.3f}")
    print(json.dumps(asdict(figures), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

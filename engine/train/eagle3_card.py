"""An EAGLE-3-style head's model card (MODEL_CARD.md and card.json): its data, training, lineage and what the
engine measured, and the lines that set two heads side by side, prompt for prompt."""
from __future__ import annotations

import json
from pathlib import Path


def the_layers(layers: list[int], count: int | None) -> str:
    """What the fused layers are, in words: the residual stream entering each, or the post-norm output."""
    if count in layers:
        return f"the residual stream entering the first ones; {count}, past the last layer, is the post-norm output"
    return "the residual stream entering them"


def loss_words(plan: dict) -> str:
    """The training loss in words, for the card (older heads' plans have no feature loss or noise)."""
    words = "soft-label cross-entropy"
    if plan.get("feature_weight"):
        words += f" plus {plan['feature_weight']} × smooth-L1 of step 1's feature against the target's post-norm one"
    else:
        words += " only, no feature loss"
    if plan.get("noise"):
        words += f"; Gaussian noise of {plan['noise']} of their std on the real features"
    return words


def heldout_curve(points: list[dict]) -> list[str]:
    """The card's line on how step 1's held-out agreement moved during training (nothing for one point)."""
    if len(points) < 2:
        return []
    best = max(points, key=lambda p: p["top1"][0])
    return ["- step 1's held-out top-1 during training (step: agreement): "
            + ", ".join(f"{p['step']:,}: {p['top1'][0]:.3f}" for p in points)
            + f"; highest at step {best['step']:,}"]


def folder_lines(folders: list[dict]) -> list[str]:
    """One line a data folder, where the data came from more than one."""
    if len(folders) < 2:
        return []
    return [f"  - `{f['folder']}` (seed {f['plan']['seed']}"
            + (", steered" if f["plan"].get("openers") else "")
            + (f"; replayed: a {f['replay']:.0%} sample of its shards" if "replay" in f else "")
            + f"): {f['tokens']:,} tokens in {f['shards']} training "
            f"shards; prompts: {f['prompt_sources']['magpie']:,} self-written, {f['prompt_sources']['written']:,} "
            "written" for f in folders]


def lineage_lines(init: dict | None, depth: int = 0) -> list[str]:
    """The heads a warm start began from, one line each, the nearest first."""
    if not init:
        return []
    pad = "  " * depth
    return [f"{pad}- started from the head in `{init['folder']}`, not at random: itself {init['steps']:,} steps over "
            f"{init['sequences']:,} sequences ({init['tokens']:,} tokens), {init['train_seconds'] / 3600:.2f} h of "
            f"training, held-out loss {init['heldout_loss']:.3f}", *lineage_lines(init.get("init"), depth + 1)]


def lineage_commands(init: dict | None) -> list[str]:
    """The commands behind a warm start's starting points, the oldest first."""
    return lineage_commands(init.get("init")) + list(init["commands"]) if init else []


def init_lineage(folder: Path) -> dict | None:
    """What the card of the head in `folder` says it was trained on, for the card of a head started from it:
    its tokens, sequences, steps, training time and commands, and its own starting point's (None when the
    folder holds no readable card)."""
    try:
        card = json.loads((folder / "card.json").read_text())
        figures = {k: card[k] for k in ("tokens", "sequences", "steps", "train_seconds", "heldout_loss")}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    commands = card.get("commands") or [f["command"] for f in card.get("data_folders", []) if "command" in f]
    return {"folder": str(folder), **figures, "commands": commands, "init": card.get("init")}


def write_card(folder: Path, target_source: str, meta: dict, evals: dict, command: str, wall_s: float | None) -> None:
    """The model card: data, training, losses, acceptance by position (measured by the engine), time, commands.
    `wall_s`: the training command's own time, measurements included (None: the head was measured afterwards, by
    `eval-eagle3 --card`)."""
    plan, src = meta["plan"], meta["prompt_sources"]
    lm_head = (f"its own LM head over a {meta['kept']}-token vocabulary" if plan.get("own_head", True) else
               f"the target's LM-head rows for a {meta['kept']}-token vocabulary, frozen")
    if meta.get("context_cover"):
        lm_head += " (and for each sequence's tokens outside it, trained to draft them as the engine does)"
    lines = [f"# EAGLE-3-style head for `{target_source}`", "",
             f"One decoder layer that drafts from a fusion of the target's layers {meta['feature_layers']} "
             f"({the_layers(meta['feature_layers'], meta.get('target_layers'))})"
             f"{', each RMS-normalised first' if plan.get('feature_norm') else ''}, through {lm_head}; "
             f"{meta['params']:,} parameters of its own "
             "(the target's embeddings are reused at load time).", "",
             "## Data (`python -m engine draft-data`)",
             f"- prompts: {src['magpie']:,} written by the target itself (Magpie: sampled from its chat template's "
             f"user header), {src['written']:,} of the project's written prompts; {src['magpie_heldout']:,} Magpie "
             "prompts held out and never trained on",
             f"- {meta['sequences']:,} sequences, {meta['tokens']:,} tokens in {meta['shards']} shards (answers greedy and "
             f"sampled at T = 0.7, top-p 0.95; soft labels: the target's top-{meta['data_plan']['top_k']}); "
             f"shard {meta['heldout_shard']} kept for the held-out loss",
             *folder_lines(meta.get("data_folders", [])), "",
             "## Training (`python -m engine train-eagle3`)",
             *(lineage_lines(meta["init"]) if meta.get("init") else
               [f"- started from the head in `{plan['init']}`, not at random"] if plan.get("init") else []),
             f"- {meta['steps']:,} AdamW steps of {plan['batch']} sequences ({plan['epochs']} epochs), lr {plan['lr']} "
             f"with warm-up and cosine decay; training-time test over {plan['depth']} steps (step weights "
             f"{plan['step_decay']}^(s-1)); {loss_words(plan)}; bf16 autocast: {plan['bf16']}",
             *([f"- the schedule fitted to the time limit (`--fit`): {meta['fitted']['steps']:,} steps of the "
                f"{meta['fitted']['planned']:,} that {plan['epochs']} epochs take"] if meta.get("fitted") else []),
             *([f"- stopped by its time limit at step {meta['stopped']['step']:,} of {meta['stopped']['of']:,} and "
                "exported as it stood (`--export-when-stopped`); rerunning its command finishes the schedule"]
               if meta.get("stopped") else []),
             f"- held-out loss {meta['heldout_loss']:.3f}; top-1 agreement with the target by unrolled step: "
             + ", ".join(f"{a:.2f}" for a in meta["heldout_top1_by_step"]),
             *heldout_curve(meta.get("heldout_log", [])),
             f"- training time, every resumed run of the command included: "
             f"{meta.get('train_seconds', wall_s or 0.0) / 3600:.2f} h; "
             + (f"this run, its measurements included: {wall_s / 3600:.2f} h" if wall_s is not None else
                "measured afterwards (`python -m engine eval-eagle3 --card`)"), ""]
    from engine.metrics import alpha_interval

    for name, e in evals.items():
        how = "greedy" if not e.get("temperature") else f"T = {e['temperature']:g}"
        spread = ""
        if e.get("per_prompt"):
            _, lo, hi = alpha_interval(e["per_prompt"])
            spread = f" (95% interval over prompts {lo:.3f} to {hi:.3f})"
        speed = ""
        if e.get("tokens_per_s") and e.get("target_tokens_per_s"):
            speed = (f"; {e['tokens_per_s']:.1f} tok/s against target-only {e['target_tokens_per_s']:.1f}, decoded "
                     f"beside it prompt by prompt: **{e['tokens_per_s'] / e['target_tokens_per_s']:.2f}×**")
        lines += [f"## Measured by the engine: {name} ({e['prompts']} prompts, {how}, K = {e['k']}, up to "
                  f"{e['new_tokens']} new tokens)",
                  f"- per-position acceptance α: **{e['alpha']:.3f}**{spread}; at positions 1..{e['k']}: "
                  + ", ".join(f"{r:.2f}" for r in e["position_rates"]),
                  f"- tokens per round: {e['tokens_per_round']:.2f}; c = {e['c']:.3f}{speed}"
                  + (f"; the head drafted with {e['matrices']}" if e.get("matrices") else ""), ""]
    paired = differences(["this head", "today's head"],
                         [key[len("this head: "):] for key in evals if key.startswith("this head: ")], evals)
    if paired:
        lines += ["## This head against today's head, prompt for prompt", *(f"- {text}" for text in paired), ""]
    data_lines = [f["command"] for f in meta.get("data_folders", [])] or ["python -m engine draft-data --target "
                                                                           + target_source]
    earlier = lineage_commands(meta.get("init"))
    commands = list(dict.fromkeys([*earlier, *data_lines, command]))   # once each, in the order they ran
    lines += ["## Commands", "```", *commands, "```", ""]
    (folder / "MODEL_CARD.md").write_text("\n".join(lines))
    (folder / "card.json").write_text(json.dumps({"eval": evals, **{k: v for k, v in meta.items() if k != "log"},
                                                  "commands": commands}, indent=1) + "\n")


def differences(names: list[str], measured: list[str], evals: dict) -> list[str]:
    """For two heads measured on the same prompts (evaluate_sets: keys "<head>: <what was measured>"): a line for
    each of `measured` that both have counts by prompt for, saying whether their alpha differs by more than the
    prompts' chance: the difference and its paired bootstrap interval (engine.metrics.alpha_interval)."""
    from engine.metrics import alpha_interval

    out = []
    for what in measured if len(names) == 2 else []:
        mine, other = (evals.get(f"{name}: {what}", {}).get("per_prompt") for name in names)
        if mine and other:
            d, lo, hi = alpha_interval(mine, other)
            verdict = "more than chance" if lo > 0 or hi < 0 else "within chance"
            out.append(f"{names[0]} - {names[1]}: {what}: alpha {d:+.3f} (95% over prompts, paired: "
                       f"{lo:+.3f} to {hi:+.3f}; {verdict})")
    return out

"""Measuring an EAGLE-3 head by the kind of prompt it drafts for: `python -m engine eval-eagle3`.

A head's acceptance depends on what the target is asked. The held-out chat prompts the project wrote
(`engine.train.chat_prompts`, "heldout", "fresh" and "wide") are ordinary questions on subjects no training prompt
touches; the self-written (Magpie) prompts of a data pack are the target's own, often odd, user turns. Each
pack keeps some of those out of training (its "heldout" list); its "train" list is what a head trained on it
saw. This command runs the engine with a head (and, with --against, a second head on the same prompts in the
same process) over each kind, greedy or sampled, and prints per-position acceptance, tokens per round and the
speed against target-only decoded beside it, one line per kind, so that a figure is always read with the
prompts it came from; with its interval over prompts (a percentile bootstrap), and with --against, the two
heads' difference on each kind with its paired interval, so that a gain is not read off chance.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.models import LoadedModel
from engine.train.eagle3_card import differences, write_card


@dataclass(frozen=True)
class PromptSet:
    name: str                              # what a reader needs to know about the prompts
    prompts: list[list[int]] | None        # token ids; None: the engine's own held-out chat prompts


def chat_sets(target: LoadedModel) -> list[PromptSet]:
    """The project's written chat prompts: the 16 held-out ones, the 12 written after the data and the 48 on
    held-out subjects written after every pack."""
    from engine.prompts import ChatPrompt, encode_chat
    from engine.train.chat_prompts import chat_prompts

    fresh, wide = ([encode_chat(target.tokenizer, ChatPrompt(p)) for p in chat_prompts(which)]
                   for which in ("fresh", "wide"))
    return [PromptSet("the 16 held-out chat prompts", None),
            PromptSet(f"the {len(fresh)} fresh chat prompts (written after the data)", fresh),
            PromptSet(f"the {len(wide)} wide held-out chat prompts", wide)]


def pack_sets(target: LoadedModel, packs: list[Path], per_set: int, trained_too: bool) -> list[PromptSet]:
    """For each data folder or pack: the first `per_set` of its held-out self-written prompts, and (with
    `trained_too`) the first `per_set` of the prompts a head trained on it saw."""
    from engine.prompts import ChatPrompt, encode_chat
    from engine.train.eagle3_folder import read_prompts

    sets = []
    for pack in packs:
        frozen = read_prompts(pack)
        kinds = [("heldout", "held-out self-written")] + ([("train", "trained-on")] if trained_too else [])
        for key, words in kinds:
            texts = frozen[key][:per_set]
            if texts:
                sets.append(PromptSet(f"{len(texts)} {words} prompts of {pack.name}",
                                      [encode_chat(target.tokenizer, ChatPrompt(p)) for p in texts]))
    return sets


def evaluate_sets(target: LoadedModel, heads: list[tuple[str, Path]], sets: list[PromptSet], log,
                  sampling=None, k: int = 4, new_tokens: int = 64) -> dict:
    """Each head on each set, in this process: the engine's measure (engine.train.draft.evaluate), keyed by
    "<head's name>: <set's name>" (", T = ..." added when sampled)."""
    from engine.train.draft import evaluate

    how = sampled(sampling)
    evals = {}
    for s in sets:
        for name, folder in heads:
            key = f"{name}: {s.name}{how}"
            t0 = time.time()
            evals[key] = asdict(evaluate(target, folder, k=k, new_tokens=new_tokens, prompts=s.prompts,
                                         sampling=sampling))
            log(f"{line(key, evals[key])} ({time.time() - t0:.0f} s)")
        for text in differences([name for name, _ in heads], [s.name + how], evals):
            log(text)
    return evals


def sampled(sampling) -> str:
    """What a measure's key adds when it was sampled: ", T = ..., top-p ..."; nothing when greedy."""
    return "" if sampling is None or sampling.temperature == 0 else \
        f", T = {sampling.temperature:g}, top-p {sampling.top_p:g}"


def evaluate_heads(target: LoadedModel, head: Path, today: Path | None, heldout: list[str], log,
                   quick: bool = False) -> dict:
    """The trainer's measure of a new head (and of today's head in `today`, on the same prompts, in the same
    process): greedy on the 16 held-out chat prompts, on 32 of its data's held-out Magpie prompts, on the 12
    fresh and on the 48 wide chat prompts, and at T = 0.7, top-p 0.95 on the held-out chat prompts; `quick`: the
    three chat sets, greedy, only."""
    from engine.prompts import ChatPrompt, encode_chat
    from engine.sampling import SamplingParams

    chat, fresh, wide = chat_sets(target)
    magpie = [encode_chat(target.tokenizer, ChatPrompt(p)) for p in heldout[:32]]
    heads = [("this head", head)] + ([("today's head", today)] if today is not None and today.is_dir() else [])
    if quick:
        return evaluate_sets(target, heads, [chat, fresh, wide], log)
    return {**evaluate_sets(target, heads, [chat, PromptSet(f"{len(magpie)} held-out Magpie prompts", magpie),
                                            fresh, wide], log),
            **evaluate_sets(target, heads, [chat], log, SamplingParams(temperature=0.7, top_p=0.95))}


def trained_heldout(meta: dict, target_name: str) -> list[str]:
    """The held-out self-written prompts of every data folder a head's meta names, in its order: read from the
    folder where it is on this machine, else from the pack its command names (a head trained on another machine,
    whose folders were rebuilt there from the packs); DataError when neither is here."""
    import shlex

    from engine.sources import REPO_ROOT
    from engine.train.data_pack import pack_folder
    from engine.train.eagle3_folder import read_prompts

    prompts = []
    for entry in meta.get("data_folders", []):
        folder = Path(entry["folder"])
        if not (folder / "prompts.json").exists():
            words = shlex.split(entry.get("command", ""))
            folder = Path(words[words.index("--pack") + 1]) if "--pack" in words[:-1] else pack_folder(target_name)
            folder = folder if folder.is_absolute() else REPO_ROOT / folder
        prompts += read_prompts(folder)["heldout"]
    return prompts


def training_command(head: Path, meta: dict) -> str:
    """The command that trained the head in `head`: its export's record, else the one its card already names
    (an export made before the record kept it), else a line saying it was not recorded."""
    if meta.get("command"):
        return meta["command"]
    try:
        named = json.loads((head / "card.json").read_text()).get("commands", [])
    except (OSError, ValueError, AttributeError):
        named = []
    trained = [c for c in named if isinstance(c, str) and c.startswith("python -m engine train-eagle3 --")]
    return trained[-1] if trained else "python -m engine train-eagle3 (its command was not recorded)"


def shown(folder: Path) -> str:
    """A folder as a reader of the checkout names it: relative to the repository where it lies inside."""
    from engine.sources import REPO_ROOT

    try:
        return str(folder.resolve().relative_to(REPO_ROOT.resolve()))
    except ValueError:
        return str(folder)


def line(key: str, e: dict) -> str:
    speed = ""
    if e.get("tokens_per_s") and e.get("target_tokens_per_s"):
        speed = f", {e['tokens_per_s'] / e['target_tokens_per_s']:.2f}x target-only"
    spread = ""
    if e.get("per_prompt"):
        from engine.metrics import alpha_interval

        _, lo, hi = alpha_interval(e["per_prompt"])
        spread = f"; 95% over prompts {lo:.3f} to {hi:.3f}"
    return (f"{key}: alpha {e['alpha']:.3f} (by position " + " ".join(f"{r:.2f}" for r in e["position_rates"])
            + f"{spread}), {e['tokens_per_round']:.2f} tokens a round{speed}")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import re

    from engine.config import K_BOUND
    from engine.drafters.eagle import EagleLoadError, read_head
    from engine.sampling import SamplingParams
    from engine.sources import SMOLLM2, eagle_folder
    from engine.train.command import command_start
    from engine.train.data_pack import pack_folder
    from engine.train.eagle3_folder import DataError, read_prompts

    ap = argparse.ArgumentParser(prog="python -m engine eval-eagle3", description=(
        "Measure an EAGLE-3 head with the engine on each kind of prompt: the project's held-out and fresh chat "
        "prompts, and each data pack's held-out (and trained-on) self-written prompts."))
    ap.add_argument("--target", default=SMOLLM2)
    ap.add_argument("--head", type=Path, default=None, help="the head's folder (default: assets/eagle/<target>-eagle3)")
    ap.add_argument("--against", type=Path, default=None, help="a second head measured on the same prompts")
    ap.add_argument("--pack", type=Path, action="append", default=None,
                    help="a data folder or pack whose self-written prompts are measured (repeatable; default: the "
                         "target's shipped packs)")
    ap.add_argument("--per-set", type=int, default=16, help="prompts taken from each pack's list (default 16)")
    ap.add_argument("--trained-too", action="store_true", help="also the prompts a head trained on each pack saw")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--chat-only", action="store_true", help="only the project's held-out and fresh chat prompts")
    only.add_argument("--packs-only", action="store_true", help="only the packs' self-written prompts")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--top-p", type=float, default=0.95, help="with --temperature above 0 (default 0.95)")
    ap.add_argument("--json", type=Path, default=None, help="write every measure here")
    ap.add_argument("--card", action="store_true",
                    help="measure --head as train-eagle3 does after training (against --against, default the "
                         "target's first EAGLE head) and write its model card from the record its export kept: for a "
                         "head trained with --skip-eval, or on another machine; with --chat-only, greedy on the chat "
                         "prompts only")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if not 1 <= a.k <= K_BOUND or a.per_set < 1 or a.new_tokens < 1:
        print(f"eval-eagle3: --k takes 1 to {K_BOUND}, --per-set and --new-tokens at least 1", file=sys.stderr)
        return 2
    try:
        sampling = SamplingParams(temperature=a.temperature, top_p=a.top_p) if a.temperature > 0 else None
    except ValueError as exc:
        print(f"eval-eagle3: {exc}", file=sys.stderr)
        return 2
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", a.target)
    heads = [("head", a.head or eagle_folder(f"{slug}-eagle3"))] + ([("against", a.against)] if a.against else [])
    shipped = sorted(p for p in pack_folder(slug).parent.glob(f"{slug}*")
                     if (p.name == slug or p.name.startswith(slug + "-")) and (p / "prompts.json").exists())
    packs = [] if a.chat_only else (a.pack or shipped)
    if a.card:
        return card(a, slug, heads[0][1])
    for name, folder in heads:   # refused with a sentence before the target loads
        try:
            read_head(folder)
        except EagleLoadError as exc:
            print(f"eval-eagle3: --{name}: {exc}", file=sys.stderr)
            return 2
    for pack in packs:
        try:
            read_prompts(pack)
        except DataError as exc:
            print(f"eval-eagle3: --pack: {exc}", file=sys.stderr)
            return 2
    target, log = command_start(a.target, a.threads)
    if target is None:
        return 2
    sets = ([] if a.packs_only else chat_sets(target)) + pack_sets(target, packs, a.per_set, a.trained_too)
    named = [(f"{name} ({shown(folder)})", folder) for name, folder in heads]
    evals = evaluate_sets(target, named, sets, log, sampling, a.k, a.new_tokens)
    print("\n".join(line(key, e) for key, e in evals.items()))
    for text in differences([name for name, _ in named], [s.name + sampled(sampling) for s in sets], evals):
        print(text)
    if a.json:
        a.json.write_text(json.dumps(evals, indent=1) + "\n")
    return 0


def card(a, slug: str, head: Path) -> int:
    """`eval-eagle3 --card`: the trainer's measure of `head` and its model card, from the meta its export holds."""
    from engine.drafters.eagle import CONFIG, EagleLoadError, read_head
    from engine.sources import eagle_folder
    from engine.train.command import command_start
    from engine.train.eagle3_folder import DataError

    if a.packs_only or a.pack or a.trained_too or a.temperature > 0 or a.k != 4 or a.new_tokens != 64:
        print("eval-eagle3: --card measures what the trainer measures; it takes only --head, --against, --chat-only, "
              "--json and --threads", file=sys.stderr)
        return 2
    try:
        read_head(head)
        meta = json.loads((head / CONFIG).read_text()).get("meta") or {}
        if not meta.get("plan"):
            raise DataError(f"{head / CONFIG} keeps no training record: --card writes the card of a head that "
                            "`python -m engine train-eagle3` exported")
        heldout = trained_heldout(meta, slug)
        against = a.against or eagle_folder(slug)
        if a.against is not None:
            read_head(against)
    except (EagleLoadError, DataError) as exc:
        print(f"eval-eagle3: {exc}", file=sys.stderr)
        return 2
    target, log = command_start(a.target, a.threads)
    if target is None:
        return 2
    evals = evaluate_heads(target, head, against, heldout, log, quick=a.chat_only)
    write_card(head, a.target, meta, evals, training_command(head, meta), None)
    if a.json:
        a.json.write_text(json.dumps(evals, indent=1) + "\n")
    log(f"wrote {head / 'MODEL_CARD.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

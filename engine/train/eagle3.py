"""Training an EAGLE-3-style head: `python -m engine train-eagle3 --target smollm2`.

What differs from today's head (engine.train.eagle), following EAGLE-3 (Li et al. 2025, arXiv 2503.01840)
and SpecForge's recipe:
- its input for a committed token is a learned fusion of three of the target's layers (the residual
  stream entering layers low, middle and high: 3d -> d), not the target's last feature;
- no feature-regression loss: its own outputs only have to draft well, so they are free to differ
  from the target's features;
- a soft-label loss, -sum_k p_target(k) log q(k), over the target's top-k next tokens kept in the data
  (renormalised over those in the reduced vocabulary);
- a training-time test of `depth` >= 5 steps: step s reads the head's own step s-1 outputs, with the
  attention a real chain of drafts would have (engine.train.eagle.ttt_mask);
- its own LM head over a reduced vocabulary (the most frequent answer tokens), started from the
  target's rows; or (`--target-head`) the target's rows themselves, frozen, as today's head drafts through
  them: millions fewer parameters to learn from a million tokens.

Data: the shards of `python -m engine draft-data` (engine.train.eagle3_data), streamed shard by shard in
a seeded order, a batch of sequences at a time (right-padded: a padded position is never attended to by
a real one, whose keys all lie at or before it). A corrupt or foreign shard is refused with its path.

The pieces, each in its own module, in the order a step uses them: the plan and the cursor (eagle3_plan), the
shards and batches (eagle3_batch over eagle3_folder), the unrolled loss (eagle3_loss); then the card
(eagle3_card) and the engine's measure (eagle3_eval), which this trainer calls and which call nothing back.

Resumable: the head, the optimiser and the data cursor are checkpointed every couple of minutes (written
whole, then renamed); rerunning the command continues. The export lands in assets/eagle/<target>-eagle3.
"""
from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import torch

from engine.drafters.eagle import EagleConfig, EagleHead, EagleLoadError, read_head, save_head
from engine.models import LoadedModel
from engine.train.ahead import Ahead
from engine.train.command import command_line, command_start, device_problem
from engine.train.eagle import target_rope
from engine.train.eagle3_batch import (
    Batch,
    chunks,
    data_folders,
    data_names,
    heldout_split,
    kept_vocabulary,
    make_batch,
    prompt_sources,
    replay_sample,
)
from engine.train.eagle3_card import init_lineage, write_card
from engine.train.eagle3_folder import DataError, data_command, default_folder, iter_shards, load_shard, read_prompts
from engine.train.eagle3_loss import agreement_by_step, layers_error, lift_features, target_norms, unrolled_loss
from engine.train.eagle3_plan import Cursor, Eagle3Plan, fitted_steps


def on_cpu(state):
    """An optimiser's state dict with every tensor on the CPU (what a checkpoint holds, whatever the device)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_cpu(v) for v in state]
    return state


def warm_start(folder: Path, target: LoadedModel, stored: tuple[int, ...], plan: Eagle3Plan
               ) -> tuple[EagleHead, torch.Tensor]:
    """(the head saved in `folder`, its kept ids) to train on from where it stands; DataError when it cannot be:
    unreadable, made for another target, or fusing layers the data cannot give."""
    try:
        head, kept = read_head(folder)
    except EagleLoadError as exc:
        raise DataError(f"--init: {exc}") from None
    c = head.config
    if (c.hidden, c.target_vocab) != (target.model.config.hidden_size, target.vocab_size):
        raise DataError(f"--init: the head in {folder} was trained for {c.target!r}, not for {target.name!r}")
    if plan.layers and tuple(plan.layers) != c.feature_layers:
        raise DataError(f"--init: the head in {folder} fuses layers {list(c.feature_layers)}, not {list(plan.layers)}; "
                        "leave --layers out to train it on its own")
    problem = layers_error(stored, c.feature_layers, len(target.fused.layers)) if target.fused is not None else None
    if problem:
        raise DataError(f"--init: {problem}")
    return head, kept


def train(target: LoadedModel, data: Path | list[Path], work: Path, out: Path, plan: Eagle3Plan = Eagle3Plan(),
          log=print, deadline: float | None = None, replay: list[Path] = (), device: str | torch.device = "cpu",
          export_when_stopped: bool = False, fit: bool = False, command: str = "") -> dict:
    """Train (or resume) on every whole shard under `data` (one folder or several) and a seeded
    `plan.replay_share` of those under each `replay` folder (data an earlier head was trained on, revisited so
    that new data does not wash it out); export to `out` when done. The loss is held out on the first `data`
    folder's first chunk. The head trains on `device` (a GPU, say), the target's layers the data did not keep are
    computed where the target sits, and the checkpoint and the export hold CPU tensors, so a run stopped on one
    device resumes on another. `export_when_stopped`: a run the deadline stops also exports the head as it stands
    (its meta says at which step of how many), for a machine held for a fixed time. `fit` (with a deadline): once
    the warm-up is over, the cosine schedule is shortened to the steps this run's measured rate reaches by the
    deadline, so that a run held for a fixed time ends its decay rather than stopping part-way (kept across a
    resume). `command`: the line that makes this head, kept in its meta for the card.
    """
    device = torch.device(device)
    folders = [data] if isinstance(data, Path) else list(data)
    replay = list(replay)
    if not folders:
        raise DataError("no data folder given")
    fingerprint_of, stored, plan_files = data_folders(folders + replay)
    plan_file = plan_files[0]
    layers = tuple(plan.layers) if plan.layers else stored
    if target.fused is None:
        problem = None if layers == stored else (f"layers the data did not keep are computed with the engine's fused "
                                                 f"forward, which {target.name!r} does not have")
    else:
        problem = layers_error(stored, layers, len(target.fused.layers))
    if problem:
        raise DataError(f"{problem}; rerun with other --layers")
    if plan.feature_weight > 0 and target.fused is not None and layers[-1] != len(target.fused.layers):
        raise DataError(f"the feature loss regresses the target's post-norm output, so the top fused layer must be "
                        f"{len(target.fused.layers)}, not {layers[-1]}: rerun with --layers ending in "
                        f"{len(target.fused.layers)}, or without --feature-weight")
    first = list(iter_shards(folders[0]))
    if not first:
        raise DataError(f"no shards under {folders[0]}: run `python -m engine draft-data` first")
    held_path, paths = heldout_split(first)
    paths += [p for p in fingerprint_of if p.parent.parent in folders[1:]]
    for folder in replay:
        paths += replay_sample([p for p in fingerprint_of if p.parent.parent == folder], plan.replay_share, plan.seed)
    if not paths:
        raise DataError(f"the shards under {folders[0]} answer one chunk of prompts, which is held out to measure "
                        "the loss: run `python -m engine draft-data` further")
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "checkpoint.pt"
    eos = target.tokenizer.eos_token_id
    start = None
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        kept, config, cursor = ckpt["kept"], EagleConfig(**ckpt["config"]), Cursor(**ckpt["cursor"])
        trained_on = ckpt.get("data", [str(folders[0])])
        if trained_on != data_names(folders, replay, plan):
            raise DataError(f"the checkpoint {ckpt_path} trains on {', '.join(trained_on)}, not on "
                            f"{', '.join(data_names(folders, replay, plan))}: rerun with the same --data (and "
                            "--replay) to resume it, or move it away to start anew")
        if plan.layers and config.feature_layers != layers:
            raise DataError(f"the checkpoint {ckpt_path} trains a head on layers {list(config.feature_layers)}, not "
                            f"{list(layers)}: rerun with --layers {','.join(map(str, config.feature_layers))} to "
                            "resume it, or move it away to start anew")
        layers = config.feature_layers
        log(f"resumed at step {cursor.step} (epoch {cursor.epoch}, shard {cursor.shard})")
    else:
        ckpt = None
        if plan.init:
            start, kept = warm_start(Path(plan.init), target, stored, plan)
            config, layers = start.config, start.config.feature_layers
            log(f"starting from the head in {plan.init} (layers {list(layers)}, {len(kept)} kept tokens, "
                f"{'its own LM head' if config.own_head else 'the target LM-head rows'})")
        else:
            sample = [e for p in paths[:40] for e in load_shard(p, fingerprint_of[p])]
            kept = kept_vocabulary(sample, plan.kept, (eos,) if eos is not None else ())
            config = EagleConfig(**{**asdict(EagleConfig.for_target(target, len(kept))), "feature_layers": layers,
                                    "own_head": plan.own_head, "feature_norm": plan.feature_norm})
        cursor = Cursor()
    # what the head is (from --init or a checkpoint, else the options) is what the card and meta say it is
    plan = replace(plan, own_head=config.own_head, feature_norm=config.feature_norm,
                   layers=tuple(config.feature_layers), kept=len(kept))
    head = EagleHead(config)
    embed = target.model.get_input_embeddings().weight.detach().float().to(device)
    kept_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    kept_index[kept] = torch.arange(len(kept))
    cos_all, sin_all = (t.to(device) for t in target_rope(target, config.head_dim, plan.max_len + 1))
    target_rows = target.model.get_output_embeddings().weight.detach().float().cpu().index_select(0, kept)
    if start is not None:
        head.load_state_dict(start.state_dict())
    elif ckpt is None:
        head.init_for_training(torch.Generator().manual_seed(plan.seed))
        with torch.no_grad():
            d = config.hidden
            head.fuse.weight[:, -d:] += torch.eye(d)   # start near the high layer's features
            if config.feature_norm:
                head.fuse_norm.copy_(target_norms(target, layers))
            if config.own_head:
                head.lm.copy_(target_rows)
    else:
        head.load_state_dict(ckpt["head"])
    head.to(device)
    target_rows = target_rows.to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=plan.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if ckpt is not None:
        opt.load_state_dict(ckpt["opt"])
    lm = head.lm if config.own_head else target_rows
    # a head reading the target's LM head drafts its context's tokens too (engine.drafters.eagle.DraftVocabulary)
    context = not config.own_head
    lm_all = target.model.get_output_embeddings().weight.detach().float().to(device) if context else None
    sequences = sum(json.loads(p.with_suffix(".json").read_text())["sequences"] for p in paths)
    planned = math.ceil(plan.epochs * sequences / plan.batch)
    total_steps = cursor.fitted or planned

    def lr_at(step: int) -> float:
        if step < plan.warmup:
            return plan.lr * (step + 1) / plan.warmup
        done = min(1.0, (step - plan.warmup) / max(1, total_steps - plan.warmup))
        return plan.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    def lifted(b: Batch) -> Batch:
        """The batch on `device`, with the layers the head fuses (where the data kept others, computed by the target
        where it sits: on `device` too when it was loaded there)."""
        if layers == stored:
            return b.to(device)
        b = b.to(target.device)
        b.feats = lift_features(target.fused, b.feats.float(), stored, layers)
        return b.to(device)

    mark = time.time()

    def save() -> None:
        nonlocal mark
        cursor.seconds += time.time() - mark
        mark = time.time()
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"head": {k: v.cpu() for k, v in head.state_dict().items()}, "opt": on_cpu(opt.state_dict()),
                    "cursor": asdict(cursor), "kept": kept,
                    "config": asdict(config), "plan": asdict(plan), "data": data_names(folders, replay, plan)}, tmp)
        tmp.replace(ckpt_path)

    clean = replace(plan, noise=0.0, feature_weight=0.0)   # the held-out loss: soft labels only, no noise

    def batch_loss(b: Batch, how: Eagle3Plan) -> tuple[torch.Tensor, list[float]]:
        """One batch's unrolled loss and each step's top-1 agreement: what a training step and the held-out
        measure both compute (`how`: the plan, or `clean` for the held-out loss)."""
        b = lifted(b)
        n = b.emb_ids.shape[1]
        return unrolled_loss(head, b, embed, how, cos_all[1: n + 1], sin_all[1: n + 1], lm, lm_all)

    def evaluate() -> dict:
        head.eval()
        examples = load_shard(held_path, fingerprint_of[held_path])
        losses, agree = [], []
        with torch.no_grad():
            for i in range(0, len(examples), plan.batch):
                loss, a = batch_loss(make_batch(examples[i: i + plan.batch], kept_index, plan.max_len, context), clean)
                losses.append(float(loss))
                agree.append(a)
        head.train()
        return {"heldout_loss": sum(losses) / len(losses), "heldout_top1_by_step": agreement_by_step(agree, plan.depth)}

    def heldout_point() -> dict:
        """evaluate(), kept in the cursor's held-out curve at this step."""
        figures = evaluate()
        cursor.heldout.append({"step": cursor.step, "loss": figures["heldout_loss"],
                               "top1": figures["heldout_top1_by_step"]})
        return figures

    t0, last_save, last_log, seen_before = time.time(), time.time(), time.time(), cursor.seen
    first_step, rate_mark = cursor.step, None
    pin = device.type == "cuda"

    def built(epoch: int, shard: int) -> Iterator[tuple[Batch, int, int, int]]:
        """(batch, sequences, epoch, shard) in the stream's order from (epoch, shard), made on the worker thread."""
        for examples, now_epoch, now_shard in chunks(paths, plan, epoch, shard,
                                                     lambda path: load_shard(path, fingerprint_of[path])):
            b = make_batch(examples, kept_index, plan.max_len, context)
            yield (b.pinned() if pin else b), len(examples), now_epoch, now_shard

    batches = Ahead(built(cursor.epoch, cursor.shard), depth=2, name="batches")
    waited_mark = 0.0

    def export(stopped: bool = False) -> dict:
        """Measure the held-out shard, checkpoint, and write the head with its meta to `out` (`stopped`: at the
        deadline, before the last step; the meta says where)."""
        figures = heldout_point() if not cursor.heldout or cursor.heldout[-1]["step"] != cursor.step else evaluate()
        save()
        log(f"held-out shard {held_path.name}: loss {figures['heldout_loss']:.3f}, top-1 by step "
            + " ".join(f"{a:.2f}" for a in figures["heldout_top1_by_step"]))
        tokens = sum(json.loads(p.with_suffix(".json").read_text())["tokens"] for p in paths)
        by_folder = [{"folder": str(f), "shards": sum(p.parent.parent == f for p in paths),
                      "tokens": sum(json.loads(p.with_suffix(".json").read_text())["tokens"] for p in paths
                                    if p.parent.parent == f),
                      "prompt_sources": read_prompts(f)["sources"], "plan": pf["plan"], "command": data_command(f),
                      **({"replay": plan.replay_share} if f in replay else {})}
                     for f, pf in zip(folders + replay, plan_files)]
        meta = {"plan": asdict(plan), "params": sum(p.numel() for p in head.parameters()), "sequences": sequences,
                "tokens": tokens, "shards": len(paths), "heldout_shard": held_path.name, "steps": cursor.step,
                "kept": len(kept), "prompt_sources": prompt_sources(folders + replay), "data_folders": by_folder,
                "feature_layers": list(layers), "context_cover": context,
                "target_layers": len(target.fused.layers) if target.fused is not None else None,
                "data_plan": plan_file["plan"], **figures, "log": cursor.log, "heldout_log": cursor.heldout,
                "train_seconds": cursor.seconds, "init": init_lineage(Path(plan.init)) if plan.init else None,
                **({"command": command} if command else {}),
                **({"stopped": {"step": cursor.step, "of": total_steps}} if stopped else {}),
                **({"fitted": {"steps": cursor.fitted, "planned": planned}} if cursor.fitted else {})}
        save_head(copy.deepcopy(head).cpu(), kept, out, meta)
        log(f"wrote {out}" + (f" as it stood at step {cursor.step}/{total_steps}" if stopped else ""))
        return {"finished": not stopped, **meta}

    try:
        running, running_agree = [], []
        head.train()
        while cursor.step < total_steps:
            if deadline is not None and time.time() > deadline:
                log(f"stopping at the deadline at step {cursor.step}/{total_steps}; rerun to resume")
                if export_when_stopped:
                    return {**export(stopped=True), "cursor": asdict(cursor)}
                save()
                return {"finished": False, "cursor": asdict(cursor)}
            built_batch, taken, cursor.epoch, cursor.shard = next(batches)
            if fit and deadline is not None and not cursor.fitted and cursor.step - first_step == 10:
                rate_mark = (cursor.step, time.time())   # the rate is timed from here: a run's first steps are slow
            if (fit and deadline is not None and not cursor.fitted and cursor.step >= plan.warmup
                    and rate_mark is not None and cursor.step - rate_mark[0] >= 20):
                now = time.time()
                total_steps = cursor.fitted = fitted_steps(cursor.step, planned,
                                                           (cursor.step - rate_mark[0]) / max(now - rate_mark[1], 1e-9),
                                                           deadline - now)
                log(f"schedule fitted to the time limit: {total_steps:,} steps of the planned {planned:,} "
                    f"({total_steps * plan.batch / sequences:.2f} epochs)")
            for g in opt.param_groups:
                g["lr"] = lr_at(cursor.step)
            loss, agree = batch_loss(built_batch, plan)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            cursor.step += 1
            cursor.seen += taken
            running.append(float(loss.detach()))
            running_agree.append(agree)
            if time.time() - last_log >= plan.log_every_s or cursor.step == total_steps:
                by_step = agreement_by_step(running_agree, plan.depth)
                rate = (cursor.seen - seen_before) / max(time.time() - t0, 1e-9)   # this run's sequences only
                # what building batches still costs the step: the time the step waited for one (0 when the worker
                # keeps ahead), a mean over the steps since the last line
                wait_ms = 1000 * (batches.waited_s - waited_mark) / len(running)
                log(f"step {cursor.step}/{total_steps} (epoch {cursor.epoch}): loss {sum(running) / len(running):.3f}, "
                    "top-1 by step " + " ".join(f"{a:.2f}" for a in by_step) + f", {rate:.1f} seq/s, "
                    f"{wait_ms:.0f} ms a step waiting for its batch")
                cursor.log.append({"step": cursor.step, "loss": sum(running) / len(running), "top1": by_step,
                                   "time": time.time(), "batch_wait_ms": wait_ms})
                running, running_agree, last_log, waited_mark = [], [], time.time(), batches.waited_s
            if plan.heldout_every and cursor.step % plan.heldout_every == 0 and cursor.step < total_steps:
                measured = heldout_point()   # is it still learning what it has not seen, or only its training data?
                log(f"held-out shard at step {cursor.step}: loss {measured['heldout_loss']:.3f}, top-1 by step "
                    + " ".join(f"{a:.2f}" for a in measured["heldout_top1_by_step"]))
            if time.time() - last_save > plan.checkpoint_every_s:
                save()
                last_save = time.time()
        return export()
    finally:
        batches.close()


def main(argv: list[str] | None = None) -> int:
    import argparse
    import re

    from engine.sources import REPO_ROOT, SMOLLM2, eagle_folder
    from engine.train.eagle3_eval import evaluate_heads

    ap = argparse.ArgumentParser(prog="python -m engine train-eagle3", description=(
        "Train an EAGLE-3-style head on the shards of `python -m engine draft-data`; resumable; then measure it "
        "with the engine on held-out prompts and write its model card."))
    ap.add_argument("--target", default=SMOLLM2)
    ap.add_argument("--data", type=Path, action="append", default=None,
                    help="data folder (default: .cache/draft-data/<target>); repeat it to train on several, the "
                         "first one holding out the loss's shard")
    ap.add_argument("--replay", type=Path, action="append", default=[],
                    help="a data folder an earlier head was trained on, of which only a seeded sample of shards "
                         "(--replay-share) is trained on again beside the new --data (repeatable)")
    ap.add_argument("--replay-share", type=float, default=Eagle3Plan().replay_share,
                    help="the share of each --replay folder's shards trained on (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="export folder (default: assets/eagle/<target>-eagle3)")
    ap.add_argument("--epochs", type=float, default=Eagle3Plan().epochs)
    ap.add_argument("--batch", type=int, default=Eagle3Plan().batch)
    ap.add_argument("--depth", type=int, default=Eagle3Plan().depth)
    ap.add_argument("--kept", type=int, default=Eagle3Plan().kept)
    ap.add_argument("--lr", type=float, default=Eagle3Plan().lr, help="peak learning rate (AdamW, cosine decay)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for the head's products (fast with AMX)")
    ap.add_argument("--target-head", action="store_true",
                    help="draft through the target's own LM-head rows, frozen, instead of training a head's own")
    ap.add_argument("--layers", default=None,
                    help="the target layers the head fuses, e.g. 2,15,30 (default: those the data kept); a layer past "
                         "the highest kept one is computed from it; the target's layer count means its post-norm output")
    ap.add_argument("--feature-norm", action="store_true",
                    help="RMS-normalise each fused layer before the fusion (weights started from the target's own norms)")
    ap.add_argument("--feature-weight", type=float, default=Eagle3Plan().feature_weight,
                    help="add EAGLE-1's feature loss at this weight (smooth-L1 of step 1's output against the "
                         "target's next post-norm feature; needs --layers ending in the target's layer count)")
    ap.add_argument("--noise", type=float, default=Eagle3Plan().noise,
                    help="Gaussian noise on the real fused features while training, relative to their std")
    ap.add_argument("--work", type=Path, default=None,
                    help="checkpoint folder (default: .cache/train-eagle3/<target>); a run there is resumed")
    ap.add_argument("--minutes", type=float, default=None, help="stop (resumably) after this many minutes")
    ap.add_argument("--export-when-stopped", action="store_true",
                    help="when --minutes stops the run, also export (and measure) the head as it stands, its card "
                         "saying at which step: for a machine held for a fixed time")
    ap.add_argument("--fit", action="store_true",
                    help="with --minutes: after the warm-up, shorten the learning-rate schedule to the steps the "
                         "measured rate reaches by the time limit, so the decay ends there instead of being cut off")
    ap.add_argument("--heldout-every", type=int, default=Eagle3Plan().heldout_every,
                    help="measure the held-out shard every this many steps (0: at the end only)")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this saved head (e.g. assets/eagle/smollm2-eagle3) instead of at random: its "
                         "layers, vocabulary and LM-head choice are kept")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu",
                    help="where the head trains and the target runs: cpu (default) or cuda[:N] (float32; a "
                         "checkpoint resumes on either)")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--quick-eval", action="store_true",
                    help="measure on the held-out and fresh chat prompts, greedy, only (no Magpie set, no T = 0.7)")
    a = ap.parse_args(argv)
    try:   # bad options are refused before the target is loaded
        layers = tuple(int(x) for x in a.layers.split(",")) if a.layers else None
    except ValueError:
        print(f"--layers takes layer numbers separated by commas (e.g. 2,15,30), not {a.layers!r}", file=sys.stderr)
        return 2
    try:
        plan = Eagle3Plan(kept=a.kept, depth=a.depth, epochs=a.epochs, batch=a.batch, lr=a.lr, bf16=a.bf16,
                          own_head=not a.target_head, layers=layers, feature_norm=a.feature_norm,
                          feature_weight=a.feature_weight, noise=a.noise, heldout_every=a.heldout_every,
                          init=str(a.init or ""), replay_share=a.replay_share)
    except ValueError as exc:
        print(f"train-eagle3: {exc}", file=sys.stderr)
        return 2
    if a.fit and not a.minutes:
        print("train-eagle3: --fit fits the schedule to --minutes: give both", file=sys.stderr)
        return 2
    if problem := device_problem(a.device):
        print(f"train-eagle3: {problem}", file=sys.stderr)
        return 2
    target, log = command_start(a.target, a.threads, a.device)
    if target is None:
        return 2
    plan = replace(plan, kept=min(plan.kept, target.vocab_size))
    data = a.data or [default_folder(target.name)]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", target.name)
    out = a.out or eagle_folder(f"{slug}-eagle3")
    t0, command = time.time(), command_line("train-eagle3", argv)
    try:
        result = train(target, data, a.work or REPO_ROOT / ".cache" / "train-eagle3" / slug, out, plan, log,
                       time.time() + a.minutes * 60 if a.minutes else None, a.replay, a.device,
                       a.export_when_stopped, a.fit, command)
    except DataError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not (result["finished"] or result.get("stopped")) or a.skip_eval:
        return 0
    heldout = [p for folder in data + a.replay for p in read_prompts(folder)["heldout"]]
    evals = evaluate_heads(target, out, eagle_folder(a.target), heldout, log, a.quick_eval)
    write_card(out, a.target, {k: v for k, v in result.items() if k != "finished"}, evals, command, time.time() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

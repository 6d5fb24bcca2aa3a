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

Resumable: the head, the optimiser and the data cursor are checkpointed every couple of minutes (written
whole, then renamed); rerunning the command continues. The export lands in assets/eagle/<target>-eagle3.
"""
from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.drafters.eagle import EagleConfig, EagleHead, EagleLoadError, read_head, save_head
from engine.models import LoadedModel
from engine.train.ahead import Ahead
from engine.train.eagle import target_rope, ttt_mask
from engine.train.eagle3_data import (
    DataError,
    Example,
    command_line,
    command_start,
    data_command,
    default_folder,
    device_problem,
    iter_shards,
    load_shard,
    packed_only,
    read_prompts,
)


@dataclass(frozen=True, slots=True)
class Eagle3Plan:
    kept: int = 8192                 # reduced vocabulary: the most frequent answer tokens
    depth: int = 6                   # training-time-test steps
    step_decay: float = 0.8          # step s's loss weighs step_decay ** (s - 1)
    lr: float = 6e-4
    warmup: int = 100
    epochs: float = 2.0
    batch: int = 8                   # sequences per optimiser step
    max_len: int = 384               # longer sequences are cut (prompt + answer)
    bf16: bool = False               # autocast the head's matrix products to bf16 (fast on CPUs with AMX)
    own_head: bool = True            # train its own LM head (else draft through the target's rows, frozen)
    layers: tuple[int, ...] | None = None   # the target layers it fuses (default: the data's); see lift_features
    feature_norm: bool = False       # RMS-normalise each fused layer first, weights started from the target's norms
    feature_weight: float = 0.0      # smooth-L1 of step 1's output against the next post-norm feature (EAGLE-1's loss)
    noise: float = 0.0               # Gaussian noise on the real fused features while training, relative to their std
    seed: int = 0
    checkpoint_every_s: float = 120.0
    log_every_s: float = 60.0
    heldout_every: int = 250         # optimiser steps between measurements on the held-out shard (0: at the end only)
    init: str = ""                   # a saved head to start from (its layers, vocabulary, LM-head choice)
    replay_share: float = 0.25       # the share of each replay folder's shards trained on (a seeded sample)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.kept < 16 or self.batch < 1 or self.epochs <= 0 or not self.lr > 0:
            raise ValueError("need depth >= 1, kept >= 16, batch >= 1, epochs > 0 and lr > 0")
        if self.feature_weight < 0 or self.noise < 0 or self.heldout_every < 0:
            raise ValueError("need feature_weight >= 0, noise >= 0 and heldout_every >= 0")
        if not 0 < self.replay_share <= 1:
            raise ValueError("need 0 < replay share <= 1")


def kept_vocabulary(examples: list[Example], size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` ids the target most often puts first (its top-1 over answer positions), plus `always`,
    sorted by id."""
    counts = torch.zeros(1, dtype=torch.long)
    for e in examples:
        top = e.top_ids[:, 0].long()
        if top.numel():
            need = int(top.max()) + 1
            if need > counts.numel():
                counts = torch.cat([counts, torch.zeros(need - counts.numel(), dtype=torch.long)])
            counts += torch.bincount(top, minlength=counts.numel())
    order = sorted(range(counts.numel()), key=lambda t: (-int(counts[t]), t))
    chosen = set(always) | {t for t in order[:size] if counts[t] > 0}
    return torch.tensor(sorted(chosen)[: max(size, len(always))], dtype=torch.long)


def layers_error(stored: tuple[int, ...], wanted: tuple[int, ...], count: int) -> str | None:
    """Why a head cannot fuse the layers `wanted` from data that kept the inputs of `stored` (None when it can):
    each must be kept, or lie past the highest kept one (up to L = `count`, the post-norm output)."""
    bad = [w for w in wanted if w not in stored and not max(stored) < w <= count]
    if bad or not wanted or len(set(wanted)) != len(wanted):
        return (f"layers {list(wanted)}: the data kept the inputs of layers {list(stored)}, so a head can fuse those "
                f"and any of {max(stored) + 1}..{count} ({count}: the target's post-norm output), each once")
    return None


def lift_features(fused, feats: torch.Tensor, stored: tuple[int, ...], wanted: tuple[int, ...]) -> torch.Tensor:
    """Features [B, N, len(wanted) * d] for a head fusing `wanted` from the data's [B, N, len(stored) * d]: the
    layers past the highest kept one are computed by running the target on from it (FusedLlama.continue_from),
    exactly what the engine's forward would hand over. The data stays as it was generated."""
    if wanted == stored:
        return feats
    parts = feats.unflatten(-1, (len(stored), -1))
    top = max(stored)
    beyond = tuple(w for w in wanted if w not in stored)
    derived = dict(zip(beyond, fused.continue_from(parts[..., stored.index(top), :], top, beyond)))
    return torch.cat([parts[..., stored.index(w), :] if w in stored else derived[w].to(feats.dtype) for w in wanted],
                     dim=-1)


def target_norms(target: LoadedModel, layers: tuple[int, ...]) -> torch.Tensor:
    """[len(layers), d]: where a head's per-layer norms start. For a layer's input, the weight of the target's own
    norm there, so the head starts from what that layer reads; ones for the post-norm output (L), normalised already."""
    inner = target.model.model
    d = target.model.config.hidden_size
    return torch.stack([torch.ones(d) if i == len(inner.layers) else
                        inner.layers[i].input_layernorm.weight.detach().float().cpu() for i in layers])


NEVER = 2**40   # first_at of a token a sequence does not hold


def last_committed(columns: torch.Tensor, step: int) -> torch.Tensor:
    """The index in its sequence's ids of the last token committed when the `step`-th draft of a chain is made at
    each of `columns`: draft position t (column t - 1) drafting step s belongs to a chain started at t - s + 1,
    whose committed tokens are x_0 .. x_{t-s+1}. A token outside the kept set is drafted there from where the
    sequence first holds it up to this index, as the engine's drafter does."""
    return columns + 2 - step


@dataclass
class Batch:
    emb_ids: torch.Tensor      # [B, N] x_t for draft positions t = 1..N
    feats: torch.Tensor        # [B, N, L * d] the target's layer inputs after x_{t-1}, as stored (float16)
    label_ids: torch.Tensor    # [B, N, k] column of each soft label (0 where unused): its kept-vocabulary index,
                               # or kept + j for the j-th of `extra_ids`
    label_p: torch.Tensor      # [B, N, k] its probability, renormalised over the labels q covers there (0: unused)
    valid: torch.Tensor        # [B, N] bool: an answer position with a label
    # a head reading the target's LM head drafts each sequence's context tokens outside the kept set too
    # (engine.drafters.eagle.DraftVocabulary): those of the batch, and where each sequence first holds them
    extra_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))   # [E] token ids
    first_at: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))  # [B, E] index
                               # into the sequence's ids of its first copy of each (NEVER: none)

    def to(self, device: torch.device) -> "Batch":
        """The same batch on `device` (itself where it is there already)."""
        if self.emb_ids.device == device:
            return self
        return Batch(*(t.to(device, non_blocking=True) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.emb_ids, self.feats, self.label_ids, self.label_p, self.valid, self.extra_ids, self.first_at

    def visible(self, step: int) -> torch.Tensor:
        """[B, N, E] bool: which extra tokens the engine's q covers at each draft position for the `step`-th draft
        of a chain: those committed by then (`last_committed`)."""
        last = last_committed(torch.arange(self.emb_ids.shape[1], device=self.first_at.device), step)
        return self.first_at[:, None, :] <= last[None, :, None]

    def pinned(self) -> "Batch":
        """The same batch in page-locked memory, so that its copy to a GPU runs while the GPU works."""
        return Batch(*(t.pin_memory() for t in self.tensors()))


def make_batch(examples: list[Example], kept_index: torch.Tensor, max_len: int, context: bool = False) -> Batch:
    """Right-padded tensors for `examples`; draft position t (column t - 1) predicts x_{t+1}. The features stay
    in the data's precision (float16), cast where the head reads them: half the bytes to copy on the CPU and to
    move to a GPU. `context`: q covers each sequence's tokens outside the kept set as well, from where it first
    holds them, as the engine's drafter does for a head reading the target's LM head."""
    lengths = [min(e.ids.numel(), max_len) - 1 for e in examples]
    n, b = max(lengths), len(examples)
    kept = int((kept_index >= 0).sum())
    extra_ids, first_at, columns = torch.zeros(0, dtype=torch.long), torch.zeros(b, 0, dtype=torch.long), kept_index
    if context:
        cut = [e.ids[: m + 1].long() for e, m in zip(examples, lengths)]
        extra_ids = torch.unique(torch.cat([ids[kept_index[ids] < 0] for ids in cut]))
        columns = kept_index.clone()
        columns[extra_ids] = kept + torch.arange(len(extra_ids))
        first_at = torch.full((b, len(extra_ids)), NEVER, dtype=torch.long)
        for i, ids in enumerate(cut):
            where = columns[ids] - kept                      # each position's extra column (negative: kept)
            at = torch.arange(len(ids))
            outside = where >= 0
            first_at[i].scatter_reduce_(0, where[outside], at[outside], reduce="amin")
    d_all = examples[0].features.shape[1] * examples[0].features.shape[2]
    k = examples[0].top_ids.shape[1]
    emb_ids = torch.zeros(b, n, dtype=torch.long)
    feats = torch.zeros(b, n, d_all, dtype=examples[0].features.dtype)
    label_ids = torch.zeros(b, n, k, dtype=torch.long)
    label_p = torch.zeros(b, n, k)
    valid = torch.zeros(b, n, dtype=torch.bool)
    for i, (e, m) in enumerate(zip(examples, lengths)):
        ids = e.ids.long()
        emb_ids[i, :m] = ids[1: m + 1]
        feats[i, :m] = e.features[:m].reshape(m, -1)
        # column c = draft position t = c + 1 predicts x_{t+1}; its label row is t - (prompt_len - 1)
        first = max(e.prompt_len - 2, 0)            # first column whose t >= prompt_len - 1
        rows = torch.arange(first, m - 1)           # t + 1 <= m: the next token is inside the cut
        label_rows = rows + 1 - (e.prompt_len - 1)
        ok = label_rows >= 0
        rows, label_rows = rows[ok], label_rows[ok]
        ids_k = columns[e.top_ids[label_rows].long()]
        covered = ids_k >= 0
        if context:      # an extra label counts from where the sequence holds its token (a chain's first draft)
            extra = (ids_k - kept).clamp(min=0)
            covered &= (ids_k < kept) | (first_at[i][extra] <= last_committed(rows, 1)[:, None])
        p = e.top_logp[label_rows].float().exp() * covered
        mass = p.sum(-1, keepdim=True)
        has = mass[:, 0] > 0
        label_ids[i, rows[has]] = ids_k[has].clamp(min=0)
        label_p[i, rows[has]] = p[has] / mass[has]
        valid[i, rows[has]] = True
    return Batch(emb_ids, feats, label_ids, label_p, valid, extra_ids, first_at)


def unrolled(head: EagleHead, emb: torch.Tensor, feats: torch.Tensor, depth: int, cos: torch.Tensor,
             sin: torch.Tensor, bf16: bool = False) -> Iterator[torch.Tensor]:
    """Each training-time-test step's predicted features [B, N, d], for draft positions t = 1..N whose inputs
    are the embeddings `emb` of x_t and the target's layer inputs `feats` after x_{t-1} ([B, N, L * d]).

    Step 1 reads the real features; step s + 1 at position t reads step s's output at t - 1 and attends as the
    s + 1-th draft of a chain started at t - s does in the engine (engine.train.eagle.ttt_mask). This is what
    the engine's drafter computes for a chain of drafts equal to x_t, x_{t+1}, ... (tests/test_eagle3.py)."""
    n, where = emb.shape[1], emb.device.type
    layer = head.layer()
    with torch.autocast(where, dtype=torch.bfloat16, enabled=bf16):
        inputs = head.real_features(feats)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def keys_values(ks, vs):
        keys.append(ks)
        values.append(vs)
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    for step in range(1, depth + 1):
        with torch.autocast(where, dtype=torch.bfloat16, enabled=bf16):
            out = head.step(emb, inputs, layer, keys_values, cos[None, None], sin[None, None],
                            ttt_mask(n, step).to(emb.device))
        yield out
        inputs = torch.cat([inputs[:, :1], out[:, :-1].to(inputs.dtype)], dim=1)  # step s+1 reads step s at t-1


def feature_loss(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Smooth-L1 between step 1's output at draft position t and the target's post-norm feature there, which
    the batch holds as the top fused layer's input at t + 1 (the trainer checks that the top layer is the
    post-norm output). Rows: answer positions whose next column is inside the sequence."""
    d = out.shape[-1]
    rows = batch.valid[:, :-1] & batch.valid[:, 1:]
    if not rows.any():
        return torch.zeros(())
    return F.smooth_l1_loss(out[:, :-1][rows].float(), batch.feats[:, 1:, -d:][rows].float())


def unrolled_loss(head: EagleHead, batch: Batch, embed: torch.Tensor, plan: Eagle3Plan, cos: torch.Tensor,
                  sin: torch.Tensor, lm: torch.Tensor, lm_all: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, list[float]]:
    """The weighted soft-label loss over `depth` unrolled steps, and each step's top-1 agreement; `lm` is the
    [kept, d] LM head the drafts are read through (the head's own, or the target's rows). A batch with extra
    tokens (make_batch's `context`) reads them through their rows of `lm_all`, the target's whole LM head [V, d]:
    at each step q covers those the engine's would there, and the labels are renormalised over what it covers."""
    n = batch.emb_ids.shape[1]
    emb = F.embedding(batch.emb_ids, embed)
    total, weights, agree = torch.zeros((), device=emb.device), 0.0, []
    positions = torch.arange(1, n + 1, device=emb.device)
    feats, feature = batch.feats.float(), torch.zeros(())   # a batch may carry them as stored (float16)
    if plan.noise > 0:
        feats = feats + torch.randn_like(feats) * feats.std() * plan.noise
    extra = batch.extra_ids.numel()
    extra_rows = lm_all.index_select(0, batch.extra_ids.to(lm_all.device)) if extra else None
    kept = lm.shape[0]
    steps = unrolled(head, emb, feats, plan.depth, cos, sin, plan.bf16)
    for step, out in enumerate(steps, start=1):
        if step == 1 and plan.feature_weight > 0:
            feature = plan.feature_weight * feature_loss(out, batch)
        rows = batch.valid & (positions >= step)[None]
        picked, label_p, label_ids = out[rows], batch.label_p[rows], batch.label_ids[rows]
        if extra:   # this step's cover: an extra label the chain has not committed yet is dropped, the rest renormalised
            visible = batch.visible(step)[rows]                                          # [R, E]
            label_p = label_p * (visible.gather(1, (label_ids - kept).clamp(min=0)) | (label_ids < kept))
            mass = label_p.sum(-1, keepdim=True)
            labelled = mass[:, 0] > 0
            picked, visible = picked[labelled], visible[labelled]
            label_p, label_ids = label_p[labelled] / mass[labelled], label_ids[labelled]
        if label_p.shape[0]:
            with torch.autocast(emb.device.type, dtype=torch.bfloat16, enabled=plan.bf16):
                logits = F.linear(picked, lm)
                if extra:
                    others = F.linear(picked, extra_rows).float().masked_fill(~visible, -math.inf)
                    logits = torch.cat([logits.float(), others], dim=-1)
            logq = torch.log_softmax(logits.float(), dim=-1)
            ce = -(label_p * logq.gather(1, label_ids).clamp(min=-1e4)).sum(-1).mean()
            w = plan.step_decay ** (step - 1)
            total, weights = total + w * ce, weights + w
            agree.append(float((logq.argmax(-1) == label_ids[:, 0]).float().mean()))
        else:
            agree.append(math.nan)
    return total / max(weights, 1e-9) + feature, agree


@dataclass
class Cursor:
    """Where the data stream stands: epoch, position in that epoch's shard order, sequences taken."""

    epoch: int = 0
    shard: int = 0
    seen: int = 0
    step: int = 0
    log: list[dict] = field(default_factory=list)
    seconds: float = 0.0    # training time over every run of the command, resumed ones included
    heldout: list[dict] = field(default_factory=list)   # {step, loss, top1 by step} on the held-out shard
    fitted: int = 0         # the schedule's steps where it was fitted to a deadline (0: the plan's epochs)


def fitted_steps(step: int, planned: int, rate: float, seconds_left: float) -> int:
    """How long a schedule can be to end by a deadline: the steps a run at `rate` steps a second still takes in
    `seconds_left`, less a reserve for the export's measurement and save (a twentieth of it, at least 15 s);
    never more than `planned`, never fewer than one more."""
    reserve = max(15.0, seconds_left / 20)
    return max(step + 1, min(planned, step + int(rate * max(0.0, seconds_left - reserve))))


def on_cpu(state):
    """An optimiser's state dict with every tensor on the CPU (what a checkpoint holds, whatever the device)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_cpu(v) for v in state]
    return state


def shard_order(paths: list[Path], plan: Eagle3Plan, epoch: int) -> list[Path]:
    order = list(paths)
    random.Random(plan.seed * 7919 + epoch).shuffle(order)
    return order


def chunks(paths: list[Path], plan: Eagle3Plan, epoch: int, shard: int,
           read: Callable[[Path], list[Example]]) -> Iterator[tuple[list[Example], int, int]]:
    """The training stream from the cursor's (epoch, shard), endless: each epoch's shards in their seeded order,
    each shard's sequences shuffled (seeded) and cut into batches of `plan.batch` (its last one shorter). Each item
    is (sequences, epoch, shard): where the cursor stands once the item is taken (the shard after the one it came
    from), so that a run resumed there goes on with the next shard. `read(path)` loads a shard; the next one is
    read on another thread while this one's batches are taken."""
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shards")
    try:
        upcoming: tuple[Path, Future] | None = None
        while True:
            order = shard_order(paths, plan, epoch)
            if shard >= len(order):
                epoch, shard = epoch + 1, 0
                continue
            path = order[shard]
            examples = upcoming[1].result() if upcoming and upcoming[0] == path else read(path)
            following = order[shard + 1] if shard + 1 < len(order) else shard_order(paths, plan, epoch + 1)[0]
            upcoming = (following, reader.submit(read, following))
            random.Random(plan.seed + epoch * 100_003 + shard).shuffle(examples)
            shard += 1
            for i in range(0, len(examples), plan.batch):
                yield examples[i: i + plan.batch], epoch, shard
    finally:
        reader.shutdown(wait=True, cancel_futures=True)


def heldout_split(paths: list[Path]) -> tuple[Path, list[Path]]:
    """(the shard that measures the held-out loss, the shards to train on). The held-out shard is the first
    one; every other pass over the same prompts (its chunk: `shard-p<pass>-<chunk>`) is left out of training
    too, or the sampled answers to the very prompts whose greedy answers measure the loss would be learnt."""
    held = paths[0]
    chunk = held.stem.rsplit("-", 1)[-1]
    return held, [p for p in paths[1:] if p.stem.rsplit("-", 1)[-1] != chunk]


def replay_sample(paths: list[Path], share: float, seed: int) -> list[Path]:
    """A seeded `share` of a replay folder's shards (at least one), in name order: the same sample on every resumed
    run while the folder holds the same shards."""
    ordered = sorted(paths)
    k = max(1, round(share * len(ordered))) if ordered else 0
    return sorted(random.Random(seed * 7919 + len(ordered)).sample(ordered, k))


def data_folders(folders: list[Path]) -> tuple[dict[Path, str], tuple[int, ...], list[dict]]:
    """({shard: the fingerprint it is read under}, the layers whose inputs the data kept, each folder's plan
    file) over every folder of `python -m engine draft-data` given. The folders may differ in their prompts,
    seeds and soft-label width, not in the layers they kept: a head fuses one set of layers."""
    fingerprints, stored, plans = {}, None, []
    for folder in folders:
        try:
            plan_file = json.loads((folder / "plan.json").read_text())
            layers = tuple(plan_file["plan"]["layers"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{folder / 'plan.json'} cannot be read ({type(exc).__name__}): is {folder} a folder "
                            "of `python -m engine draft-data`?") from None
        if folder.resolve() in {f.resolve() for f in folders[: len(plans)]}:
            raise DataError(f"{folder} is given twice as --data")
        if stored is not None and layers != stored:
            raise DataError(f"{folder} kept the inputs of layers {list(layers)}, {folders[0]} those of "
                            f"{list(stored)}: train on folders made for the same layers")
        stored = layers
        if missing := packed_only(folder):
            raise DataError(f"{folder} holds {len(missing)} of its shards only as token ids in its pack (a run with "
                            f"--answers-only); rebuild them first: {data_command(folder)}")
        shards = list(iter_shards(folder))
        if not shards or not (folder / "prompts.json").is_file():   # refused now, not after the training
            lacking = "no shards" if (folder / "prompts.json").is_file() else "no frozen prompt list"
            raise DataError(f"{folder} holds no answers yet ({lacking}): finish its data first: "
                            f"{data_command(folder)}")
        plans.append(plan_file)
        fingerprints.update((path, plan_file["fingerprint"]) for path in shards)
    return fingerprints, stored, plans


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


def data_names(folders: list[Path], replay: list[Path], plan: Eagle3Plan) -> list[str]:
    """What a checkpoint records it trains on (resumed only on the same)."""
    return [str(f) for f in folders] + [f"{f} (replay {plan.replay_share:g})" for f in replay]


def prompt_sources(folders: list[Path]) -> dict:
    """The prompt counts of every folder's frozen list, added up (magpie, written, magpie_heldout)."""
    total: dict[str, int] = {}
    for folder in folders:
        for key, n in read_prompts(folder)["sources"].items():
            total[key] = total.get(key, 0) + n
    return total


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

    def evaluate() -> dict:
        head.eval()
        examples = load_shard(held_path, fingerprint_of[held_path])
        losses, agree = [], []
        with torch.no_grad():
            for i in range(0, len(examples), plan.batch):
                b = lifted(make_batch(examples[i: i + plan.batch], kept_index, plan.max_len, context))
                n = b.emb_ids.shape[1]
                loss, a = unrolled_loss(head, b, embed, clean, cos_all[1: n + 1], sin_all[1: n + 1], lm, lm_all)
                losses.append(float(loss))
                agree.append(a)
        head.train()
        by_step = [sum(a[s] for a in agree if not math.isnan(a[s])) / max(1, sum(not math.isnan(a[s]) for a in agree))
                   for s in range(plan.depth)]
        return {"heldout_loss": sum(losses) / len(losses), "heldout_top1_by_step": by_step}

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
            b = lifted(built_batch)
            n = b.emb_ids.shape[1]
            loss, agree = unrolled_loss(head, b, embed, plan, cos_all[1: n + 1], sin_all[1: n + 1], lm, lm_all)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            cursor.step += 1
            cursor.seen += taken
            running.append(float(loss.detach()))
            running_agree.append(agree)
            if time.time() - last_log >= plan.log_every_s or cursor.step == total_steps:
                by_step = [sum(a[s] for a in running_agree if not math.isnan(a[s])) / max(1, len(running_agree))
                           for s in range(plan.depth)]
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
    from engine.train.eagle3_eval import differences

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

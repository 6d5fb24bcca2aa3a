"""From an EAGLE-3-style head's data folders to training batches: which shards are trained on (and which one
measures the held-out loss), their seeded order, the kept vocabulary, and the right-padded tensors of a batch."""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.train.eagle3_folder import DataError, Example, data_command, iter_shards, packed_only, read_prompts
from engine.train.eagle3_plan import Eagle3Plan


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

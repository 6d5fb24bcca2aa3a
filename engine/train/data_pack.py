"""The head's training data as token ids in the repository: what survives a fresh machine.

The shards of `python -m engine draft-data` (engine.train.eagle3_data; on disk, engine.train.eagle3_folder) hold
features and soft labels, about 3.4 KB a token: a million tokens are gigabytes, which live in `.cache/` and are
gone with the machine. What took the hours to make is the text: the prompts the target wrote itself and its
answers, decoded one token at a time. Those are kept here, a shard's token ids in one compressed file beside the
frozen prompt list (about two bytes a token), so that the data grows from one session to the next.

A fresh folder is rebuilt from the pack by feeding each whole sequence to the target at once (teacher
forcing, `replay`): the same features and soft labels as the generation's, to float rounding (measured on
SmolLM2: top-1 labels all equal, features within 1e-5 of their scale), at 748 tokens/s on this project's
2-core CPU, where decoding them ran at 290 answer tokens/s after the prompts had been sampled.

`--rebuild-dtype bfloat16` multiplies in bf16 instead (`engine.fused_llama.Bf16Weights`; the residual stream,
norms and softmax stay fp32). On a 2-core Xeon with AMX, over the first 32 sequences of three packed shards
(25,205 tokens, one process): 911 tokens/s against fp32's 570 (1.60x; the fp32 elementwise work and the
attention are left, the products are several times faster); top-1 labels equal fp32's at 98.5% of 18,911
positions (the rest near-ties), features within 0.4 / 0.6 / 0.7% of their norm at the three taps, the top
probability within 0.006 on average. Data for a head, not the engine's arithmetic: such shards' sidecars say
`"replayed": "bfloat16"`.

Every pack file is written under a temporary name and renamed when whole; one that cannot be read is refused
with its path, and never half-used.
"""
from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from engine.fused_llama import BatchForward, Bf16Weights, FusedLlama
from engine.train.eagle3_folder import (
    DataError,
    DataFolder,
    Eagle3DataPlan,
    Example,
    Log,
    iter_shards,
    load_shard,
    save_shard,
    shard_info,
    write_atomic,
)

PACK_FORMAT = 1
REPLAY_ROWS = 16     # sequences fed at once when rebuilding a shard on the CPU
GPU_REPLAY_ROWS = 128   # on a GPU, where a forward of 16 rows leaves it mostly idle
SHARD_META = ("fingerprint", "pass", "chunk", "prompts")   # what a shard's own metadata holds


def replay_rows(fused: FusedLlama) -> int:
    """How many sequences a rebuild feeds at once where `fused` sits."""
    return REPLAY_ROWS if fused.device.type == "cpu" else GPU_REPLAY_ROWS


def pack_folder(target_name: str) -> Path:
    """Where a target's pack lives: assets/draft-data/<target> in the checkout."""
    from engine.sources import REPO_ROOT

    return REPO_ROOT / "assets" / "draft-data" / re.sub(r"[^A-Za-z0-9_.-]+", "_", target_name)


def pack_path(pack: Path, shard: Path) -> Path:
    return pack / "answers" / (shard.stem + ".npz")


# -- writing ------------------------------------------------------------------------------------------------
def save_entry(pack: Path, shard: Path, examples: Sequence[Example], meta: dict) -> None:
    """One shard's token ids (and the metadata its sidecar holds) as `answers/<shard>.npz`."""
    ids = np.concatenate([e.ids.numpy().astype(np.int32) for e in examples])
    lengths = np.array([e.ids.numel() for e in examples], dtype=np.int32)
    prompt_lens = np.array([e.prompt_len for e in examples], dtype=np.int32)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, ids=ids, lengths=lengths, prompt_lens=prompt_lens,
                        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    path = pack_path(pack, shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buffer.getvalue())


def save_pack(folder: DataFolder, pack: Path, log: Log, refresh: bool = True) -> int:
    """Bring the pack up to the folder: every whole shard not packed yet, then its plan, its frozen prompts and the
    command that made them (with `refresh=False`, only where the pack lacks them: a run that made nothing, say one
    that only rebuilt a folder from the pack, leaves the pack's command as it was). Returns the shards added."""
    pack.mkdir(parents=True, exist_ok=True)
    fingerprint, added = folder.plan.fingerprint(), 0
    for shard in iter_shards(folder.root):
        info = None if pack_path(pack, shard).exists() else shard_info(shard, fingerprint)
        if info is None:
            continue
        save_entry(pack, shard, load_shard(shard, fingerprint), {k: info[k] for k in SHARD_META if k in info})
        added += 1
    for name in ("plan.json", "prompts.json", "command.txt"):
        if (folder.root / name).exists() and (refresh or added or not (pack / name).exists()):
            write_atomic(pack / name, (folder.root / name).read_text())
    if added:
        log(f"pack: {added} shard(s) added under {pack}")
    return added


# -- reading ------------------------------------------------------------------------------------------------
def read_entry(path: Path) -> tuple[list[tuple[torch.Tensor, int]], dict]:
    """([(ids, prompt_len)] of each sequence, the shard's metadata), or DataError naming the file."""
    try:
        with np.load(path) as data:
            ids, lengths, prompt_lens = data["ids"], data["lengths"], data["prompt_lens"]
            meta = json.loads(data["meta"].tobytes().decode())
    except Exception as exc:  # a truncated zip, missing arrays, bad JSON: the file is not whole
        raise DataError(f"{path} cannot be read ({type(exc).__name__}); restore it from the repository "
                        "(git checkout) or delete it") from None
    if int(lengths.sum()) != ids.size or len(lengths) != len(prompt_lens) or (prompt_lens >= lengths).any():
        raise DataError(f"{path} holds {ids.size} ids for sequences of {int(lengths.sum())}; restore it from the "
                        "repository (git checkout) or delete it")
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    seqs = [(torch.from_numpy(ids[a:b].copy()), int(p)) for a, b, p in zip(bounds[:-1], bounds[1:], prompt_lens)]
    return seqs, meta


def read_planned(entry: Path, fingerprint: str, pack: Path) -> tuple[list[tuple[torch.Tensor, int]], dict]:
    """read_entry, and DataError when the entry was made under another plan than the pack's."""
    seqs, meta = read_entry(entry)
    if meta.get("fingerprint") != fingerprint:
        raise DataError(f"{entry} was made with another data plan than {pack / 'plan.json'} says")
    return seqs, meta


def pack_plan(pack: Path) -> dict | None:
    try:
        return json.loads((pack / "plan.json").read_text())
    except (OSError, ValueError):
        return None


def check_pack(folder: DataFolder, pack: Path) -> None:
    """DataError when `pack` already keeps data made under another plan (or for another target): adding this
    folder's shards to it would mix two plans under one plan.json."""
    theirs = pack_plan(pack)
    if theirs is None and (pack / "plan.json").exists():
        raise DataError(f"{pack / 'plan.json'} cannot be read; restore it from the repository (git checkout)")
    if theirs is not None and (theirs.get("target"), theirs.get("fingerprint")) != (folder.target,
                                                                                   folder.plan.fingerprint()):
        raise DataError(f"the pack {pack} keeps data made for {theirs.get('target')!r} under another plan "
                        f"(seed {theirs.get('plan', {}).get('seed')}, {theirs.get('plan', {}).get('magpie_prompts')} "
                        "self-written prompts); give this folder its own pack (--pack) or none (--no-pack)")


def same_plan(folder: DataFolder, pack: Path, log: Log) -> bool:
    """Whether the pack was made under the folder's plan for its target (said in the log when it was not)."""
    theirs = pack_plan(pack)
    if theirs is None:
        return False
    if (theirs.get("target"), theirs.get("fingerprint")) != (folder.target, folder.plan.fingerprint()):
        log(f"pack: {pack} was made for {theirs.get('target')!r} under another plan; not used")
        return False
    return True


def restore(folder: DataFolder, pack: Path, fused: FusedLlama, log: Log, deadline: float | None = None,
            bf16: bool = False, rebuild: bool = True) -> int:
    """Rebuild into `folder` every packed shard it lacks (and its frozen prompts), when the pack was made under
    the same plan for the same target. `bf16` multiplies in bfloat16 (`Bf16Weights`; faster where the CPU has
    AMX, and not the fp32 arithmetic: each shard's sidecar says so); `rebuild=False` brings the frozen prompts
    only. Returns the number of shards rebuilt."""
    import time

    if not same_plan(folder, pack, log):
        return 0
    for name in ("prompts.json", "command.txt"):
        if not (folder.root / name).exists() and (pack / name).exists():
            write_atomic(folder.root / name, (pack / name).read_text())
    if not rebuild:
        return 0
    entries = sorted((pack / "answers").glob("shard-p*-*.npz"))
    fingerprint, rebuilt, t0 = folder.plan.fingerprint(), 0, time.time()
    weights = Bf16Weights.of(fused) if bf16 else None
    for entry in entries:
        shard = folder.root / "answers" / (entry.stem + ".pt")
        if shard_info(shard, fingerprint) is not None:
            continue
        if deadline is not None and time.time() > deadline:
            log("pack: stopping at the deadline; rerun to rebuild the rest")
            break
        seqs, meta = read_planned(entry, fingerprint, pack)
        save_shard(shard, replay(fused, seqs, folder.plan, replay_rows(fused), weights),
                   {**meta, "replayed": "bfloat16"} if bf16 else meta)
        rebuilt += 1
        tokens = sum(ids.numel() for ids, _ in seqs)
        log(f"pack: rebuilt {shard.name} ({len(seqs)} sequences, {tokens:,} tokens; {rebuilt}/{len(entries)} "
            f"in {time.time() - t0:.0f} s)")
    return rebuilt


def packed_tokens(folder: DataFolder, pack: Path, log: Log) -> dict[str, int]:
    """{shard name: tokens} of every entry in the pack, each read whole (a damaged one is refused with its path,
    one of another plan too): what a run that answers without rebuilding counts as held."""
    if not same_plan(folder, pack, log):
        return {}
    fingerprint, held = folder.plan.fingerprint(), {}
    for entry in sorted((pack / "answers").glob("shard-p*-*.npz")):
        seqs, _ = read_planned(entry, fingerprint, pack)
        held[entry.stem] = sum(ids.numel() for ids, _ in seqs)
    return held


# -- teacher forcing ----------------------------------------------------------------------------------------
@torch.inference_mode()
def replay(fused: FusedLlama, seqs: Sequence[tuple[torch.Tensor, int]], plan: Eagle3DataPlan,
           rows: int = REPLAY_ROWS, weights: Bf16Weights | None = None) -> list[Example]:
    """The examples of whole sequences ((ids, prompt_len) each), as `answer_batch` makes them while decoding:
    the taps' inputs at every position but the last, and the top-k next-token log-probabilities at every
    answer position. Sequences of similar length are fed together, right-padded. With `weights`, every
    product is theirs (bfloat16) instead of the fused model's fp32 one. The model may sit on a GPU; the
    examples are always on the CPU."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][0].numel())
    out: dict[int, Example] = {}
    for start in range(0, len(order), rows):
        batch = order[start: start + rows]
        for i, example in zip(batch, _replay_batch(fused, [seqs[i] for i in batch], plan, weights)):
            out[i] = example
    return [out[i] for i in range(len(seqs))]


def _replay_batch(fused: FusedLlama, seqs: Sequence[tuple[torch.Tensor, int]], plan: Eagle3DataPlan,
                  weights: Bf16Weights | None = None) -> list[Example]:
    width = max(ids.numel() for ids, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    real = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (s, _) in enumerate(seqs):
        ids[row, : s.numel()] = s.long()
        real[row, : s.numel()] = True
    batch = BatchForward(fused, len(seqs), width, plan.layers, weights.linear if weights is not None else None)
    features, taps = batch.forward_features(ids.to(fused.device), real.to(fused.device))
    stacked = torch.stack(taps, dim=2) if taps else torch.zeros(len(seqs), width, 0, features.shape[-1])
    examples = []
    for row, (s, prompt_len) in enumerate(seqs):
        n = s.numel()
        logp, top = torch.log_softmax(batch.logits_of(features[row, prompt_len - 1: n - 1]), dim=-1).topk(plan.top_k)
        examples.append(Example(s.to(torch.int32), prompt_len, stacked[row, : n - 1].to("cpu", torch.float16).clone(),
                                top.to("cpu", torch.int32), logp.to("cpu", torch.float16)))
    return examples

"""Training an EAGLE-style head on the target's own outputs: `python -m engine train-draft --target ...`.

Data (engine.train.draft_data): the target answers the training prompts, greedily and sampled, and its
post-norm features are kept beside the tokens. The head learns to predict the next feature, judged by
the distribution the target's head makes of it (soft cross-entropy over the pruned vocabulary, plus a
small regression on the feature itself).

Training-time test (as EAGLE-3 does): a drafted chain reads the head's own predictions after its first
step, so training unrolls `depth` steps. Step s feeds, at position t, the token x_t and the step s-1
prediction of f_{t-1}; its query attends to what a real chain started at c = t - s + 1 would see: the
keys of positions <= c computed from real features (step 1), and the keys of its own chain at
c+1 .. t (steps 2 .. s). Every step is judged against the target's distribution at t.

Resumable: a checkpoint (head, optimiser, step, order) is written every couple of minutes; rerunning the
command continues from it. The export lands in assets/eagle/<target>/ with a model card.
"""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.drafters.eagle import EagleConfig, EagleHead, save_head
from engine.models import LoadedModel
from engine.train.draft_data import Sequence, iter_shards, load_shard


@dataclass(frozen=True, slots=True)
class EaglePlan:
    kept: int = 8192                 # pruned vocabulary: the most frequent answer tokens
    depth: int = 3                   # training-time-test steps
    step_weights: tuple[float, ...] = (1.0, 0.8, 0.65, 0.5)
    feature_weight: float = 0.1      # smooth-L1 on step 1's feature, beside the soft cross-entropy
    noise: float = 0.05              # Gaussian noise on the real input features, relative to their std
    lr: float = 1e-3
    warmup: int = 50
    epochs: float = 3.0
    accumulate: int = 4              # sequences per optimiser step
    max_len: int = 320               # longer sequences are cut (prompt + answer)
    heldout_fraction: float = 0.03
    seed: int = 0
    checkpoint_every_s: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= len(self.step_weights):
            raise ValueError(f"depth must be in 1..{len(self.step_weights)}, got {self.depth}")
        if self.kept < 16 or self.epochs <= 0 or self.accumulate < 1:
            raise ValueError("need kept >= 16, epochs > 0 and accumulate >= 1")


def kept_vocabulary(sequences: list[Sequence], size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent answer tokens (ties by id), plus `always` (e.g. end of turn), sorted by id."""
    counts = torch.zeros(int(max(int(s.ids.max()) for s in sequences)) + 1, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s.ids[s.prompt_len:].long(), minlength=counts.numel())
    order = sorted(range(counts.numel()), key=lambda t: (-int(counts[t]), t))
    chosen = set(always) | {t for t in order[:size] if counts[t] > 0}
    return torch.tensor(sorted(chosen)[: max(size, len(always))], dtype=torch.long)


@dataclass
class Batch:
    """One sequence prepared for a step: ids, real features, the target's kept-vocabulary distributions."""

    ids: torch.Tensor        # [L] long
    feats: torch.Tensor      # [L - 1, d] float32, f_0 .. f_{L-2}
    p_kept: torch.Tensor     # [L - 1, kept] float32: softmax over the kept slice of the target's head
    loss_from: int           # first position t whose prediction (of x_{t+1}) is an answer token


def prepare(seq: Sequence, head_kept: torch.Tensor, max_len: int) -> Batch:
    ids = seq.ids[:max_len].long()
    feats = seq.features[: len(ids) - 1].float()
    with torch.no_grad():
        p_kept = torch.softmax(F.linear(feats, head_kept), dim=-1)
    return Batch(ids, feats, p_kept, max(1, seq.prompt_len - 1))


def ttt_mask(n: int, step: int) -> torch.Tensor:
    """[n, step * n] bool: which keys position t (row t - 1, for t = 1..n) sees at unroll step `step`.

    Key block j (0-based) holds step j+1's keys for positions 1..n. The chain of position t started at
    c = t - step + 1: it sees step 1's keys at positions <= c, and step j+1's key at position c + j."""
    t = torch.arange(1, n + 1)[:, None]
    u = torch.arange(1, n + 1)[None, :]
    c = (t - step + 1).clamp(min=1)
    blocks = [u <= c] + [u == c + j for j in range(1, step)]
    return torch.cat(blocks, dim=1)


def rope_tables(head_dim: int, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) rotary cos/sin [len, head_dim] at `positions`, as Llama computes them."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def target_rope(target: LoadedModel, head_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's rotary cos/sin [length, head_dim] at positions 0..length - 1 (its own theta)."""
    config = target.model.config
    theta = float(getattr(config, "rope_parameters", {}).get("rope_theta", None)
                  or getattr(config, "rope_theta", 10000.0))
    return rope_tables(head_dim, theta, torch.arange(length))


def unrolled_loss(head: EagleHead, batch: Batch, embed: torch.Tensor, head_kept: torch.Tensor, plan: EaglePlan,
                  cos: torch.Tensor, sin: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, list[float]]:
    """The plan's weighted loss over `depth` unrolled steps, and each step's top-1 agreement with the target."""
    ids, feats = batch.ids, batch.feats
    n = len(ids) - 1                       # draft positions 1..L-1
    emb = F.embedding(ids[1:], embed)[None]
    layer = head.layer()
    noise = torch.randn(feats.shape, generator=gen) * feats.std() * plan.noise
    inputs = (feats + noise)[None]         # step 1 reads real f_{t-1} for t = 1..n
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    targets = batch.p_kept[1:]             # position t (t = 1..n-1) predicts x_{t+1} ~ p_t
    valid = torch.arange(1, n) >= batch.loss_from
    total, agree = torch.zeros(()), []
    for step in range(1, plan.depth + 1):
        def keys_values(ks, vs):
            keys.append(ks)
            values.append(vs)
            return torch.cat(keys, dim=2), torch.cat(values, dim=2)
        out = head.step(emb, inputs, layer, keys_values, cos[None, None], sin[None, None], ttt_mask(n, step))
        pred = out[0, :-1]                 # f^_t for t = 1..n-1 (position n has no target feature)
        rows = valid & (torch.arange(1, n) >= step)
        if rows.any():
            logq = torch.log_softmax(F.linear(pred[rows], head_kept), dim=-1)
            ce = -(targets[rows] * logq).sum(-1).mean()
            loss = ce
            if step == 1:
                loss = loss + plan.feature_weight * F.smooth_l1_loss(pred[rows], feats[1:][rows])
            total = total + plan.step_weights[step - 1] * loss
            agree.append(float((logq.argmax(-1) == targets[rows].argmax(-1)).float().mean()))
        else:
            agree.append(math.nan)
        # the next step reads this step's prediction of f_{t-1} at position t
        inputs = torch.cat([inputs[:, :1], out[:, :-1]], dim=1)
    return total / sum(plan.step_weights[: plan.depth]), agree


@dataclass
class TrainState:
    step: int = 0
    seen: int = 0
    order: list[int] = field(default_factory=list)
    log: list[dict] = field(default_factory=list)


def train(target: LoadedModel, data: Path, work: Path, out: Path, plan: EaglePlan = EaglePlan(),
          log=print, deadline: float | None = None) -> dict:
    """Train (or resume) the head on every shard under `data`; export to `out`; return the training log."""
    sequences = [s for path in iter_shards(data) for s in load_shard(path)]
    if not sequences:
        raise ValueError(f"no training data under {data}: generate it first")
    rng = random.Random(plan.seed)
    index = list(range(len(sequences)))
    rng.shuffle(index)
    n_held = max(1, int(len(index) * plan.heldout_fraction))
    heldout, train_ids = index[:n_held], index[n_held:]
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "checkpoint.pt"
    eos = target.tokenizer.eos_token_id
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        kept = ckpt["kept"]
        config = EagleConfig(**ckpt["config"])
    else:
        ckpt = None
        kept = kept_vocabulary([sequences[i] for i in train_ids], plan.kept, (eos,) if eos is not None else ())
        config = EagleConfig.for_target(target, len(kept))
    head = EagleHead(config)
    embed = target.model.get_input_embeddings().weight.detach().float()
    head_kept = target.model.get_output_embeddings().weight.detach().float().index_select(0, kept)
    cos_all, sin_all = target_rope(target, config.head_dim, plan.max_len + 1)
    opt = torch.optim.AdamW(head.parameters(), lr=plan.lr, weight_decay=0.0, betas=(0.9, 0.95))
    state = TrainState()
    if ckpt is None:
        head.init_for_training(torch.Generator().manual_seed(plan.seed))
    else:
        head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["opt"])
        state = TrainState(**ckpt["state"])
        log(f"resumed at step {state.step} ({state.seen} sequences seen)")
    total_steps = math.ceil(plan.epochs * len(train_ids) / plan.accumulate)
    gen = torch.Generator().manual_seed(plan.seed + state.step)

    def lr_at(step: int) -> float:
        if step < plan.warmup:
            return plan.lr * (step + 1) / plan.warmup
        return plan.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - plan.warmup) / max(1, total_steps - plan.warmup))))

    def save() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": asdict(state), "kept": kept,
                    "config": asdict(config), "plan": asdict(plan)}, tmp)
        tmp.replace(ckpt_path)

    def evaluate() -> dict:
        head.eval()
        losses, agree = [], []
        with torch.no_grad():
            for i in heldout:
                b = prepare(sequences[i], head_kept, plan.max_len)
                n = len(b.ids) - 1
                loss, a = unrolled_loss(head, b, embed, head_kept, EaglePlan(**{**asdict(plan), "noise": 0.0}),
                                        cos_all[1:n + 1], sin_all[1:n + 1], gen)
                losses.append(float(loss))
                agree.append(a)
        head.train()
        per_step = [sum(a[s] for a in agree if not math.isnan(a[s])) / max(1, sum(not math.isnan(a[s]) for a in agree))
                    for s in range(plan.depth)]
        return {"heldout_loss": sum(losses) / len(losses), "heldout_top1_by_step": per_step}

    t0, last_save, last_log = time.time(), time.time(), time.time()
    running, running_agree = [], []
    head.train()
    while state.step < total_steps:
        if deadline is not None and time.time() > deadline:
            save()
            log(f"stopping at the deadline at step {state.step}; rerun to resume")
            return {"finished": False, "state": asdict(state)}
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step)
        opt.zero_grad(set_to_none=True)
        for _ in range(plan.accumulate):
            if not state.order:
                state.order = train_ids[:]
                random.Random(plan.seed + state.seen).shuffle(state.order)
            b = prepare(sequences[state.order.pop()], head_kept, plan.max_len)
            n = len(b.ids) - 1
            loss, agree = unrolled_loss(head, b, embed, head_kept, plan, cos_all[1:n + 1], sin_all[1:n + 1], gen)
            (loss / plan.accumulate).backward()
            running.append(float(loss.detach()))
            running_agree.append(agree)
            state.seen += 1
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        state.step += 1
        if time.time() - last_log > 60 or state.step == total_steps:
            per_step = [sum(a[s] for a in running_agree if not math.isnan(a[s])) / max(1, len(running_agree))
                        for s in range(plan.depth)]
            rate = state.seen / max(time.time() - t0, 1e-9)
            log(f"step {state.step}/{total_steps}: loss {sum(running) / len(running):.3f}, top-1 by step "
                + " ".join(f"{a:.2f}" for a in per_step) + f", {rate:.2f} seq/s")
            state.log.append({"step": state.step, "loss": sum(running) / len(running), "top1": per_step,
                              "time": time.time()})
            running, running_agree, last_log = [], [], time.time()
        if time.time() - last_save > plan.checkpoint_every_s:
            save()
            last_save = time.time()
    save()
    figures = evaluate()
    log(f"held-out (training distribution, {len(heldout)} sequences): loss {figures['heldout_loss']:.3f}, "
        "top-1 by step " + " ".join(f"{a:.2f}" for a in figures["heldout_top1_by_step"]))
    meta = {"plan": asdict(plan), "params": sum(p.numel() for p in head.parameters()),
            "sequences": len(sequences), "train_sequences": len(train_ids),
            "tokens": sum(len(s.ids) for s in sequences), "steps": state.step, "kept": len(kept), **figures,
            "log": state.log}
    save_head(head, kept, out, meta)
    log(f"wrote {out}")
    return {"finished": True, **meta}


if __name__ == "__main__":  # a development entry; the command is `python -m engine train-draft`
    sys.exit("run: python -m engine train-draft --help")

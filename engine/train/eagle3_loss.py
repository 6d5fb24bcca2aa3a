"""What an EAGLE-3-style head is trained against: the fused target layers it reads, its training-time test (the
head unrolled over `depth` drafting steps as the engine's chain would run it) and the soft-label loss over them."""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from engine.drafters.eagle import EagleHead
from engine.models import LoadedModel
from engine.train.eagle import ttt_mask
from engine.train.eagle3_batch import Batch
from engine.train.eagle3_plan import Eagle3Plan


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


def agreement_by_step(agree: list[list[float]], depth: int) -> list[float]:
    """Each unrolled step's top-1 agreement over batches (unrolled_loss's second value, one list a batch): the mean
    over the batches that had a position at that step (NaN where one had none)."""
    return [sum(a[s] for a in agree if not math.isnan(a[s])) / max(1, sum(not math.isnan(a[s]) for a in agree))
            for s in range(depth)]

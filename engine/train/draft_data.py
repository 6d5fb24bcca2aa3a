"""Self-distillation data for a feature drafter: the target answers training prompts, and its own final
hidden states (post-norm, the features an EAGLE-style drafter reads) are kept beside the tokens.

Generation runs in batches through `generate` (on a CPU a batch of 64 costs little more per step than
one sequence, because a decode step is dominated by streaming the weights). The features are caught
on the way with a forward hook on the model's final norm, so no second forward is needed: the
prefill step yields the prompt's rows, and every decode step one row per sequence. The feature of a
sequence's last token is never computed (nothing is fed after it) and is not needed: the feature at
t is the input that predicts t + 1.

Each batch becomes one shard file, written to a temporary name and renamed when whole, so a killed
run resumes at the next missing shard and never reads half a shard.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class SamplingPass:
    """One pass over the prompts: greedy (temperature 0) or sampled."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def label(self) -> str:
        return "greedy" if self.temperature == 0 else f"T{self.temperature:g}-p{self.top_p:g}"


@dataclass(frozen=True, slots=True)
class DataPlan:
    passes: tuple[SamplingPass, ...] = field(default_factory=lambda: (SamplingPass(), SamplingPass(0.7, 0.95)))
    batch: int = 64
    max_new_tokens: int = 192
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch < 1 or self.max_new_tokens < 1:
            raise ValueError(f"batch and max_new_tokens must be >= 1, got {self.batch}, {self.max_new_tokens}")
        if not self.passes:
            raise ValueError("a data plan needs at least one sampling pass")


@dataclass(slots=True)
class Sequence:
    """One training sequence: ids [n] (prompt then answer, cut after EOS) and features [n - 1, d]."""

    ids: torch.Tensor        # int32
    prompt_len: int
    features: torch.Tensor   # float16, row t = the target's post-norm hidden state after ids[: t + 1]


class _FeatureTap:
    """Collects the final norm's outputs of every forward of one `generate` call."""

    def __init__(self, norm: torch.nn.Module) -> None:
        self.chunks: list[torch.Tensor] = []
        self._handle = norm.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self.chunks.append(output.detach().to(torch.float16))

    def close(self) -> None:
        self._handle.remove()


def generate_batch(model, tokenizer, prompts: list[list[int]], sampling: SamplingPass, max_new_tokens: int,
                   eos_id: int, generator_seed: int) -> list[Sequence]:
    """Answer a batch of tokenized prompts; return each prompt + answer with its features."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding: every prompt ends in the last column
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    torch.manual_seed(generator_seed)  # generate draws from the global generator; this is an entry point's job
    tap = _FeatureTap(model.model.norm)
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=sampling.temperature > 0, temperature=sampling.temperature or None,
                                 top_p=sampling.top_p if sampling.temperature > 0 else None, top_k=None,
                                 pad_token_id=pad, eos_token_id=eos_id)
    finally:
        tap.close()
    feats = torch.cat(tap.chunks, dim=1)  # [B, width + steps - 1, d]
    sequences = []
    for row, p in enumerate(prompts):
        answer = out[row, width:].tolist()
        if eos_id in answer:
            answer = answer[: answer.index(eos_id) + 1]
        n = len(p) + len(answer)
        f = feats[row, width - len(p): width - len(p) + n - 1]
        sequences.append(Sequence(torch.tensor(p + answer, dtype=torch.int32), len(p), f.clone()))
    return sequences


def shard_path(work: Path, pass_index: int, batch_index: int) -> Path:
    return work / f"shard-p{pass_index}-{batch_index:05d}.pt"


def save_shard(path: Path, sequences: list[Sequence], meta: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"meta": meta, "ids": [s.ids for s in sequences], "prompt_len": [s.prompt_len for s in sequences],
                "features": [s.features for s in sequences]}, tmp)
    os.replace(tmp, path)


def load_shard(path: Path) -> list[Sequence]:
    data = torch.load(path, weights_only=True)
    return [Sequence(i, n, f) for i, n, f in zip(data["ids"], data["prompt_len"], data["features"])]


def iter_shards(work: Path) -> Iterator[Path]:
    yield from sorted(work.glob("shard-p*-*.pt"))


def build(model, tokenizer, prompts: list[list[int]], plan: DataPlan, work: Path, eos_id: int,
          log: Log = print, deadline: float | None = None) -> int:
    """Write every missing shard of `plan` under `work`; return how many tokens the shards hold.

    Prompts are grouped by length so a batch wastes little padding. Stops early (resumably) at
    `deadline` (a time.time() value)."""
    work.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i: i + plan.batch] for i in range(0, len(order), plan.batch)]
    total = sum(len(b) for b in batches) * len(plan.passes)
    done_seqs, t0, made = 0, time.time(), 0
    for pi, sampling in enumerate(plan.passes):
        for bi, batch in enumerate(batches):
            path = shard_path(work, pi, bi)
            done_seqs += len(batch)
            if path.exists():
                continue
            if deadline is not None and time.time() > deadline:
                log("draft data: stopping at the deadline; rerun to resume")
                return count_tokens(work)
            seqs = generate_batch(model, tokenizer, [prompts[i] for i in batch], sampling, plan.max_new_tokens,
                                  eos_id, plan.seed * 1_000_003 + pi * 10_007 + bi)
            save_shard(path, seqs, {"pass": sampling.label, "prompts": batch})
            made += sum(len(s.ids) - s.prompt_len for s in seqs)
            rate = made / max(time.time() - t0, 1e-9)
            log(f"draft data: {done_seqs}/{total} sequences ({sampling.label}), {rate:.0f} answer tokens/s")
    return count_tokens(work)


def count_tokens(work: Path) -> int:
    return sum(len(s.ids) for path in iter_shards(work) for s in load_shard(path))

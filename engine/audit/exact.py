"""The exact distribution of a prompt's first m sampled tokens under a request's temperature, top-k and top-p,
computed from the model, depth by depth: every prefix likelier than `min_prob` with its probability, the rest
pooled into one tail of known mass; and, for any sequence a server returned, its own probability (zero: the
model with these settings never samples it)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.models import LoadedModel
from engine.sampling import SamplingParams, logits_to_probs

MAX_PREFIXES = 20_000    # prefixes expanded at one depth; beyond, the settings must narrow the support
FRAGILE_MARGIN = 1e-4    # a top-k or top-p edge this close: a server's rounding may put a token on either side
BATCH = 64


class ExactError(ValueError):
    """The distribution cannot be enumerated for these settings; the message says which to change."""


@dataclass(slots=True)
class ExactJoint:
    """P(first d tokens = s) for d = 1..m: `levels[d - 1]` maps each enumerated s (of length d, or shorter where
    it ended at the end token) to its probability; what is not enumerated (prefixes below `min_prob`) is the
    level's tail, of mass 1 - sum. `probability` computes any other sequence's own probability.

    margin: the smallest distance from a sampling edge met while enumerating (top-k: 1 - p_(k+1) / p_(k) of the
    kept and first dropped token; top-p: the mass before the first dropped token minus top_p); 1.0 when no
    filter cut. Below FRAGILE_MARGIN a server computing in another precision may keep another set.
    """

    model: LoadedModel
    prompt: list[int]
    m: int
    params: SamplingParams
    eos: int | None
    min_prob: float
    levels: list[dict[tuple[int, ...], float]] = field(default_factory=list)
    margin: float = 1.0

    def tail(self, depth: int) -> float:
        return max(0.0, 1.0 - sum(self.levels[depth - 1].values()))

    @property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.levels[-1])

    @property
    def probs(self) -> torch.Tensor:
        return torch.tensor(list(self.levels[-1].values()), dtype=torch.float64)

    def probability(self, sequences: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[float]]:
        """For each sequence, P(its first d tokens) for d = 1..len: one batched forward per prefix length."""
        out = {s: [0.0] * len(s) for s in sequences}
        vocab = self.model.vocab_size
        # a prefix holding an id outside the vocabulary has probability 0 from there on: never fed to the model
        valid = {s: next((i for i, t in enumerate(s) if not 0 <= t < vocab), len(s)) for s in sequences}
        for d in range(max(valid.values(), default=0)):
            having = [s for s in sequences if valid[s] > d and (d == 0 or out[s][d - 1] > 0)]
            if not having:
                break
            rows = _next_rows(self.model, self.prompt, [s[:d] for s in having], self.params).probs
            for s, row in zip(having, rows):
                out[s][d] = (out[s][d - 1] if d else 1.0) * float(row[s[d]])
        return out


def floor_for(samples: int) -> float:
    """The enumeration's floor for a sample of `samples`: a prefix less likely than this is expected fewer than
    once, and the test pools such cells anyway."""
    return min(1e-3, 1.0 / samples)


def exact_joint(model: LoadedModel, prompt_ids: list[int], m: int, params: SamplingParams,
                eos_id: int | None = None, min_prob: float = 1e-4, max_prefixes: int = MAX_PREFIXES) -> ExactJoint:
    """Enumerate the first `m` tokens after `prompt_ids`, expanding every prefix at least `min_prob` likely, with
    one batched forward per depth (the model's own transformers forward, as loaded)."""
    if not 1 <= m <= 4:
        raise ExactError(f"the audit enumerates 1 to 4 tokens, got m={m}")
    if params.greedy:
        raise ExactError("a greedy (temperature 0) request has one outcome: audit at a temperature above 0")
    if not 0 < min_prob < 1:
        raise ExactError(f"min_prob must be in (0, 1), got {min_prob}")
    eos = model.tokenizer.eos_token_id if eos_id is None else eos_id
    joint = ExactJoint(model, list(prompt_ids), m, params, eos, min_prob)
    live: dict[tuple[int, ...], float] = {(): 1.0}
    ended: dict[tuple[int, ...], float] = {}
    for _ in range(m):
        if len(live) > max_prefixes:
            raise ExactError(f"more than {max_prefixes} prefixes are likelier than {min_prob:g} under top-k="
                             f"{params.top_k or 'off'} and top-p={params.top_p:g}: set a top-k (5 to 20), a lower "
                             "top-p or fewer tokens")
        prefixes = list(live)
        rows = _next_rows(model, joint.prompt, list(prefixes), params)
        joint.margin = min(joint.margin, _edge_margin(rows.logits, params))
        level = dict(ended)
        grown: dict[tuple[int, ...], float] = {}
        for prefix, row in zip(prefixes, rows.probs):
            mass = live[prefix]
            ids = torch.nonzero(row * mass >= min_prob).flatten().tolist()
            for t in ids:
                child, p = prefix + (t,), mass * float(row[t])
                level[child] = p
                (ended if t == eos else grown)[child] = p
        joint.levels.append(level)
        live = grown
    return joint


@dataclass(frozen=True, slots=True)
class _Rows:
    logits: torch.Tensor   # [N, V] float32
    probs: torch.Tensor    # [N, V] float64, processed


def _next_rows(model: LoadedModel, prompt_ids: list[int], prefixes: list[tuple[int, ...]],
               params: SamplingParams) -> _Rows:
    """The processed next-token rows after prompt + each prefix (prefixes of one length batch together)."""
    logits = torch.empty(len(prefixes), model.vocab_size)
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prefixes):
        by_length.setdefault(len(p), []).append(i)
    for indices in by_length.values():
        for start in range(0, len(indices), BATCH):
            chunk = indices[start:start + BATCH]
            ids = torch.tensor([prompt_ids + list(prefixes[i]) for i in chunk], device=model.device)
            with torch.inference_mode():
                logits[chunk] = model.model(input_ids=ids).logits[:, -1, :].float().cpu()
    return _Rows(logits, logits_to_probs(logits, params).double())


def _edge_margin(logits: torch.Tensor, params: SamplingParams) -> float:
    """The smallest distance from a top-k or top-p edge among these rows (see ExactJoint.margin)."""
    scaled = logits.double() / params.temperature
    v = scaled.shape[1]
    k = params.top_k if 0 < params.top_k < v else v
    margin = 1.0
    if k == v and params.top_p >= 1.0:
        return margin
    top = torch.topk(scaled, min(v, max(k + 1, 2048) if k < v else 2048), dim=-1).values
    if k < v:
        margin = min(margin, float((1 - torch.exp(top[:, k] - top[:, k - 1])).min()))
    if params.top_p < 1.0:
        kept = top[:, :k] if k < v else top
        total = torch.logsumexp(kept if k < v else scaled, dim=-1, keepdim=True)
        probs = torch.exp(kept - total)
        before = torch.cumsum(probs, dim=-1) - probs
        excluded = torch.where(before >= params.top_p, before, torch.full_like(before, math.inf))
        gap = excluded.min(dim=-1).values - params.top_p
        finite = gap[torch.isfinite(gap)]
        if finite.numel():
            margin = min(margin, float(finite.min()))
    return margin

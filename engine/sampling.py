"""Sampling: turning logits into the processed distributions the engine samples from, and sampling them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Uniforms are drawn in float64: the accept test `u < alpha` and inverse-CDF sampling then have
# ~1e-16 resolution, so tiny acceptance probabilities and tiny token masses are still honoured.
UNIFORM_DTYPE = torch.float64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How logits become a distribution.

    temperature: 0 means greedy (one-hot on the argmax); otherwise logits are divided by it.
    top_k: keep only the k most likely tokens (0 = off).
    top_p: nucleus sampling; keep the smallest top set with mass >= top_p (1.0 = off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"Temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"Temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"Top-k must be an int, got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"Top-k must be >= 0 (0 = off), got {self.top_k}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"Top-p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"Top-p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Processed distribution per row: Tensor[N, V] logits -> Tensor[N, V] float32, rows sum to 1.

    Greedy (temperature 0): one-hot on the argmax, ties going to the lowest token id.
    Otherwise: logits / temperature, then top-k (the k largest logits; among equal logits the
    lower ids win, so the kept set is deterministic), then top-p over the top-k-renormalised
    distribution (the smallest set of most likely tokens whose mass reaches top_p, at least one
    token), then renormalise. -inf logits (e.g. padded vocabulary ids) get probability 0.

    The same function processes draft and target rows. Speculative sampling is lossless with
    respect to this *processed* target distribution: the output is distributed as
    logits_to_probs(target_logits, params), not as the raw softmax of the target logits.
    """
    if _nucleus_applies(logits, params):
        module = compiled_module()
        if module is not None:   # top-p alone in one compiled pass a row; the rows it leaves take the path below
            probs, found = module.nucleus_rows(logits, params.temperature, params.top_p)
            if not bool(found.all()):
                probs[~found] = _processed(logits[~found], params)
            return probs
    return _processed(logits, params)


def _processed(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits_to_probs in ATen calls, with its checks: every case, and the definition the compiled top-p follows."""
    row_max = _check_logits(logits)
    if params.greedy:
        return one_hot_rows(row_max.indices, logits.shape[1])
    scaled = logits.float() / params.temperature
    keep = _top_k_top_p_mask(scaled, params)
    probs = torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)
    return probs


def _nucleus_applies(logits: Tensor, params: SamplingParams) -> bool:
    """Whether engine.native's `nucleus_rows` computes these rows: top-p alone at T > 0, float32 [N, V] on the CPU."""
    return (not params.greedy and params.top_p < 1.0 and not 0 < params.top_k < logits.shape[-1]
            and logits.dim() == 2 and logits.shape[1] > 0 and logits.dtype == torch.float32
            and logits.device.type == "cpu")


def compiled_module():
    """engine.native's module where this CPU runs `nucleus_rows`, `sampled_rows` and engine.verify's `chain_verdict`
    (AVX2 and FMA; SPECPLAY_NATIVE=0 turns it off), else None. The module is built on first use, once per machine,
    as a model's first load builds it."""
    from engine import native
    module = native.layers()
    return module if module is not None and module.coded_supported() else None


def _check_logits(logits: Tensor) -> torch.return_types.max:
    """Raise for NaN, +inf or an all -inf row; return the row maxima (values, indices).

    One reduction and one host sync in the normal case: a row's max is NaN if the row holds a NaN
    (torch.max propagates NaN), +inf if it holds +inf, and -inf if every entry is -inf. Indices
    are the first maximal position, so greedy ties go to the lowest id.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    if logits.shape[1] == 0:
        raise ValueError("logits have an empty vocabulary (V = 0)")
    row_max = logits.max(dim=-1)
    if not bool(torch.isfinite(row_max.values).all()):
        if torch.isnan(logits).any() or torch.isposinf(logits).any():
            raise ValueError("logits contain NaN or +inf")
        raise ValueError("a logits row is entirely -inf: no token can be sampled")
    return row_max


def greedy_ids(logits: Tensor) -> Tensor:
    """Tensor[N] long: each row's argmax (lowest id on ties), after the checks logits_to_probs makes.
    `one_hot_rows(greedy_ids(x), V)` is `logits_to_probs(x, greedy)`, without the [N, V] rows
    until they are needed."""
    return _check_logits(logits).indices


def one_hot_rows(ids: Tensor, v: int) -> Tensor:
    """Tensor[N, v] float32: the greedy distributions with all mass on `ids` (Tensor[N] long)."""
    return torch.zeros(ids.shape[0], v, device=ids.device).scatter_(1, ids.unsqueeze(-1), 1.0)


# Top-p looks for its nucleus among each row's 64 largest logits, then 1024 (top-k among its k); a row
# whose nucleus is wider still, or whose set reaches a tie across its candidates' edge, takes the full sort.
NUCLEUS_CANDIDATES = (64, 1024)


def _top_k_top_p_mask(scaled: Tensor, params: SamplingParams) -> Tensor:
    """Bool Tensor[N, V]: which tokens survive top-k then top-p (all True when both are off).

    The rule is the full stable sort's (`_mask_by_sorting`); a partial sort of each row's largest
    logits finds the same set without sorting the vocabulary when the set lies among them: they are
    a prefix of the stable order when the last one is strictly above the next logit, and top-p's
    nucleus closes inside them when their mass reaches top_p. (The masses are summed in another
    order than the full sort's, so a token whose mass-before sits within float rounding of top_p
    may fall on the other side.)
    """
    v = scaled.shape[1]
    use_k = 0 < params.top_k < v
    if not use_k and params.top_p >= 1.0:
        return torch.ones_like(scaled, dtype=torch.bool)
    mask = torch.zeros_like(scaled, dtype=torch.bool)
    rows = torch.arange(scaled.shape[0], device=scaled.device)
    for c in ((params.top_k,) if use_k else NUCLEUS_CANDIDATES):
        if c + 1 >= v or rows.numel() == 0:
            break
        every = rows.numel() == scaled.shape[0]
        part = scaled if every else scaled[rows]
        found, keep, ids = _mask_among_largest(part, c, params, use_k)
        if every and bool(found.all()):   # the usual case: each row's set among its candidates, no row copied
            return mask.scatter_(1, ids, keep)
        mask[rows[found]] = torch.zeros_like(part[found], dtype=torch.bool).scatter(1, ids[found], keep[found])
        rows = rows[~found]
    if rows.numel():
        mask[rows] = _mask_by_sorting(scaled[rows], params)
    return mask


def _mask_among_largest(scaled: Tensor, c: int, params: SamplingParams,
                        use_k: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(found [N] bool: the row's set lies among its c largest logits, keep [N, c], ids [N, c])."""
    top = torch.topk(scaled, c + 1, dim=-1)
    found = top.values[:, c - 1] > top.values[:, c]          # no tie across the candidates' edge
    # ids ascending, then a stable descending sort: the full stable order restricted to the candidates
    ids = torch.sort(top.indices[:, :c], dim=-1).values
    ids = ids.gather(1, torch.sort(scaled.gather(1, ids), dim=-1, descending=True, stable=True).indices)
    keep = torch.ones(ids.shape, dtype=torch.bool, device=scaled.device)
    if params.top_p < 1.0:
        values = scaled.gather(1, ids)
        total = values.logsumexp(-1, keepdim=True) if use_k else _log_total(scaled, top.values[:, :1])
        probs = torch.exp(values - total)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = mass_before < params.top_p
        if not use_k:  # the nucleus must close inside the candidates; then a tie across their edge matters
            # only if it is kept: a nucleus of logits all above the first one left out is ordered among them
            lowest_kept = values.masked_fill(~keep, math.inf).amin(dim=-1)
            found = (found | (lowest_kept > top.values[:, c])) & ((mass_before[:, -1] + probs[:, -1]) >= params.top_p)
    return found, keep, ids


def _log_total(scaled: Tensor, largest: Tensor) -> Tensor:
    """Tensor[N, 1] float64: log of each row's sum of exp(scaled), given the row maxima [N, 1]. Each term is
    exp(x - max) in float32 with x - max held at -87 or above, summed pairwise in float32 (within a few units of
    float32 rounding of the float64 sum). At a low temperature most of a row's exponents fall below float32's
    normal range, where exp slows several-fold; held at e^-87 (1.6e-38) they stay normal and add under 1e-33 to a
    sum of at least 1. logsumexp in float64 cost 0.37 ms a row of SmolLM2's 49,152 logits, and several times that
    for a verify's rows together."""
    terms = torch.exp((scaled - largest).clamp_min_(-87.0))
    return largest.double() + terms.sum(-1, keepdim=True).double().log()


def _mask_by_sorting(scaled: Tensor, params: SamplingParams) -> Tensor:
    """`_top_k_top_p_mask` by a stable sort of every row (the definition the fast path reproduces)."""
    use_k = 0 < params.top_k < scaled.shape[1]
    # A stable descending sort puts equal logits in ascending id order: ties keep the lower ids.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    keep_sorted = torch.ones_like(sorted_logits, dtype=torch.bool)
    if use_k:
        keep_sorted[:, params.top_k :] = False
    if params.top_p < 1.0:
        probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, -math.inf), dim=-1)
        # Keep token j iff the mass strictly before it is < top_p: this is the smallest prefix
        # whose cumulative mass reaches top_p, and j = 0 (mass before = 0) is always kept.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep_sorted &= mass_before < params.top_p
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


NO_MASS = "a probability row has no positive mass; nothing can be sampled"


def sample_from(probs: Tensor, u: Tensor, *, check_mass: bool = True) -> Tensor:
    """Inverse-CDF sampling: Tensor[N, V] (non-negative, any positive total) and uniforms
    Tensor[N] in [0, 1) -> token ids Tensor[N] long, one per row.

    Row n returns the first token whose cumulative mass exceeds u[n] * total[n]. Rows need not
    be normalised. The result always has nonzero probability: zero-mass tokens never strictly
    raise the CDF, and the rounding edge u * total == total is clamped to the row's last
    nonzero token. Passing the uniforms explicitly makes every path reproducible from the
    generator state. check_mass=True raises ValueError for a row with no positive mass (one
    host sync); with False such a row silently returns its last token.
    """
    if u.dim() != 1 or (probs.dim() == 2 and u.shape[0] != probs.shape[0]):
        raise ValueError(f"u must have shape [N] = [{probs.shape[0]}], got {tuple(u.shape)}")
    return sample_many(probs, u.unsqueeze(-1), check_mass=check_mass).squeeze(-1)


def sample_many(probs: Tensor, u: Tensor, *, check_mass: bool = True) -> Tensor:
    """T independent inverse-CDF samples per row: Tensor[N, V] and uniforms Tensor[N, T] ->
    Tensor[N, T] long. Same rule and guarantees as `sample_from` (which is the T = 1 case).
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be 2-D [N, V], got shape {tuple(probs.shape)}")
    if u.dim() != 2 or u.shape[0] != probs.shape[0]:
        raise ValueError(f"u must have shape [{probs.shape[0]}, T], got {tuple(u.shape)}")
    if probs.device.type == "cpu" and probs.dtype in (torch.float32, torch.float64) and probs.shape[1] > 0:
        module = compiled_module()
        if module is not None:   # the same sums, over the positive tokens only (engine/native/nucleus.cpp)
            ids, positive = module.sampled_rows(probs, u.to(device="cpu", dtype=torch.float64))
            if check_mass and not bool(positive.all()):
                raise ValueError(NO_MASS)
            return ids
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    total = cdf[:, -1:]
    if check_mass and not bool((total > 0).all()):
        raise ValueError(NO_MASS)
    target = u.to(device=cdf.device, dtype=torch.float64) * total
    ids = torch.searchsorted(cdf, target, right=True)
    return torch.minimum(ids, _last_nonzero(probs).unsqueeze(-1))


def _last_nonzero(probs: Tensor) -> Tensor:
    """Tensor[N] long: the highest id with positive probability in each row (V-1 if none)."""
    v = probs.shape[1]
    return v - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.uint8), dim=-1)


def draw_uniform(n: int, generator: torch.Generator | None, device: torch.device | str | None = None) -> Tensor:
    """Tensor[n] float64 of uniforms in [0, 1) from `generator` (which must live on `device`).

    Consumes exactly n draws, so callers can keep different code paths in random lockstep.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return torch.rand(n, generator=generator, device=device, dtype=UNIFORM_DTYPE)

"""Verification: one speculative round's rejection-sampling maths, plus vocabulary alignment.

Given K drafted tokens with the draft's rows q_draft[K, V] and the target's rows p_target[K+1, V]
(from one target forward over the prefix and the K drafts), accept draft i with probability
min(1, p/q); at the first rejection emit a correction sampled from normalize(max(0, p_i - q_i));
if all K are accepted emit a bonus sampled from p_target[K]. The emitted tokens are then
distributed exactly as the target would have sampled them (Leviathan et al. 2023, Chen et al. 2023).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine import sampling
from engine.records import Outcome
from engine.sampling import draw_uniform, sample_from

# How far a probability row's sum may stray from 1 before `verify` refuses it. Loose enough for
# float32/bfloat16 softmax rounding over ~150k-token vocabularies, tight enough that an
# unnormalised row (or logits passed by mistake) is caught.
ROW_SUM_TOL = 1e-3


@dataclass(frozen=True, slots=True)
class PositionVerdict:
    """The accept test of one drafted token: accepted iff u < alpha = min(1, p_target/q_draft). `index` is its
    position in a chain, or its node in a tree (Verdict.tested)."""

    index: int
    token: int
    p_target: float
    q_draft: float
    alpha: float
    u: float
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one round's verification decided, for a chain of drafts or a tree of them.

    path: the accepted drafts: positions 0..n-1 of a chain, node indices of a tree (the root's child first).
    tokens: their tokens followed by the final token (correction or bonus); len = accepted_count + 1.
    tested: one verdict per accept test that ran, in order: a chain's ACCEPTED..., then REJECTED if there was
        a rejection; a tree's every tested child, siblings after a rejection included.
    final_row: the p_target row the final token came from (a chain: the rejection index, or K for a bonus;
        a tree: the node whose children were all rejected, or the accepted leaf).
    final_u: the uniform used to sample the final token.
    residual: Tensor[V] CPU float32, the normalised distribution a correction came from; None for a bonus.
    """

    path: list[int]
    tokens: list[int]
    tested: list[PositionVerdict]
    final_token: int
    final_outcome: Outcome
    final_row: int
    final_u: float
    residual: Tensor | None

    @property
    def accepted_count(self) -> int:
        return len(self.path)

    @property
    def rejected(self) -> bool:
        return self.final_outcome is Outcome.CORRECTED

    @property
    def depths_verified(self) -> int:
        """Depths (chain positions) whose drafts were tested: the accepted ones, plus one if a correction ended
        the round. A chain's K if all were accepted, else the rejection index + 1."""
        return len(self.path) + (1 if self.rejected else 0)


def verify(
    q_draft: Tensor,
    p_target: Tensor,
    draft_tokens: Sequence[int] | Tensor,
    generator: torch.Generator | None = None,
    *,
    validate: bool = True,
) -> Verdict:
    """Run one round's accept/reject walk, vectorised over positions.

    q_draft: Tensor[K, V], the draft's processed distribution at each drafted position.
    p_target: Tensor[K+1, V], the target's processed distribution at the same positions plus one.
    draft_tokens: K ids, draft_tokens[i] drawn from q_draft[i].
    generator: source of randomness; exactly K uniforms (accept tests) then exactly 1 (final
        sample) are drawn, whatever the outcome, so every code path consumes the same stream.
        Uniforms are drawn on the generator's device and moved to p_target's device.
    validate: check the input contract (shapes, finite non-negative rows summing to 1 within
        ROW_SUM_TOL, ids in range; costs host syncs). A zero-mass residual is always an error.

    Host syncs: one transfer of the round's scalars at the end; none per position.
    """
    tokens = _as_token_tensor(draft_tokens, p_target.device)
    if validate:
        _validate(q_draft, p_target, tokens)
    k = q_draft.shape[0]
    u_accept, u_final = _draw_round_uniforms(k, generator, p_target.device)
    module = _native(q_draft, p_target)
    if module is not None:   # the same arithmetic in one call (engine/native/nucleus.cpp)
        scalars, final_dist = module.chain_verdict(q_draft, p_target, tokens, torch.cat([u_accept, u_final]))
        return _build_result(scalars.tolist(), final_dist, k)
    p_tok, q_tok = _token_probs(q_draft, p_target, tokens)
    alpha = acceptance_probability(p_tok, q_tok)
    accepted = u_accept < alpha  # strict: alpha = 0 never accepts, alpha = 1 always does (u < 1)
    # Leading run of accepts: cumprod turns everything after the first rejection into 0.
    n_accepted = torch.cumprod(accepted.to(torch.int64), dim=0).sum().view(1)
    final_dist = _final_distribution(q_draft, p_target, n_accepted)
    final_token = sample_from(final_dist.unsqueeze(0), u_final, check_mass=False)
    # One host transfer for the whole round: [tokens, p, q, alpha, u (K each), u_final, n, final, mass].
    scalars = torch.cat(
        [tokens.double(), p_tok, q_tok, alpha, u_accept, u_final]
        + [n_accepted.double(), final_token.double(), final_dist.sum().view(1)]
    ).tolist()
    return _build_result(scalars, final_dist, k)


def verify_greedy(
    draft_tokens: Sequence[int],
    target_ids: Sequence[int],
    vocab_size: int,
    generator: torch.Generator | None = None,
) -> Verdict:
    """`verify` for greedy rows, from the row argmaxes alone: the same result, draws and record.

    With temperature 0 every processed row is one-hot, so for draft i: q = 1, p = 1 if it is the
    target's argmax target_ids[i] else 0, alpha = p, and u < alpha accepts exactly the matches. The
    residual at a rejection is max(0, p - q) = the target's one-hot, so the correction is its
    argmax, as is the bonus from row K. The K + 1 uniforms are still drawn, so a greedy run's
    random stream matches `verify`'s. Skipping the [K+1, V] arithmetic matters on CPU, where it
    runs cold right after the verify forward has swept the caches.

    draft_tokens: K ids; target_ids: K + 1 argmaxes (`sampling.greedy_ids` of the verify logits).
    """
    k = len(draft_tokens)
    if len(target_ids) != k + 1:
        raise ValueError(f"need K + 1 = {k + 1} target argmaxes for K = {k} drafts, got {len(target_ids)}")
    u_accept, u_final = _draw_round_uniforms(k, generator, torch.device("cpu"))
    u = u_accept.tolist()
    n = 0
    while n < k and draft_tokens[n] == target_ids[n]:
        n += 1
    checked = n + 1 if n < k else k
    positions = [PositionVerdict(i, int(draft_tokens[i]), float(i < n), 1.0, float(i < n), u[i],
                                 Outcome.ACCEPTED if i < n else Outcome.REJECTED) for i in range(checked)]
    final = int(target_ids[n])
    rejected = n < k
    residual = torch.zeros(vocab_size).index_fill_(0, torch.tensor([final]), 1.0) if rejected else None
    return Verdict(path=list(range(n)), tokens=[int(t) for t in draft_tokens[:n]] + [final], tested=positions,
                   final_token=final, final_outcome=Outcome.CORRECTED if rejected else Outcome.BONUS, final_row=n,
                   final_u=float(u_final[0]), residual=residual)


def verify_reference(
    q_draft: Tensor,
    p_target: Tensor,
    draft_tokens: Sequence[int] | Tensor,
    generator: torch.Generator | None = None,
    *,
    validate: bool = True,
) -> Verdict:
    """The textbook per-position loop; same contract and same random consumption as `verify`.

    Kept for tests (the vectorised version must match it exactly for the same generator state)
    and for reading: this is the algorithm.
    """
    tokens = _as_token_tensor(draft_tokens, p_target.device)
    if validate:
        _validate(q_draft, p_target, tokens)
    k = q_draft.shape[0]
    u_accept, u_final = _draw_round_uniforms(k, generator, p_target.device)
    positions: list[PositionVerdict] = []
    for i, token in enumerate(tokens.tolist()):
        p_i = p_target[i, token].double()
        q_i = q_draft[i, token].double()
        alpha = acceptance_probability(p_i, q_i).item()
        u = u_accept[i].item()
        ok = u < alpha
        outcome = Outcome.ACCEPTED if ok else Outcome.REJECTED
        positions.append(PositionVerdict(i, token, p_i.item(), q_i.item(), alpha, u, outcome))
        if not ok:
            return _finish(tokens.tolist(), positions, _residual(p_target[i], q_draft[i]), i, u_final)
    # Row K is the target's distribution after all K drafts: the same verify forward produced it
    # for free, so the round emits one token more than was drafted.
    return _finish(tokens.tolist(), positions, p_target[k].double(), k, u_final)


def _finish(
    tokens: list[int], positions: list[PositionVerdict], dist: Tensor, row: int, u_final: Tensor
) -> Verdict:
    """Reference path's ending: sample the final token from `dist` (unnormalised, float64)."""
    final = int(sample_from(dist.unsqueeze(0), u_final, check_mass=False)[0])
    return _make_result(tokens, positions, final, row, u_final.item(), dist, dist.sum().item())


def _make_result(
    tokens: list[int],
    positions: list[PositionVerdict],
    final: int,
    n_accepted: int,
    u_final: float,
    dist: Tensor,
    mass: float,
) -> Verdict:
    rejected = n_accepted < len(tokens)
    if mass <= 0:
        raise ValueError(_zero_mass_message(n_accepted, rejected))
    return Verdict(
        path=list(range(n_accepted)),
        tokens=tokens[:n_accepted] + [final],
        tested=positions,
        final_token=final,
        final_outcome=Outcome.CORRECTED if rejected else Outcome.BONUS,
        final_row=n_accepted,
        final_u=u_final,
        residual=(dist / mass).to("cpu", torch.float32) if rejected else None,
    )


def _native(q_draft: Tensor, p_target: Tensor):
    """engine.native's module where it computes this round's verdict (float32 rows on a CPU with AVX2 and FMA), else
    None: the ATen path."""
    on_cpu = q_draft.device.type == "cpu" and p_target.device.type == "cpu"
    rows = q_draft.dtype == torch.float32 and p_target.dtype == torch.float32
    return sampling.compiled_module() if on_cpu and rows else None


def acceptance_probability(p_tok: Tensor, q_tok: Tensor) -> Tensor:
    """alpha = min(1, p/q) elementwise, in float64; where q = 0: 1 if p > 0 else 0.

    A token the draft gave zero mass can only appear if the caller chose it some other way
    (e.g. greedy drafting with a sampled target); accepting it iff the target could emit it
    keeps the round well defined.
    """
    p64, q64 = p_tok.double(), q_tok.double()
    ratio = torch.where(q64 > 0, p64 / torch.where(q64 > 0, q64, 1.0), (p64 > 0).double())
    return ratio.clamp(max=1.0)


def _residual(p_row: Tensor, q_row: Tensor) -> Tensor:
    """Unnormalised max(0, p - q), float64.

    Why this shape: a token t is emitted at this position either by acceptance, with probability
    q(t) * min(1, p(t)/q(t)) = min(p(t), q(t)), or by correction. p(t) - min(p(t), q(t)) =
    max(0, p(t) - q(t)) is exactly the mass acceptance leaves missing, and the rejection
    probability 1 - sum_t min(p, q) equals sum_t max(0, p - q), so sampling the normalised
    residual on rejection makes the total exactly p.
    """
    return (p_row.double() - q_row.double()).clamp(min=0.0)


def _final_distribution(q_draft: Tensor, p_target: Tensor, n_accepted: Tensor) -> Tensor:
    """Tensor[V] float64, unnormalised: the residual at row n_accepted if it is < K, else p_target[K].

    Row K is the target's distribution after all K drafts: the single verify forward produced it
    for free, so a fully accepted round emits one token more than was drafted (row K-1 would
    re-sample the last drafted position). Masking the q row to zero at n_accepted = K turns
    "residual" max(0, p_K - 0) into p_K, so no branch (and no host sync) is needed.
    n_accepted: Tensor[1] long on p_target's device.
    """
    k = q_draft.shape[0]
    p_row = p_target.index_select(0, n_accepted)[0]
    q_row = q_draft.index_select(0, n_accepted.clamp(max=k - 1))[0].double() * (n_accepted < k)
    return _residual(p_row, q_row)


def _token_probs(q_draft: Tensor, p_target: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """p_target[i, tokens[i]] and q_draft[i, tokens[i]] for i < K, float64 Tensor[K] each."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return p_target[rows, tokens].double(), q_draft[rows, tokens].double()


def _draw_round_uniforms(k: int, generator: torch.Generator | None, device: torch.device) -> tuple[Tensor, Tensor]:
    """K accept uniforms then 1 final uniform, in that order, always."""
    source = generator.device if generator is not None else device
    return draw_uniform(k, generator, source).to(device), draw_uniform(1, generator, source).to(device)


def _build_result(scalars: list[float], final_dist: Tensor, k: int) -> Verdict:
    """Assemble the record from the one host transfer laid out by `verify`."""
    tokens, p_tok, q_tok, alpha, u = (scalars[j * k : (j + 1) * k] for j in range(5))
    tokens = [int(t) for t in tokens]
    u_final, n_accepted, final, mass = scalars[5 * k : 5 * k + 4]
    n_accepted, final = int(n_accepted), int(final)
    checked = n_accepted + 1 if n_accepted < k else k
    positions = [
        PositionVerdict(
            i, tokens[i], p_tok[i], q_tok[i], alpha[i], u[i], Outcome.ACCEPTED if i < n_accepted else Outcome.REJECTED
        )
        for i in range(checked)
    ]
    return _make_result(tokens, positions, final, n_accepted, u_final, final_dist, mass)


def _zero_mass_message(row: int, rejected: bool) -> str:
    if rejected:
        return (
            f"rejection at position {row} left a residual max(0, p_target - q_draft) with zero mass: "
            "p_target <= q_draft everywhere, so the draft proposed a token it could not have sampled "
            "(q_draft of that token is 0 or the rows are not distributions)"
        )
    return f"p_target row {row} (the bonus row) has zero mass"


def _as_token_tensor(draft_tokens: Sequence[int] | Tensor, device: torch.device) -> Tensor:
    if isinstance(draft_tokens, Tensor):
        if draft_tokens.is_floating_point() or draft_tokens.is_complex():
            raise ValueError(f"draft_tokens must be integer ids, got dtype {draft_tokens.dtype}")
        return draft_tokens.to(device=device, dtype=torch.long)
    return torch.as_tensor(list(draft_tokens), dtype=torch.long, device=device)


def _validate(q_draft: Tensor, p_target: Tensor, tokens: Tensor) -> None:
    """The input contract; each violation is a ValueError that names the problem."""
    if q_draft.dim() != 2 or p_target.dim() != 2:
        raise ValueError(
            f"q_draft and p_target must be 2-D, got shapes {tuple(q_draft.shape)} and {tuple(p_target.shape)}"
        )
    k, v = q_draft.shape
    if k < 1:
        raise ValueError(f"need at least one drafted position (K >= 1), got q_draft shape {tuple(q_draft.shape)}")
    if p_target.shape[0] != k + 1:
        raise ValueError(f"p_target must have K+1 = {k + 1} rows for K = {k} drafts, got shape {tuple(p_target.shape)}")
    if p_target.shape[1] != v:
        raise ValueError(
            f"vocabulary mismatch: q_draft has V = {v}, p_target has V = {p_target.shape[1]} (use align_vocab)"
        )
    if q_draft.device != p_target.device:
        raise ValueError(f"q_draft is on {q_draft.device} but p_target is on {p_target.device} (use align_vocab)")
    if tokens.dim() != 1 or tokens.shape[0] != k:
        raise ValueError(f"expected {k} draft tokens (one per q_draft row), got shape {tuple(tokens.shape)}")
    for name, rows in (("q_draft", q_draft), ("p_target", p_target)):
        _validate_rows(name, rows)
    if bool(((tokens < 0) | (tokens >= v)).any()):
        raise ValueError(f"draft token ids must be in [0, {v}), got {tokens.tolist()}")


def _validate_rows(name: str, rows: Tensor) -> None:
    if not rows.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {rows.dtype}")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError(f"{name} contains NaN or inf")
    if bool((rows < 0).any()):
        raise ValueError(
            f"{name} contains negative probabilities (min {rows.min().item():.3g}); pass probabilities, not logits"
        )
    sums = rows.double().sum(dim=-1)
    bad = (sums - 1.0).abs() > ROW_SUM_TOL
    if bool(bad.any()):
        raise ValueError(
            f"{name} rows must sum to 1 within ROW_SUM_TOL = {ROW_SUM_TOL}; "
            f"row sums are {[round(s, 6) for s in sums.tolist()]}"
        )


def align_vocab(
    x: Tensor,
    vocab_size: int,
    *,
    fill: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Tensor[N, Vd] -> Tensor[N, vocab_size] on `device` with `dtype`: the one place draft and
    target rows are brought to a common vocabulary and device.

    Columns beyond Vd are filled with `fill`; columns beyond vocab_size are dropped. Draft and
    target vocabularies may differ in size (Qwen2.5-0.5B has 151,936 output rows, Qwen2.5-7B
    152,064; the extra rows are padding). Align *logits* before softmax, with fill=-inf: a
    padded id then gets probability exactly 0, so the draft can never propose it, and dropped
    columns simply renormalise through the softmax. Truncating *probabilities* would silently
    lose mass and break the rows-sum-to-1 contract; if probabilities must be aligned, pad with
    fill=0.0 only.
    """
    if x.dim() != 2:
        raise ValueError(f"align_vocab expects a 2-D [N, V] tensor, got shape {tuple(x.shape)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    n, v = x.shape
    # Truncate before moving and pad after, so only the needed columns cross devices.
    out = x[:, :vocab_size].to(device=device or x.device, dtype=dtype or x.dtype)
    if v < vocab_size:
        pad = out.new_full((n, vocab_size - v), fill)
        out = torch.cat([out, pad], dim=1)
    return out

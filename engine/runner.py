"""A model plus its paged KV pool: the one place forwards happen, and where each one is timed."""
from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

import torch

from engine.clock import ForwardTimer, Now
from engine.fused_llama import Segment
from engine.kv_cache import KVPool, PagedCache
from engine.models import LoadedModel


def pool_blocks(capacity: int, block_size: int, sequences: int = 1) -> int:
    """Blocks a pool needs for `sequences` sequences of up to `capacity` tokens each."""
    return sequences * (-(-capacity // block_size))


def pool_bytes(loaded: LoadedModel, capacity: int, block_size: int, sequences: int = 1) -> int:
    """Bytes of the KV pool a ModelRunner allocates for these sizes (what a server must budget)."""
    slots = pool_blocks(capacity, block_size, sequences) * block_size
    return loaded.kv_shape.bytes_per_slot(loaded.dtype) * slots


class ModelRunner:
    """Runs forwards of one model over one sequence's paged cache.

    The pool is sized for `capacity` tokens per sequence times `sequences`. Models are shared and
    read-only; every runner has its own pool, so concurrent sessions never share KV. Forwards use
    the model's fused forward when it has one and `fused=True` (the default), else the transformers
    forward with the paged cache as its `Cache`; `forward_path` says which.

    Every forward's wall time (device time on CUDA, which is synchronised around it) is appended
    to `forward_ms`; the engine drains it once a round into the round's timings.
    """

    def __init__(self, loaded: LoadedModel, capacity: int, block_size: int = 16, sequences: int = 1,
                 num_blocks: int | None = None, fused: bool = True, now: Now = time.perf_counter,
                 pool: KVPool | None = None) -> None:
        """`pool`: a pool shared with other runners of the same model (a batch's sequences), instead of one of
        its own sized from `capacity`, `sequences` and `num_blocks`."""
        self.loaded = loaded
        self.fused = loaded.fused if fused else None
        blocks = num_blocks if num_blocks is not None else pool_blocks(capacity, block_size, sequences)
        self.pool = pool if pool is not None else KVPool(loaded.kv_shape, blocks, block_size, loaded.device,
                                                         loaded.dtype)
        self.forwards = 0
        self.forward_ms: list[float] = []
        self._timer = ForwardTimer(loaded.device, now)

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size

    def new_sequence(self) -> PagedCache:
        return self.pool.new_sequence()

    @torch.inference_mode()
    def forward(self, cache: PagedCache, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Feed `token_ids` after the cached ones; return float32 logits [len(token_ids) or 1, V].

        Writes their K/V (unless inside `cache.read_only()`) and appends them to `cache.tokens`.
        """
        return self.forward_features(cache, token_ids, last_only, features=False)[0]

    @torch.inference_mode()
    def forward_features(self, cache: PagedCache, token_ids: list[int], last_only: bool = False,
                         features: bool = True, positions: list[int] | None = None,
                         attn_mask: torch.Tensor | None = None,
                         taps: tuple[int, ...] = (), argmax_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the post-norm features of every fed row ([len(token_ids), d]) when `features`
        (all rows even with `last_only`, which keeps only the last row's logits). `argmax_only`: only each
        row's highest logit will be read (greedy), which lets an int4 target skip the rest of its head.

        A tree is fed with `positions` (rotary positions, one per token) and `attn_mask` ([q, past + q]
        bool, which cached and fed rows each token sees); see engine.tree.attention_mask. With `taps` the
        features are the residual stream entering those layers instead (fused forward only)."""
        device = self.loaded.device
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device) if positions is not None else None
        with self._timer.time(self.forward_ms):
            if self.fused is not None:
                logits, hidden = self.fused.forward_features(cache, ids, last_only, pos, attn_mask, taps, argmax_only)
            else:
                extra = {}
                if pos is not None:  # a 4-D additive mask and explicit positions, as transformers takes a tree
                    blocked = torch.zeros(attn_mask.shape, dtype=self.loaded.dtype, device=device)
                    blocked.masked_fill_(~attn_mask.to(device), torch.finfo(self.loaded.dtype).min)
                    extra = {"attention_mask": blocked[None, None], "position_ids": pos[None]}
                out = self.loaded.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1 if last_only else 0,
                                        output_hidden_states=features, **extra)
                logits = out.logits[0].float()
                if taps:  # hidden_states[i] is what enters layer i
                    hidden = torch.cat([out.hidden_states[i][0] for i in taps], dim=-1)
                else:
                    hidden = out.hidden_states[-1][0] if features else None
        if not cache._read_only:
            cache.tokens.extend(token_ids)
        self.forwards += 1
        return logits, (hidden if features else None)

    def drain_forward_ms(self) -> list[float]:
        times, self.forward_ms = self.forward_ms, []
        return times

    @property
    def forward_path(self) -> str:
        return "fused" if self.fused is not None else "transformers"


@dataclass(frozen=True, slots=True)
class ForwardRequest:
    """One sequence's share of a batched forward: what `ModelRunner.forward_features` takes, per sequence.
    `read_only`: attend to the cache without writing it (v1's verify); `argmax_only`: only each row's highest logit
    is read (greedy decoding), so an int4 target computes no more of its head (a batched forward computes it all)."""

    runner: ModelRunner
    cache: PagedCache
    token_ids: list[int]
    last_only: bool = False
    positions: list[int] | None = None
    attn_mask: torch.Tensor | None = None
    read_only: bool = False
    argmax_only: bool = False

    def run(self, features: bool = False, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This request alone: the runner's `forward_features` (inside `read_only()` when asked)."""
        with self.cache.read_only() if self.read_only else nullcontext():
            return self.runner.forward_features(self.cache, self.token_ids, self.last_only, features, self.positions,
                                                self.attn_mask, taps, self.argmax_only)


@torch.inference_mode()
def forward_many(requests: list[ForwardRequest], features: bool = True,
                 taps: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """`forward_features` for several sequences of one model: one fused forward over all their rows
    (`FusedLlama.forward_many`), timed once; every runner taking part counts it as its forward and records its
    time. A model without the fused forward runs the requests one after another (no batching there), and a
    batch of one runs the single-sequence forward itself."""
    if not requests:
        return []
    first = requests[0].runner
    if any(r.runner.loaded is not first.loaded for r in requests):
        raise ValueError("a batched forward runs one model; these requests name several")
    if first.fused is None or len(requests) == 1:   # no batching to do: the single-sequence forward
        return [r.run(features, taps) for r in requests]
    device = first.loaded.device
    segments = [Segment(r.cache, list(r.token_ids), r.last_only,
                        torch.tensor(r.positions, dtype=torch.long, device=device) if r.positions is not None else None,
                        r.attn_mask) for r in requests]
    times: list[float] = []
    with ExitStack() as stack:
        for r in requests:
            if r.read_only:
                stack.enter_context(r.cache.read_only())
        with first._timer.time(times):
            results = first.fused.forward_many(segments, taps)
        for r in requests:
            if not r.cache._read_only:
                r.cache.tokens.extend(r.token_ids)
    for r in requests:
        r.runner.forward_ms.extend(times)
        r.runner.forwards += 1
    return [(logits, hidden if features else None) for logits, hidden in results]

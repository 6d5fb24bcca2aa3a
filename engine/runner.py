"""A model plus its paged KV pool: the one place forwards happen."""
from __future__ import annotations

import torch

from engine.fused_llama import FusedLlama, fused_for
from engine.kv_cache import KVPool, PagedCache
from engine.models import LoadedModel


class ModelRunner:
    """Runs forwards of one model over one sequence's paged cache.

    The pool is sized for `capacity` tokens per sequence times `sequences`. Models are shared and
    read-only; every runner has its own pool, so concurrent sessions never share KV. Forwards use
    the engine's fused forward when the architecture allows (`fused=True`, the default), else the
    transformers forward with the paged cache as its `Cache`; `forward_path` says which.
    """

    def __init__(self, loaded: LoadedModel, capacity: int, block_size: int = 16,
                 sequences: int = 1, num_blocks: int | None = None, fused: bool = True) -> None:
        self.loaded = loaded
        self.fused: FusedLlama | None = fused_for(loaded.model) if fused else None
        blocks = num_blocks if num_blocks is not None else sequences * (-(-capacity // block_size))
        self.pool = KVPool(loaded.kv_shape, blocks, block_size, loaded.device, loaded.dtype)
        self.forwards = 0

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
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.loaded.device)
        if self.fused is not None:
            logits = self.fused.forward(cache, ids, last_only)
        else:
            out = self.loaded.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
            logits = out.logits[0].float()
        if not cache._read_only:
            cache.tokens.extend(token_ids)
        self.forwards += 1
        return logits

    @property
    def forward_path(self) -> str:
        return "fused" if self.fused is not None else "transformers"

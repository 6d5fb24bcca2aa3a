"""A model plus its paged KV pool: the one place forwards happen."""
from __future__ import annotations

import torch

from engine.kv_cache import KVPool, PagedCache
from engine.models import LoadedModel


class ModelRunner:
    """Runs forwards of one model over one sequence's paged cache.

    The pool is sized for `capacity` tokens per sequence times `sequences`. Models are shared and
    read-only; every runner has its own pool, so concurrent sessions never share KV.
    """

    def __init__(self, loaded: LoadedModel, capacity: int, block_size: int = 16,
                 sequences: int = 1, num_blocks: int | None = None) -> None:
        self.loaded = loaded
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
        out = self.loaded.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        if not cache._read_only:
            cache.tokens.extend(token_ids)
        self.forwards += 1
        return out.logits[0].float()

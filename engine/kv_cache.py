"""A paged KV cache: physical K/V block pools per model, and a transformers `Cache` view per sequence.

`KVPool` owns the physical tensors, one [kv_heads, num_blocks * block_size, head_dim] pair per
layer, and the `BlockManager` that hands their blocks out. `PagedCache` is one sequence's view:
it plugs into a transformers 5 model as `model(input_ids, cache=paged_cache)`. Each layer writes
the new K/V into the sequence's slots and reads back the sequence's K/V (gathered through its
block table) for attention, so a rollback is only bookkeeping: no tensor is copied or shrunk.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from engine.block_manager import BlockManager, BlockTable, SlotChange


@dataclass(frozen=True, slots=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int

    @staticmethod
    def of(config) -> "KVShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return KVShape(config.num_hidden_layers, kv_heads, head_dim)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Physical K/V storage for one model, carved into fixed-size blocks."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        self.shape = shape
        self.manager = BlockManager(num_blocks, block_size)
        self.device = torch.device(device)
        self.dtype = dtype
        slots = num_blocks * block_size
        self.keys = [torch.zeros(shape.kv_heads, slots, shape.head_dim, device=device, dtype=dtype)
                     for _ in range(shape.layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def new_sequence(self, fast_path: bool = True) -> "PagedCache":
        """A sequence's cache; `fast_path=False` always gathers through the block table (for measuring)."""
        return PagedCache(self, self.manager.new_table(), fast_path)


class _PagedLayer(CacheLayerMixin):
    """One model layer's window onto the shared pool; all bookkeeping lives in `PagedCache`."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, cache: "PagedCache", index: int) -> None:
        super().__init__()
        self._cache, self._index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._cache.layer_update(self._index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called before any layer writes this forward's K/V, so the past is the current length.
        return self._cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        pass  # the whole cache crops once, in PagedCache.crop

    def reset(self) -> None:
        pass


class PagedCache(Cache):
    """One sequence's paged KV, usable as `model(input_ids, cache=this)` in transformers 5.

    Positions come from `get_seq_length()`. Layer 0's update reserves the slots for the new
    tokens (allocating blocks); every layer then writes its K/V there and gathers the whole
    sequence back. `read_only()` runs a forward that attends to the cache without writing to it
    (the seed system's v1 verify). `tokens` holds the ids whose K/V is cached, kept by the runner.
    """

    def __init__(self, pool: KVPool, table: BlockTable, fast_path: bool = True) -> None:
        self.pool, self.table, self._fast_path = pool, table, fast_path
        self.tokens: list[int] = []
        self.log: list[tuple[str, SlotChange]] = []
        self._read_only = False
        self._slot_index = torch.empty(0, dtype=torch.long, device=pool.device)
        self._write_index: torch.Tensor | None = None
        self._past_index: torch.Tensor | None = None
        self._span: tuple[int, int] | None = None
        self._past_span: tuple[int, int] | None = None
        super().__init__(layers=[_PagedLayer(self, i) for i in range(pool.shape.layers)])

    # -- transformers Cache API -------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.table.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.table.length + query_length, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layer_update(layer_idx, key_states, value_states)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count removes that many tokens; 0 changes nothing."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove < 0:
            self.rollback(-tokens_to_remove)

    def reset(self) -> None:
        self.rollback(self.table.length)

    # -- paging -------------------------------------------------------------------------------
    def layer_update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write this layer's new K/V ([1, kv_heads, q, head_dim]) and return the sequence's K/V."""
        if key_states.shape[0] != 1:
            raise ValueError("PagedCache holds one sequence; batch size must be 1")
        if layer == 0:
            self._begin_forward(key_states.shape[-2])
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        new_k, new_v = key_states[0].to(keys.dtype), value_states[0].to(values.dtype)
        if self._read_only:
            k = torch.cat([self._gather(keys, self._past_index, self._past_span), new_k], dim=1)
            v = torch.cat([self._gather(values, self._past_index, self._past_span), new_v], dim=1)
        else:
            keys.index_copy_(1, self._write_index, new_k)
            values.index_copy_(1, self._write_index, new_v)
            k = self._gather(keys, self._slot_index, self._span)
            v = self._gather(values, self._slot_index, self._span)
        return k.unsqueeze(0).to(key_states.dtype), v.unsqueeze(0).to(value_states.dtype)

    @staticmethod
    def _gather(pool: torch.Tensor, index: torch.Tensor, span: tuple[int, int] | None) -> torch.Tensor:
        # Fast path: when the sequence's blocks are physically consecutive (the LIFO free list
        # keeps a lone sequence so), its K/V is a view of the pool and nothing is copied.
        if span is not None:
            return pool[:, span[0] : span[1]]
        return pool.index_select(1, index)

    def _contiguous_span(self) -> tuple[int, int] | None:
        if not self._fast_path:
            return None
        blocks, bs = self.table.blocks, self.pool.block_size
        if blocks and blocks[-1] - blocks[0] == len(blocks) - 1 and all(
                b == blocks[0] + i for i, b in enumerate(blocks)):
            return blocks[0] * bs, blocks[0] * bs + self.table.length
        return None

    def _begin_forward(self, q: int) -> None:
        if self._read_only:
            self._past_index, self._past_span = self._slot_index, self._contiguous_span()
            return
        change = self.pool.manager.append_slots(self.table, q)
        self.log.append(("write", change))
        self._write_index = torch.tensor(change.slots, dtype=torch.long, device=self.pool.device)
        self._slot_index = torch.cat([self._slot_index, self._write_index])
        self._span = self._contiguous_span()

    def begin_write(self, q: int) -> torch.Tensor:
        """Reserve slots for q new tokens (what layer 0's update does in a forward) and return their physical
        slots; a batched forward then writes every layer's K/V there itself (engine.fused_llama.forward_many)."""
        self._begin_forward(q)
        return self._write_index

    @property
    def span(self) -> tuple[int, int] | None:
        """After `begin_write` (or layer 0's update): the pool slots [start, end) that hold the sequence in order,
        when its blocks are consecutive (its K/V is then a view of the pool); None when they are not (gather
        `slots`)."""
        return self._span

    @property
    def slots(self) -> torch.Tensor:
        """The physical slot of every cached position, in order."""
        return self._slot_index

    def rollback(self, n: int) -> SlotChange:
        """Forget the last n cached tokens; blocks left empty return to the pool."""
        change = self.pool.manager.rollback(self.table, n)
        self.log.append(("rollback", change))
        self._slot_index = self._slot_index[: self.table.length]
        del self.tokens[self.table.length :]
        return change

    def compact(self, start: int, keep: list[int]) -> SlotChange:
        """Keep rows start + keep[i] (ascending offsets into what was written from logical position
        `start`, e.g. a tree's root and its accepted path) at consecutive positions start + i, moving
        their K/V there, and roll back the rest. Returns the move (the slots that received K/V)."""
        if sorted(set(keep)) != list(keep) or (keep and (keep[0] < 0 or start + keep[-1] >= self.table.length)):
            raise ValueError(f"keep must be ascending offsets within the written span, got {keep}")
        manager = self.pool.manager
        pairs = [(manager.slot(self.table, start + k), manager.slot(self.table, start + i))
                 for i, k in enumerate(keep) if k != i]
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.pool.device)
            dst = torch.tensor([d for _, d in pairs], device=self.pool.device)
            for keys, values in zip(self.pool.keys, self.pool.values):
                keys[:, dst] = keys[:, src]      # gathered before written: later sources are never overwritten
                values[:, dst] = values[:, src]
            for i, k in enumerate(keep):
                if k != i and start + k < len(self.tokens):
                    self.tokens[start + i] = self.tokens[start + k]
        change = SlotChange([d for _, d in pairs], [], [])
        self.log.append(("move", change))
        self.rollback(self.table.length - (start + len(keep)))
        return change

    def free(self) -> None:
        self.rollback(self.table.length)
        self.pool.manager.free(self.table)

    @contextmanager
    def read_only(self) -> Iterator[None]:
        """Forwards inside attend to the cached K/V plus their own, and write nothing."""
        self._read_only = True
        try:
            yield
        finally:
            self._read_only = False

    def drain_log(self) -> list[tuple[str, SlotChange]]:
        log, self.log = self.log, []
        return log

    def physical_slots(self) -> list[int]:
        return self._slot_index.tolist()

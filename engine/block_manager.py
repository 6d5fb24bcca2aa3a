"""Fixed-size KV blocks: a free list, per-sequence block tables, and the events they produce."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class KVPoolExhausted(RuntimeError):
    """Raised when a sequence needs more KV blocks than the pool has free."""


@dataclass(slots=True)
class BlockTable:
    """One sequence's view of the pool: which physical blocks it owns, and how many slots it uses."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # slots in use; slot i lives in blocks[i // block_size] at offset i % block_size


@dataclass(frozen=True, slots=True)
class SlotChange:
    """What one append, rollback or move did: the physical slots touched and blocks allocated or freed
    (for a move: the slots that received another slot's K/V)."""

    slots: list[int]
    blocks_allocated: list[int]
    blocks_freed: list[int]


class BlockManager:
    """Hands out fixed-size blocks of KV slots to sequences and takes them back.

    Invariant (checked by `check`): every block is either on the free list or in exactly one
    table, and each table owns exactly ceil(length / block_size) blocks.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: list[BlockTable] = []

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def new_table(self) -> BlockTable:
        table = BlockTable()
        self._tables.append(table)
        return table

    def blocks_needed(self, table: BlockTable, extra: int) -> int:
        total = -(-(table.length + extra) // self.block_size)
        return max(0, total - len(table.blocks))

    def slot(self, table: BlockTable, index: int) -> int:
        """Physical slot of logical position `index` in the sequence."""
        return table.blocks[index // self.block_size] * self.block_size + index % self.block_size

    def append_slots(self, table: BlockTable, n: int) -> SlotChange:
        """Reserve n more slots at the end of the sequence, allocating blocks as needed."""
        need = self.blocks_needed(table, n)
        if need > len(self._free):
            raise KVPoolExhausted(
                f"KV pool exhausted: {n} more slots need {need} free blocks, but only {len(self._free)} of "
                f"{self.num_blocks} blocks ({self.block_size} slots each) are free. Use a shorter prompt, fewer "
                f"new tokens, or a larger pool (--kv-blocks).")
        allocated = [self._free.popleft() for _ in range(need)]
        table.blocks.extend(allocated)
        slots = [self.slot(table, i) for i in range(table.length, table.length + n)]
        table.length += n
        return SlotChange(slots, allocated, [])

    def rollback(self, table: BlockTable, n: int) -> SlotChange:
        """Forget the last n slots; blocks left empty go back to the free list."""
        if not 0 <= n <= table.length:
            raise ValueError(f"cannot roll back {n} slots of a sequence holding {table.length}")
        slots = [self.slot(table, i) for i in range(table.length - n, table.length)]
        table.length -= n
        keep = -(-table.length // self.block_size)
        freed = table.blocks[keep:]
        del table.blocks[keep:]
        # LIFO: the block freed last is handed out first, so a sequence that rolls back and
        # grows again gets its old blocks back and stays physically contiguous (a fast path).
        self._free.extendleft(reversed(freed))
        return SlotChange(slots, [], freed)

    def free(self, table: BlockTable) -> SlotChange:
        change = self.rollback(table, table.length)
        if table in self._tables:
            self._tables.remove(table)
        return change

    def check(self) -> None:
        """Raise AssertionError if any block is lost, shared, or a table's size disagrees with its length."""
        owned = [b for t in self._tables for b in t.blocks]
        everything = sorted(owned + list(self._free))
        assert everything == list(range(self.num_blocks)), "a block is lost or owned twice"
        for t in self._tables:
            assert len(t.blocks) == -(-t.length // self.block_size), "table size disagrees with its length"

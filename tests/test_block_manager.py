"""BlockManager: allocation, rollback and free keep every block accounted for."""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, KVPoolExhausted


def test_allocate_append_rollback_free_returns_pool_to_start() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    start = sorted(bm._free)
    table = bm.new_table()
    change = bm.append_slots(table, 6)          # 6 slots -> 2 blocks
    assert len(change.blocks_allocated) == 2 and len(change.slots) == 6
    assert table.length == 6 and bm.free_blocks == 6
    bm.append_slots(table, 5)                   # 11 slots -> 3 blocks
    assert len(table.blocks) == 3
    bm.check()
    bm.rollback(table, 7)                       # 4 slots -> 1 block
    assert table.length == 4 and len(table.blocks) == 1 and bm.free_blocks == 7
    bm.check()
    bm.free(table)
    bm.check()
    assert bm.free_blocks == 8 and sorted(bm._free) == start
    assert table.blocks == [] and table.length == 0


def test_slots_follow_the_block_table() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = bm.new_table(), bm.new_table()
    bm.append_slots(a, 1)
    bm.append_slots(b, 2)
    change = bm.append_slots(a, 2)              # a's second slot stays in its block; the third needs a new one
    assert change.slots == [a.blocks[0] * 2 + 1, a.blocks[1] * 2]
    assert set(a.blocks).isdisjoint(b.blocks)
    assert [bm.slot(a, i) for i in range(3)] == [a.blocks[0] * 2, a.blocks[0] * 2 + 1, a.blocks[1] * 2]
    bm.check()


def test_blocks_freed_exactly_when_emptied() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    table = bm.new_table()
    bm.append_slots(table, 8)
    second = table.blocks[1]
    assert bm.rollback(table, 3).blocks_freed == []          # 5 slots still need 2 blocks
    assert bm.rollback(table, 1).blocks_freed == [second]    # 4 slots fit in 1 block
    assert bm.rollback(table, 0).blocks_freed == []
    assert bm.free_blocks == 3
    bm.check()


def test_rollback_reports_the_slots_it_forgot() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    table = bm.new_table()
    written = bm.append_slots(table, 6).slots
    assert bm.rollback(table, 2).slots == written[4:]


def test_exhausted_pool_raises_with_counts_and_leaves_state_unchanged() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    table = bm.new_table()
    bm.append_slots(table, 5)
    with pytest.raises(KVPoolExhausted, match=r"need 2 free blocks, but only 0 of 2 blocks \(4 slots each\)"):
        bm.append_slots(table, 8)
    assert table.length == 5 and len(table.blocks) == 2
    bm.check()


@pytest.mark.parametrize("n", [-1, 4])
def test_rollback_bounds(n: int) -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    table = bm.new_table()
    bm.append_slots(table, 3)
    with pytest.raises(ValueError, match="cannot roll back"):
        bm.rollback(table, n)
    assert table.length == 3


def test_check_detects_a_lost_or_shared_block() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    table = bm.new_table()
    bm.append_slots(table, 2)
    bm._free.append(table.blocks[0])            # the block is now both owned and free
    with pytest.raises(AssertionError, match="lost or owned twice"):
        bm.check()
    bm._free.pop()
    table.length = 3                            # 3 slots need 2 blocks, the table has 1
    with pytest.raises(AssertionError, match="disagrees"):
        bm.check()


@pytest.mark.parametrize("blocks, size", [(0, 4), (4, 0)])
def test_rejects_empty_pools(blocks: int, size: int) -> None:
    with pytest.raises(ValueError, match="num_blocks >= 1 and block_size >= 1"):
        BlockManager(blocks, size)

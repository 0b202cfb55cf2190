"""Consistency checks of a BlockManager's internal state, for tests only.

They read BlockManager's private members on purpose: the engine never calls
them, so they live here rather than in the package.
"""

from __future__ import annotations

from collections import Counter

from jaxinfer.engine import block_manager as block_manager_module
from jaxinfer.engine.block_manager import BlockManager


def check_invariants(bm: BlockManager) -> None:
    """Assert that every block is in exactly one of free / evictable / in use,
    that ref counts match the tables, and that the cache entries, duplicates
    and stored tokens agree with their hashes."""
    holders: Counter[int] = Counter()
    for seq_id, table in bm._tables.items():
        assert len(set(table)) == len(table), f"sequence {seq_id!r} holds a block twice: {table}"
        assert len(bm._seq_hashes[seq_id]) <= len(table), f"sequence {seq_id!r} has hashes past its table"
        holders.update(table)
    assert bm._tables.keys() == bm._seq_hashes.keys()
    free, evictable = set(bm._free), set(bm._evictable)
    assert len(free) == len(bm._free), "a block is on the free list twice"
    assert not free & evictable, f"blocks both free and evictable: {free & evictable}"
    assert bm.NULL_BLOCK not in free | evictable | holders.keys(), "the null block was handed out"
    assert bm.NULL_BLOCK not in bm._cached.values(), "the null block is cached"
    for block_id in range(1, bm.num_blocks):
        block = bm._blocks[block_id]
        assert block.ref_count == holders[block_id], (
            f"block {block_id}: ref count {block.ref_count}, held by {holders[block_id]} tables"
        )
        if block_id in free:
            assert block.ref_count == 0 and block.block_hash is None, f"free block {block_id} is used or cached"
        elif block_id in evictable:
            assert block.ref_count == 0 and block.block_hash is not None, f"evictable block {block_id} is wrong"
        else:
            assert block.ref_count > 0, f"block {block_id} is neither free, evictable nor used"
        if block.block_hash is not None and bm._cached.get(block.block_hash) != block_id:
            assert block_id in bm._duplicates.get(block.block_hash, ()), f"block {block_id}: stray hash"
            assert block.ref_count > 0, f"duplicate block {block_id} is not held"
    used = sum(1 for b in bm._blocks[1:] if b.ref_count > 0)
    assert len(free) + len(evictable) + used == bm.num_usable_blocks, "blocks leaked"
    for block_hash, block_id in bm._cached.items():
        block = bm._blocks[block_id]
        assert block.block_hash == block_hash, f"cache entry points at block {block_id} with another hash"
        # Through the module attribute, so a test that monkeypatches _chain_hash is checked with its hash.
        assert block_manager_module._chain_hash(block.parent_hash, block.token_ids) == block_hash, (
            f"block {block_id}'s stored tokens do not match its hash"
        )
        for duplicate_id in bm._duplicates.get(block_hash, ()):
            duplicate = bm._blocks[duplicate_id]
            assert duplicate.block_hash == block_hash and duplicate_id != block_id
            assert (duplicate.parent_hash, duplicate.token_ids) == (block.parent_hash, block.token_ids)
    assert bm._duplicates.keys() <= bm._cached.keys(), "a duplicate outlived its entry"
    duplicate_ids = [b for duplicates in bm._duplicates.values() for b in duplicates]
    assert all(bm._duplicates.values()) and len(set(duplicate_ids)) == len(duplicate_ids)

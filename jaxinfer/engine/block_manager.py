"""Host-side owner of the paged KV cache's block table, with prefix caching.

The device holds a pool of `num_blocks` blocks of `block_size` token slots.
Block 0 is the null block that padding rows of a batch point at, so it is never
handed out. A sequence's block table lists the blocks holding its tokens in
order: token i lives in block `table[i // block_size]`, slot `i % block_size`.
Blocks are allocated on demand as a sequence grows, never up front for its
maximum length.

Prefix caching (vLLM v1 / nano-vllm): once every token of a block has been
computed, the block is registered under a chain hash of its contents and of
everything before it, so another prompt with the same leading tokens can
reuse the block instead of recomputing it. Only full blocks are ever shared,
so nobody writes into a shared block and no copy-on-write is needed. A block
nobody holds any more keeps its contents and hash and waits in an LRU queue;
it is reused for a hit, or evicted (hash dropped) when the plain free list
runs dry.

A sequence may name a cache salt (a LoRA adapter's, engine/sequence.py): it
stands as the parent hash of the sequence's first block, so its chain, and
every block in it, is findable only by sequences with the same salt.

Two sequences that computed the same block independently (both missed, e.g.
identical prompts admitted in the same step) hold two copies. The first one
registered stays the cache entry; the other is remembered as a duplicate, so
that if the entry is evicted while the duplicate is still held, the duplicate
takes over and the resident contents stay findable. A duplicate nobody holds
any more is plain free: the entry already serves its contents.

Every block is in exactly one of three places: the free list (ref count 0, no
hash), the evictable LRU (ref count 0, the cache entry for its hash) or in use
(ref count > 0; the entry, a duplicate, or not cached). tests/block_manager_checks.py
asserts these invariants.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

import numpy as np

from jaxinfer.engine.block_ownership import OwnedFreeBlocks


def _chain_hash(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    # SHA-256 rather than the built-in hash: Python's hash of a tuple of ints
    # is unseeded, so a client could craft a prompt whose blocks collide with
    # another request's, and comparing a block's own tokens on a match does
    # not catch a collision in its parent chain. Lookups compare the exact
    # (parent hash, tokens) pair as well, so a wrong hit would need a SHA-256
    # collision. The cost is about a microsecond per full block.
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class _Block:
    __slots__ = ("ref_count", "block_hash", "parent_hash", "token_ids")

    def __init__(self):
        self.ref_count = 0
        self.block_hash: bytes | None = None  # set while the block is the cache entry or a duplicate
        self.parent_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()

    def forget(self) -> None:
        self.block_hash, self.parent_hash, self.token_ids = None, None, ()


class BlockManager:
    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_devices: int = 1):
        """num_devices: the context-parallel devices the pool's blocks are split
        over (engine/block_ownership.py); new blocks come from the one with the most room."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_usable_blocks = num_blocks - 1
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] | OwnedFreeBlocks = (
            deque(range(1, num_blocks)) if num_devices == 1 else OwnedFreeBlocks(num_blocks, num_devices))
        # Ref-0 cached blocks, least recently freed first: the eviction order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self._duplicates: dict[bytes, list[int]] = {}  # held blocks with an entry's exact contents
        # Each sequence's table as a C int array (array.array): appended to
        # like a list, and copied into a step's inputs in one memcpy, where
        # a list of Python ints is converted one element at a time (~40 us
        # for a 32k-token context, every sequence every step).
        self._tables: dict[Hashable, array] = {}
        # Chain hashes of each sequence's leading full blocks that are known to
        # the cache, so cache_full_blocks only hashes blocks it has not seen.
        self._seq_hashes: dict[Hashable, list[bytes]] = {}
        self._seq_salts: dict[Hashable, bytes | None] = {}  # each sequence's cache salt (the chain's root)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def block_table(self, seq_id) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def block_table_array(self, seq_id) -> np.ndarray:
        """The sequence's table as a new int32 array (a step's inputs)."""
        table = self._tables.get(seq_id)
        return np.zeros(0, np.int32) if table is None else np.frombuffer(table, np.intc).astype(np.int32)

    def _lookup(self, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> tuple[bytes, int | None]:
        block_hash = _chain_hash(parent_hash, token_ids)
        block_id = self._cached.get(block_hash)
        if block_id is not None:
            block = self._blocks[block_id]
            if block.parent_hash != parent_hash or block.token_ids != token_ids:
                block_id = None
        return block_hash, block_id

    def _cached_prefix(self, token_ids: Sequence[int], cache_salt: bytes | None) -> tuple[list[int], list[bytes]]:
        """The longest cached run of the sequence's leading full blocks (block
        ids and chain hashes), without taking them or counting the lookup."""
        table: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return table, hashes
        bs = self.block_size
        # At least one token must be left to compute: its logits are what
        # the step samples from, and a zero-length prefill breaks the step.
        for i in range(max(0, (len(token_ids) - 1) // bs)):
            parent_hash = hashes[-1] if hashes else cache_salt
            block_hash, block_id = self._lookup(parent_hash, tuple(token_ids[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            table.append(block_id)
            hashes.append(block_hash)
        return table, hashes

    def cached_prefix_len(self, token_ids: Sequence[int], cache_salt: bytes | None = None) -> int:
        """Tokens allocate_prefix would serve from the cache now (no side effects)."""
        return len(self._cached_prefix(token_ids, cache_salt)[0]) * self.block_size

    def can_admit(self, token_ids: Sequence[int], num_tokens: int, cache_salt: bytes | None = None) -> bool:
        """Whether allocate_prefix then allocate(num_tokens) would succeed for a
        new sequence with these tokens. The scheduler asks first, so a request
        that must wait neither takes blocks nor counts as a cache query."""
        table, _ = self._cached_prefix(token_ids, cache_salt)
        # Hit blocks nobody holds are counted as free now but stop being free once taken.
        reused_free = sum(block_id in self._evictable for block_id in table)
        needed = max(0, -(-num_tokens // self.block_size) - len(table))
        return needed <= self.num_free_blocks - reused_free

    def allocate_prefix(self, seq_id, token_ids: Sequence[int], cache_salt: bytes | None = None) -> int:
        """Register a new sequence and give it the longest cached run of its
        leading full blocks under its cache salt; returns the number of cached tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        table, hashes = self._cached_prefix(token_ids, cache_salt)
        for block_id in table:
            self._evictable.pop(block_id, None)
            self._blocks[block_id].ref_count += 1
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(token_ids)
            self.prefix_cache_hits += len(table) * self.block_size
        self._tables[seq_id] = array("i", table)
        self._seq_hashes[seq_id] = hashes
        self._seq_salts[seq_id] = cache_salt
        return len(table) * self.block_size

    def num_blocks_needed(self, seq_id, num_tokens: int) -> int:
        needed = -(-num_tokens // self.block_size)
        return max(0, needed - len(self._tables.get(seq_id, ())))

    def allocate(self, seq_id, num_tokens: int) -> bool:
        """Grow the table to cover num_tokens tokens; all or nothing."""
        table = self._tables[seq_id]
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._drop_entry(block_id)
        self._blocks[block_id].ref_count = 1
        return block_id

    def _drop_entry(self, block_id: int) -> None:
        block = self._blocks[block_id]
        duplicates = self._duplicates.get(block.block_hash)
        if duplicates:
            self._cached[block.block_hash] = duplicates.pop()
            if not duplicates:
                del self._duplicates[block.block_hash]
        else:
            del self._cached[block.block_hash]
        block.forget()

    def cache_full_blocks(self, seq_id, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the full blocks among the first num_computed_tokens tokens."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self._tables[seq_id], self._seq_hashes[seq_id]
        bs = self.block_size
        num_full = num_computed_tokens // bs
        if num_computed_tokens > len(token_ids) or num_full > len(table):
            raise ValueError(
                f"sequence {seq_id!r}: {num_computed_tokens} computed tokens but {len(token_ids)} tokens "
                f"and {len(table)} blocks"
            )
        for i in range(len(hashes), num_full):
            parent_hash = hashes[-1] if hashes else self._seq_salts[seq_id]
            block_token_ids = tuple(token_ids[i * bs : (i + 1) * bs])
            block_hash, existing = self._lookup(parent_hash, block_token_ids)
            hashes.append(block_hash)
            block = self._blocks[table[i]]
            if existing is not None:
                # The existing entry stays, so hits keep landing on one copy.
                self._duplicates.setdefault(block_hash, []).append(table[i])
            elif block_hash in self._cached:
                continue  # a hash collision: the block stays uncached
            else:
                self._cached[block_hash] = table[i]
            block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, block_token_ids

    def free(self, seq_id) -> None:
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._seq_hashes[seq_id]
        del self._seq_salts[seq_id]
        # Tail first, so the LRU evicts a sequence's tail before its head:
        # the head blocks are the ones other prompts are likely to share.
        for block_id in reversed(table):
            self._release(block_id)

    def trim(self, seq_id, num_tokens: int) -> int:
        """Shrink the table to the blocks covering the first num_tokens tokens
        and release the rest (tail first); returns how many were released.

        Speculative decoding allocates slots for draft tokens before knowing
        how many the target accepts; the rejected drafts' slots are dropped
        here. Nothing needs erasing: a slot past a sequence's computed tokens
        is rewritten before any query reads it. Registered blocks past the new
        end lose their place in this sequence's hash chain (they stay cached
        for others, as after `free`)."""
        table = self._tables[seq_id]
        keep = -(-max(0, num_tokens) // self.block_size)
        released = table[keep:]
        for block_id in reversed(released):
            self._release(block_id)
        del table[keep:]
        del self._seq_hashes[seq_id][keep:]
        return len(released)

    def _release(self, block_id: int) -> None:
        """Drop one holder of a block: at ref count 0 it becomes evictable (the
        cache entry for its hash) or plain free (uncached, or a duplicate)."""
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is not None and self._cached[block.block_hash] == block_id:
            self._evictable[block_id] = None
            return
        if block.block_hash is not None:
            duplicates = self._duplicates[block.block_hash]
            duplicates.remove(block_id)
            if not duplicates:
                del self._duplicates[block.block_hash]
            block.forget()
        self._free.append(block_id)

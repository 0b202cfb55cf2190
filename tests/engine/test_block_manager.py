"""Block manager: ref counting, on-demand allocation, prefix caching, LRU eviction.

The property test drives random operation sequences over tiny vocabularies and
pools, so prefixes collide and evictions happen often, and checks against a
shadow model built only from what the API returned: which tables hold which
blocks, and what each sequence has written into each slot of each block.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxinfer.engine import block_manager as block_manager_module
from jaxinfer.engine.block_manager import BlockManager
from tests.block_manager_checks import check_invariants


def run_prompt(bm: BlockManager, seq_id, token_ids) -> int:
    """Admit a prompt, compute all of it and register its full blocks, as the
    engine does; returns the number of cached tokens."""
    cached = bm.allocate_prefix(seq_id, token_ids)
    assert bm.allocate(seq_id, len(token_ids))
    bm.cache_full_blocks(seq_id, token_ids, len(token_ids))
    return cached


# -- unit tests ---------------------------------------------------------------


def test_allocation_on_demand_and_free():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.num_usable_blocks == 9 and bm.num_free_blocks == 9 and bm.num_used_blocks == 0
    assert bm.block_table("a") == []
    assert bm.allocate_prefix("a", [1, 2, 3]) == 0
    assert bm.num_blocks_needed("a", 3) == 1 and bm.num_blocks_needed("a", 9) == 3
    assert bm.allocate("a", 3)
    assert len(bm.block_table("a")) == 1 and bm.num_blocks_needed("a", 4) == 0
    assert bm.allocate("a", 5)  # the fifth token needs a second block
    table = bm.block_table("a")
    assert len(table) == 2 and BlockManager.NULL_BLOCK not in table
    assert bm.allocate("a", 2) and bm.block_table("a") == table  # never shrinks
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 7
    bm.free("a")
    bm.free("a")  # unknown now: no-op, not a double free
    assert bm.num_free_blocks == 9 and bm.block_table("a") == []
    check_invariants(bm)


def test_prefix_hit_shares_block_ids_and_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    assert run_prompt(bm, "a", prompt) == 0
    assert bm.allocate_prefix("b", prompt[:8] + [99, 98]) == 8
    assert bm.block_table("b") == bm.block_table("a")[:2]
    assert bm.allocate("b", 10)
    assert bm.block_table("b")[2] != bm.block_table("a")[2]  # the partial tail is never shared
    assert bm.num_used_blocks == 4
    # A different first block breaks the chain even though the second matches.
    assert bm.allocate_prefix("c", [7, 7, 7, 7] + prompt[4:]) == 0
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (30, 8)
    check_invariants(bm)


def test_hit_is_capped_so_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = list(range(32))
    run_prompt(bm, "a", prompt)
    bm.free("a")
    assert bm.allocate_prefix("b", prompt) == 16  # not 32: a full hit would be a zero-length prefill
    assert bm.allocate_prefix("c", prompt + [5]) == 32
    assert bm.allocate_prefix("d", prompt[:16]) == 0
    assert bm.allocate_prefix("e", []) == 0
    check_invariants(bm)


def test_hit_on_cached_free_block_takes_it_out_of_the_free_pool():
    bm = BlockManager(num_blocks=6, block_size=2)
    run_prompt(bm, "a", [1, 1, 2, 2, 3])
    bm.free("a")
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 0  # cached blocks still count as free
    assert bm.allocate_prefix("b", [1, 1, 2, 2, 4]) == 4
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 2
    check_invariants(bm)


def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(num_blocks=5, block_size=2)
    run_prompt(bm, "a", [1, 1, 0])
    run_prompt(bm, "b", [2, 2, 0])
    a_head, b_head = bm.block_table("a")[0], bm.block_table("b")[0]
    bm.free("a")
    bm.free("b")
    # Three blocks: the two unhashed tails from the free list, then one eviction.
    assert bm.allocate_prefix("c", [3] * 6) == 0 and bm.allocate("c", 6)
    assert a_head in bm.block_table("c") and b_head not in bm.block_table("c")
    assert bm.allocate_prefix("b2", [2, 2, 0]) == 2
    assert bm.allocate_prefix("a2", [1, 1, 0]) == 0
    check_invariants(bm)


def test_rehit_block_leaves_the_lru():
    bm = BlockManager(num_blocks=5, block_size=2)
    run_prompt(bm, "a", [1, 1, 0])
    run_prompt(bm, "b", [2, 2, 0])
    a_head = bm.block_table("a")[0]
    bm.free("a")
    bm.free("b")
    assert bm.allocate_prefix("a2", [1, 1, 5]) == 2  # a's head was the next victim; now it is in use
    assert bm.num_free_blocks == 3
    assert bm.allocate_prefix("c", [3] * 6) == 0 and bm.allocate("c", 6)
    assert a_head not in bm.block_table("c") and bm.block_table("a2") == [a_head]
    assert bm.allocate_prefix("b2", [2, 2, 0]) == 0  # b's head was evicted instead
    check_invariants(bm)


def test_free_releases_tail_before_head():
    bm = BlockManager(num_blocks=5, block_size=2)
    prompt = [1, 1, 2, 2, 0]
    run_prompt(bm, "a", prompt)
    bm.free("a")
    # Needs 3 blocks: the free one, a's unhashed tail, and one eviction, which
    # must take a's second block so its first one still serves the prefix.
    assert bm.allocate_prefix("c", [3] * 6) == 0 and bm.allocate("c", 6)
    assert bm.allocate_prefix("a2", prompt) == 2
    check_invariants(bm)


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=5, block_size=2)
    run_prompt(bm, "cached", [1, 1, 0])
    bm.free("cached")  # leaves one evictable block, which a failed allocate must not evict
    bm.allocate_prefix("a", [])
    assert bm.allocate("a", 2)
    before = (bm.block_table("a"), bm.num_free_blocks, bm.num_used_blocks)
    assert bm.num_blocks_needed("a", 10) == 4 > bm.num_free_blocks
    assert not bm.allocate("a", 10)
    assert (bm.block_table("a"), bm.num_free_blocks, bm.num_used_blocks) == before
    check_invariants(bm)
    assert bm.allocate_prefix("b", [1, 1, 0]) == 2
    assert bm.allocate("a", 6)  # exactly what is left, evicting nothing held
    assert bm.num_free_blocks == 0 and not bm.allocate("a", 7)
    assert bm.block_table("b")[0] not in bm.block_table("a")
    check_invariants(bm)


def test_duplicate_blocks_keep_the_existing_cache_entry():
    bm = BlockManager(num_blocks=10, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    for seq_id in ("a", "b"):  # both admitted before either registered: both miss
        assert bm.allocate_prefix(seq_id, prompt) == 0 and bm.allocate(seq_id, 5)
    bm.cache_full_blocks("a", prompt, 5)
    bm.cache_full_blocks("b", prompt, 5)
    a_table = bm.block_table("a")
    bm.free("a")
    bm.free("b")
    check_invariants(bm)
    assert bm.allocate_prefix("c", prompt) == 4 and bm.block_table("c") == a_table[:2]


def compute_same_block_twice(bm):
    """Sequences a and b both admitted before either registered, so both miss
    and each computes its own copy of block [1, 1]."""
    for seq_id in ("a", "b"):
        assert bm.allocate_prefix(seq_id, [1, 1, 0]) == 0 and bm.allocate(seq_id, 3)
    for seq_id in ("a", "b"):
        bm.cache_full_blocks(seq_id, [1, 1, 0], 3)


def test_duplicate_takes_over_when_the_entry_is_evicted():
    bm = BlockManager(num_blocks=5, block_size=2)
    compute_same_block_twice(bm)
    b_head = bm.block_table("b")[0]
    bm.free("a")
    assert bm.allocate_prefix("c", [2] * 4) == 0 and bm.allocate("c", 4)  # evicts a's head
    check_invariants(bm)
    assert bm.allocate_prefix("d", [1, 1, 0]) == 2 and bm.block_table("d") == [b_head]
    bm.free("d")
    bm.free("b")
    check_invariants(bm)


def test_cache_full_blocks_only_registers_computed_full_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(12))
    bm.allocate_prefix("a", prompt)
    assert bm.allocate("a", 12)
    bm.cache_full_blocks("a", prompt, 7)  # a chunked prefill stopped mid-block
    assert bm.allocate_prefix("b", prompt) == 4
    bm.cache_full_blocks("a", prompt, 12)
    assert bm.allocate_prefix("c", prompt) == 8
    with pytest.raises(ValueError):
        bm.cache_full_blocks("a", prompt, 13)
    check_invariants(bm)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=10, block_size=2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    assert run_prompt(bm, "a", prompt) == 0
    assert run_prompt(bm, "b", prompt) == 0
    assert bm.block_table("a") != bm.block_table("b")
    bm.free("a")
    assert bm.allocate_prefix("c", prompt) == 0 and bm.block_table("c") == []
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hits == 0
    check_invariants(bm)


def test_counters_count_tokens():
    bm = BlockManager(num_blocks=20, block_size=4)
    run_prompt(bm, "a", list(range(9)))  # 9 queried, 0 hit
    bm.allocate_prefix("b", list(range(9)))  # 9 queried, 8 hit
    bm.allocate_prefix("c", list(range(6)))  # 6 queried, 4 hit
    bm.allocate_prefix("d", [5] * 3)  # 3 queried, 0 hit
    assert bm.prefix_cache_queries == 27
    assert bm.prefix_cache_hits == 12


def test_allocate_prefix_twice_raises():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate_prefix("a", [1, 2])
    with pytest.raises(ValueError):
        bm.allocate_prefix("a", [1, 2])


def test_chain_collision_never_returns_another_prefix_blocks(monkeypatch):
    # A hash that ignores the parent makes every block with the same tokens
    # collide, whatever came before it. Comparing the block's own tokens is not
    # enough then; the parent must be compared too.
    monkeypatch.setattr(block_manager_module, "_chain_hash", lambda parent, token_ids: repr(token_ids).encode())
    bm = BlockManager(num_blocks=20, block_size=2)
    run_prompt(bm, "x", [1, 1, 3, 3, 0])
    run_prompt(bm, "z", [2, 2, 5, 5, 0])
    assert bm.allocate_prefix("y", [2, 2, 3, 3, 0]) == 2
    assert bm.block_table("y") == bm.block_table("z")[:1]
    check_invariants(bm)


def test_token_collision_never_returns_other_tokens(monkeypatch):
    monkeypatch.setattr(block_manager_module, "_chain_hash", lambda parent, token_ids: b"every block")
    bm = BlockManager(num_blocks=20, block_size=2)
    run_prompt(bm, "x", [1, 1, 0])
    assert bm.allocate_prefix("y", [2, 2, 0]) == 0
    run_prompt(bm, "y2", [2, 2, 0])  # collides with x's entry: stays uncached, not a duplicate
    check_invariants(bm)
    assert bm.allocate_prefix("x2", [1, 1, 0]) == 2 and bm.block_table("x2") == bm.block_table("x")[:1]


def test_trim_releases_blocks_past_the_kept_tokens():
    """Speculative decoding: slots allocated for drafts the target rejected are
    given back; the accepted prefix and its registered blocks stay."""
    bm = BlockManager(num_blocks=12, block_size=4)
    prompt = list(range(9))
    run_prompt(bm, "a", prompt)
    assert bm.allocate("a", 9 + 8)  # the last token plus 8 drafts' slots: 5 blocks
    table = bm.block_table("a")
    assert len(table) == 5 and bm.num_used_blocks == 5
    # Two drafts accepted, plus the target's token: 12 tokens, 11 computed.
    tokens = prompt + [20, 21, 22]
    bm.cache_full_blocks("a", tokens, 11)
    assert bm.trim("a", len(tokens)) == 2
    assert bm.block_table("a") == table[:3] and bm.num_used_blocks == 3
    assert bm.trim("a", len(tokens)) == 0  # idempotent
    check_invariants(bm)
    assert bm.allocate_prefix("b", tokens[:8] + [5]) == 8  # the accepted blocks still hit
    # Trimming into a shared, registered block only drops this holder.
    assert bm.trim("a", 4) == 2 and bm.block_table("a") == table[:1]
    check_invariants(bm)
    bm.free("b")
    bm.free("a")
    assert bm.num_used_blocks == 0
    check_invariants(bm)


def test_check_invariants_catches_corruption():
    def fresh():
        bm = BlockManager(num_blocks=8, block_size=2)
        run_prompt(bm, "a", [1, 1, 2])
        run_prompt(bm, "b", [3, 3, 2])
        bm.free("b")
        check_invariants(bm)
        return bm

    bm = fresh()
    bm._blocks[bm.block_table("a")[0]].ref_count += 1
    with pytest.raises(AssertionError):
        check_invariants(bm)
    bm = fresh()
    bm._free.append(bm._free[0])
    with pytest.raises(AssertionError):
        check_invariants(bm)
    bm = fresh()
    bm._tables["a"].append(BlockManager.NULL_BLOCK)
    with pytest.raises(AssertionError):
        check_invariants(bm)
    bm = fresh()
    block_id = next(iter(bm._evictable))
    bm._blocks[block_id].token_ids = (9, 9)
    with pytest.raises(AssertionError):
        check_invariants(bm)
    bm = fresh()
    bm._free.popleft()  # leaked
    with pytest.raises(AssertionError):
        check_invariants(bm)


# -- property test ------------------------------------------------------------

# A binary head makes leading blocks collide often; the tail adds variety.
prompts = st.tuples(st.lists(st.integers(0, 1), max_size=8), st.lists(st.integers(0, 3), max_size=6)).map(
    lambda parts: parts[0] + parts[1]
)


class _Seq:
    def __init__(self, token_ids, num_computed_tokens):
        self.token_ids = list(token_ids)
        self.num_computed_tokens = num_computed_tokens


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([2, 4]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.caching = caching
        self.seqs: dict[int, _Seq] = {}
        self.tables: dict[int, list[int]] = {}  # shadow, built from what the API returned
        # Per block, per slot: the token prefix whose last token was written
        # there. A slot's KV depends on every token before it, so a hit is
        # right only if each slot holds exactly the requested prefix.
        self.content: dict[int, list] = {}
        self.next_id = 0
        self.queries = self.hits = 0

    def _pick(self, index) -> int:
        ids = sorted(self.seqs)
        return ids[index % len(ids)]

    def _held_elsewhere(self, seq_id) -> set[int]:
        return {b for other, table in self.tables.items() if other != seq_id for b in table}

    def _admit(self, token_ids, min_cached=0) -> int:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        held = self._held_elsewhere(seq_id)
        free_before = self.bm.num_free_blocks
        # The scheduler's look-before-admitting calls: no side effects, and they
        # predict what allocate_prefix and then allocate will do.
        predicted_cached = self.bm.cached_prefix_len(token_ids)
        predicted_fits = self.bm.can_admit(token_ids, len(token_ids))
        assert self.bm.num_free_blocks == free_before
        assert (self.bm.prefix_cache_queries, self.bm.prefix_cache_hits) == (self.queries, self.hits)
        cached = self.bm.allocate_prefix(seq_id, token_ids)
        assert cached == predicted_cached
        assert predicted_fits == (self.bm.num_blocks_needed(seq_id, len(token_ids)) <= self.bm.num_free_blocks)
        table = self.bm.block_table(seq_id)
        assert cached % self.bs == 0 and len(table) == cached // self.bs
        if self.caching:
            assert cached <= max(0, len(token_ids) - 1)
            self.queries += len(token_ids)
            self.hits += cached
        else:
            assert cached == 0
        assert cached >= min_cached
        for i in range(cached):
            assert self.content.get(table[i // self.bs], [None] * self.bs)[i % self.bs] == tuple(token_ids[: i + 1])
        assert free_before - self.bm.num_free_blocks == len(set(table) - held)
        self.seqs[seq_id] = _Seq(token_ids, cached)
        self.tables[seq_id] = table
        return seq_id

    @rule(token_ids=prompts, compute_all=st.booleans())
    def new_sequence(self, token_ids, compute_all):
        seq_id = self._admit(token_ids)
        if compute_all:  # what the engine does when the whole prompt fits the step
            self._compute(seq_id, len(token_ids), register=True)

    @rule(token_ids=prompts)
    def short_request(self, token_ids):
        """Admit, compute and finish at once: leaves cached blocks to evict."""
        seq_id = self._admit(token_ids)
        self._compute(seq_id, len(token_ids), register=True)
        self._free(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99), num_new=st.integers(1, 8), register=st.booleans())
    def compute(self, index, num_new, register):
        self._compute(self._pick(index), num_new, register)

    def _compute(self, seq_id, num_new, register):
        seq = self.seqs[seq_id]
        start = seq.num_computed_tokens
        target = min(len(seq.token_ids), start + num_new)
        before, free_before = self.bm.block_table(seq_id), self.bm.num_free_blocks
        needed = self.bm.num_blocks_needed(seq_id, target)
        assert needed == max(0, -(-target // self.bs) - len(before))
        if not self.bm.allocate(seq_id, target):
            assert needed > free_before
            assert self.bm.block_table(seq_id) == before and self.bm.num_free_blocks == free_before
            return
        table = self.bm.block_table(seq_id)
        assert table[: len(before)] == before and len(table) == len(before) + needed
        assert free_before - self.bm.num_free_blocks == needed
        held = self._held_elsewhere(seq_id)
        for block_id in table[len(before) :]:
            assert block_id not in held
            self.content[block_id] = [None] * self.bs
        self.tables[seq_id] = table
        for i in range(start, target):
            block_id = table[i // self.bs]
            assert block_id not in held, "writing into a block another sequence holds"
            slots = self.content[block_id]
            assert slots[i % self.bs] is None, "overwriting a slot"
            slots[i % self.bs] = tuple(seq.token_ids[: i + 1])
        seq.num_computed_tokens = target
        if register:
            self.bm.cache_full_blocks(seq_id, seq.token_ids, target)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99), drafts=st.lists(st.integers(0, 3), max_size=5), accepted=st.integers(0, 5),
          bonus=st.integers(0, 3), register=st.booleans())
    def speculate(self, index, drafts, accepted, bonus, register):
        """A speculative step: compute the owed tokens plus drafts, keep the
        accepted drafts and one more token, and trim the rejected drafts' blocks."""
        seq_id = self._pick(index)
        seq = self.seqs[seq_id]
        accepted = min(accepted, len(drafts))
        real = list(seq.token_ids)
        seq.token_ids = real + drafts
        self._compute(seq_id, len(seq.token_ids) - seq.num_computed_tokens, register=False)
        if seq.num_computed_tokens < len(seq.token_ids):  # no blocks for the drafts: nothing ran
            seq.token_ids = real
            return
        seq.token_ids = real + drafts[:accepted] + [bonus]
        seq.num_computed_tokens = len(real) + accepted
        table = self.tables[seq_id]
        for i in range(seq.num_computed_tokens, len(real) + len(drafts)):
            self.content[table[i // self.bs]][i % self.bs] = None  # rejected: to be rewritten
        if register:
            self.bm.cache_full_blocks(seq_id, seq.token_ids, seq.num_computed_tokens)
        keep = -(-len(seq.token_ids) // self.bs)
        released = set(table[keep:]) - self._held_elsewhere(seq_id)
        free_before = self.bm.num_free_blocks
        assert self.bm.trim(seq_id, len(seq.token_ids)) == len(table[keep:])
        assert self.bm.num_free_blocks - free_before == len(released)
        self.tables[seq_id] = table[:keep]

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def register(self, index):
        seq_id = self._pick(index)
        seq = self.seqs[seq_id]
        self.bm.cache_full_blocks(seq_id, seq.token_ids, seq.num_computed_tokens)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99), new_tokens=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def append_tokens(self, index, new_tokens):
        self.seqs[self._pick(index)].token_ids.extend(new_tokens)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99), extra=st.lists(st.integers(0, 3), max_size=3))
    def rehit(self, index, extra):
        """Right after a sequence registered its computed tokens, a prompt
        starting with them must hit at least all their full blocks (up to the
        cap); other sequences' blocks may extend the hit."""
        seq_id = self._pick(index)
        seq = self.seqs[seq_id]
        self.bm.cache_full_blocks(seq_id, seq.token_ids, seq.num_computed_tokens)
        prompt = seq.token_ids[: seq.num_computed_tokens] + extra
        expected = min(seq.num_computed_tokens // self.bs, max(0, len(prompt) - 1) // self.bs) * self.bs
        self._admit(prompt, min_cached=expected if self.caching else 0)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def free(self, index):
        self._free(self._pick(index))

    def _free(self, seq_id):
        released = set(self.tables[seq_id]) - self._held_elsewhere(seq_id)
        free_before = self.bm.num_free_blocks
        self.bm.free(seq_id)
        del self.seqs[seq_id], self.tables[seq_id]
        assert self.bm.num_free_blocks - free_before == len(released)
        assert self.bm.block_table(seq_id) == []

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def misuse(self, index):
        seq_id = self._pick(index)
        with pytest.raises(ValueError):
            self.bm.allocate_prefix(seq_id, [0])
        self.bm.free(-1)  # unknown: no-op

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        check_invariants(bm)
        for seq_id, table in self.tables.items():
            assert bm.block_table(seq_id) == table
        held = {b for table in self.tables.values() for b in table}
        assert bm.num_used_blocks == len(held)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_usable_blocks
        assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (self.queries, self.hits)
        # Nothing a live sequence computed was overwritten by anyone else.
        for seq_id, seq in self.seqs.items():
            table = self.tables[seq_id]
            for i in range(seq.num_computed_tokens):
                assert self.content[table[i // self.bs]][i % self.bs] == tuple(seq.token_ids[: i + 1])


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase

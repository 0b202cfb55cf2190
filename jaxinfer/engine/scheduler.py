"""Continuous-batching scheduler (host): which sequences run this step, with
how many tokens, and who is preempted when the KV cache runs out.

The rule, after vLLM v1: every running sequence is owed
`num_tokens - num_computed_tokens` tokens (a prompt chunk or one decode
token). Each step pays running sequences first, oldest first, then admits
waiting ones, all within `max_num_batched_tokens` and `max_num_seqs`; a prompt
that does not fit the remaining budget is chunked, so a long prompt never
stalls the sequences already decoding. When a sequence needs a block and none
is free, the newest running sequence is preempted by recompute: its blocks are
freed and it goes back to the front of the queue with its output kept, to be
recomputed (often from the prefix cache) when there is room again.

Speculative drafts (vLLM v1's rule): a proposer leaves draft tokens on a
sequence after a step, and this step owes them as ordinary tokens: their
slots are allocated and they count against the token budget. Drafts are
only verified in a step where every sequence decodes (the verification
program has 1 + K rows per sequence, engine/programs.py), so they are
dropped when the step holds a prompt chunk, and those that do not fit the
budget or the free blocks are dropped too (drafts never preempt anyone).
That rule lives in `_schedule_drafts` and nowhere else.

LoRA: a sequence with an adapter is admitted only once its adapter holds a
device slot (lora/slots.py), which it pins until it is preempted or
finishes; when every slot is pinned by other adapters, the queue waits.

`policy="static"` is a benchmark baseline: admit a batch only when nothing is
running, then run it until every member finishes.

`policy="priority"` (vLLM's): continuous batching where the waiting queue is
admitted in order of (priority, arrival), lower first, and preemption takes
the running sequence with the largest (priority, arrival) first.

Async scheduling (engine.py): a step is scheduled while the previous one is
still on the device, against its sequences' pending tokens (sequence.py).
A running sequence whose pending token already ends it by length
(max_tokens, max_model_len) is owed nothing more, and a sequence preempted
with a pending token waits until the host has seen it (its recompute needs
the token's value).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    sequences: list[Sequence]
    # Tokens computed this step per sequence, its scheduled drafts included.
    num_new_tokens: list[int]
    # Each sequence's num_computed_tokens when scheduled: where its rows start.
    num_computed_tokens: list[int]
    # Drafts scheduled per sequence (the last num_drafts of its new tokens).
    num_drafts: list[int]
    # Async scheduling: its progress was applied at launch (OutputProcessor.expect).
    expected: bool = False

    def __len__(self):
        return len(self.sequences)

    @property
    def verifies_drafts(self) -> bool:
        return any(self.num_drafts)



class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, policy="continuous",
                 lora_slots=None, max_model_len: int | None = None):
        if policy not in ("continuous", "static", "priority"):
            raise ValueError(f"scheduling_policy must be 'continuous', 'priority' or 'static', got {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Called with a sequence whose blocks were just freed (preempted,
        # finished or aborted), so that state kept beside the KV cache (a
        # draft model's own cache) is freed with it.
        self.on_release: Callable[[Sequence], None] | None = None
        self.lora_slots = lora_slots  # LoRASlots, or None without LoRA
        self.max_model_len = max_model_len

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        """Free what a sequence holds beside its tokens: blocks and drafts."""
        self.block_manager.free(seq.seq_id)
        seq.draft_token_ids = []
        if seq.lora_slot:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = 0
        if self.on_release is not None:
            self.on_release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        counts: list[int] = []
        preempted = False
        # Oldest first (by priority first under "priority"); victims are taken from the end.
        self.running.sort(key=self._order)
        if self.policy == "priority" and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self._order))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and self._ends_by_length(seq):
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append(seq)
                counts.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: nothing after it remains running
        admit = not preempted and (self.policy != "static" or not self.running)
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_leader(seq) or seq.num_pending:
                break
            # Check before taking anything: a request that has to wait holds no
            # blocks and counts as a prefix-cache query only once admitted.
            bm, token_ids, salt = self.block_manager, seq.token_ids(), seq.prefix_cache_salt
            cached = bm.cached_prefix_len(token_ids, salt)
            num_new = min(seq.num_tokens - cached, budget)
            if not bm.can_admit(token_ids, cached + num_new, salt):
                break
            if seq.lora_int_id:
                slot = self.lora_slots.acquire(seq.lora_int_id)
                if slot is None:
                    break
                seq.lora_slot = slot
            seq.num_computed_tokens = bm.allocate_prefix(seq.seq_id, token_ids, salt)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            if not bm.allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                raise RuntimeError(f"block manager refused blocks can_admit promised to {seq.seq_id!r}")
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
            counts.append(num_new)
            budget -= num_new
        num_drafts = self._schedule_drafts(scheduled, counts, budget)
        return ScheduledBatch(scheduled, [n + d for n, d in zip(counts, num_drafts)],
                              [s.num_computed_tokens for s in scheduled], num_drafts)

    def _order(self, seq: Sequence) -> tuple[int, int]:
        return (seq.priority if self.policy == "priority" else 0, seq.arrival_order)

    def _schedule_drafts(self, scheduled: list[Sequence], counts: list[int], budget: int) -> list[int]:
        """How many of its drafts each scheduled sequence verifies this step
        (the rule in the module docstring); the rest are dropped."""
        pure_decode = all(n == 1 and s.num_computed_tokens == s.num_tokens - 1 for s, n in zip(scheduled, counts))
        num_drafts = []
        for seq in scheduled:
            drafts = seq.draft_token_ids[:budget] if pure_decode else []
            if drafts and not self.block_manager.allocate(seq.seq_id, seq.num_tokens + len(drafts)):
                drafts = []
            seq.draft_token_ids = drafts
            budget -= len(drafts)
            num_drafts.append(len(drafts))
        return num_drafts

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether its tokens, pending ones included, reach max_tokens or max_model_len."""
        return (seq.num_output_tokens >= seq.params.max_tokens
                or (self.max_model_len is not None and seq.num_tokens >= self.max_model_len))

    def _waits_for_leader(self, seq: Sequence) -> bool:
        """n > 1: hold a sibling back until completion 0 has computed the
        prompt's full blocks, which it then gets from the prefix cache."""
        leader = seq.leader
        return (
            leader is not None
            and self.block_manager.enable_prefix_caching
            and leader.status is SequenceStatus.RUNNING
            and leader.num_computed_tokens < len(seq.prompt_token_ids)
        )

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

"""One sequence being generated: its tokens, progress and outcome.

`num_computed_tokens` counts tokens whose K/V are in the cache; the scheduler
gives each running sequence `num_tokens - num_computed_tokens` more per step
(a prompt chunk, or the one token sampled last step), within the budget.
That single rule covers prefill, chunked prefill, decode, prefix-cache hits
(which start num_computed_tokens above 0) and recompute after preemption
(which resets it to 0). A request with n > 1 becomes n sequences.

Speculative decoding adds `draft_token_ids`: tokens a proposer guessed after
the last step. The scheduler owes them as ordinary tokens of the next step
(or drops them, scheduler.py); they join the sequence only as far as the
target model accepts them.

Async scheduling (engine.py) adds `num_pending`: tokens a step already on the
device will emit, which the host has not seen yet. They count in num_tokens,
so the next step can be scheduled (and its input token taken on the device)
before this one's outputs are processed; token_ids() shows them as
PLACEHOLDER. The output holds only tokens the host has seen.
"""

from __future__ import annotations

import collections.abc
import enum
from dataclasses import dataclass, field

from jaxinfer.outputs import CompletionOutput, RequestMetrics
from jaxinfer.sampling_params import SamplingParams

# A token sampled on the device that the host has not seen yet (num_pending).
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_order: int  # preemption picks the newest (largest) first
    metrics: RequestMetrics
    output: CompletionOutput = None
    detokenizer: object = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache, set on first scheduling
    status: SequenceStatus = SequenceStatus.WAITING
    eos_token_ids: frozenset = field(default_factory=frozenset)
    # For completions 1..n-1 of a request: completion 0, whose computed prompt
    # blocks they wait for so the prefix cache shares them instead of each
    # sibling computing the prompt again.
    leader: "Sequence | None" = None
    # Proposed continuation to verify in the next step (engine/spec/proposer.py).
    draft_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: where the output stands in its grammar
    # (structured/matcher.py), or None. Kept across preemption.
    structured: object = None
    # vLLM's token rules (allowed_token_ids, bad_words, min_tokens) as bitmask
    # bans (engine/token_rules.py), or None.
    token_rules: object = None
    # Scheduling priority (the "priority" policy: lower runs first, vLLM's rule).
    priority: int = 0
    # LoRA: the request's adapter (0: none) and, while the sequence is
    # admitted, the device slot it pins (lora/slots.py; 0 when none).
    lora_int_id: int = 0
    lora_slot: int = 0
    # Async scheduling: tokens an in-flight step will emit (0 or 1).
    num_pending: int = 0

    @property
    def prefix_cache_salt(self) -> bytes | None:
        """The root of its blocks' prefix-cache hash chain: K/V computed with
        an adapter differ from the base model's and from other adapters', so
        each adapter caches in its own namespace (block_manager.py)."""
        return f"lora:{self.lora_int_id}".encode() if self.lora_int_id else None

    @property
    def output_token_ids(self) -> list[int]:
        return self.output.token_ids

    @property
    def num_tokens(self) -> int:
        """Its tokens, the pending ones included (what the scheduler owes against)."""
        return len(self.prompt_token_ids) + len(self.output.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, pending ones included: the index of the next one sampled."""
        return len(self.output.token_ids) + self.num_pending

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output.token_ids + [PLACEHOLDER] * self.num_pending

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """(token_ids() + draft_token_ids)[start:end] from only the parts it
        spans: a step reads the few tokens it computes, where token_ids()
        copies the whole context (every sequence, every step)."""
        taken, offset = [], 0
        for part in (self.prompt_token_ids, self.output.token_ids, [PLACEHOLDER] * self.num_pending,
                     self.draft_token_ids):
            if start < offset + len(part) and end > offset:
                taken += part[max(start - offset, 0): end - offset]
            offset += len(part)
        return taken

    @property
    def tokens(self) -> "SequenceTokens":
        """token_ids() read in place (len and slices), for the block manager."""
        return SequenceTokens(self)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


class SequenceTokens(collections.abc.Sequence):
    """A sequence's token_ids() without the copy: its length and the slices
    asked for (the prefix cache hashes each block once it fills)."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence):
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.num_tokens

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self._seq.token_ids()[index]
            return self._seq.token_ids_between(start, max(start, stop))
        i = range(len(self))[index]  # a list's negative indices and IndexError
        return self._seq.token_ids_between(i, i + 1)[0]

"""After the device: the one path from a StepOutput to what callers see.

For every scheduled sequence it appends the tokens the step emitted (0 for a
prompt chunk that did not reach the end, 1 for a plain step, 1 + accepted
drafts after verification) one at a time through the same stop checks (EOS,
stop ids and strings, max_tokens, max_model_len), stopping at the first stop;
advances num_computed_tokens to the tokens whose K/V are now valid;
registers their full blocks in the prefix cache and trims blocks past the
sequence's length (a rejected draft's slots, which later steps rewrite);
and finishes sequences, freeing their blocks.

Structured outputs: every emitted token advances the sequence's matcher; the
sequence stops ("stop") once its grammar is complete and allows only EOS.

Async scheduling (engine.py): `expect` applies a step's progress the moment
it is launched (computed tokens, and a pending token for each sequence that
emits), so the next step can be scheduled at once; `process` later turns
each pending token into the real one through the same checks. A sequence
that finished (or was aborted) in between is skipped, and one preempted in
between gets its token without touching blocks it no longer holds.
"""

from __future__ import annotations

import logging
import time

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.request import RequestState
from jaxinfer.engine.runner import StepOutput
from jaxinfer.engine.scheduler import ScheduledBatch, Scheduler
from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, tokenizer, max_model_len: int):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # Speculative decoding: drafts verified, drafts accepted, and
        # (sequence, step) verifications of at least one draft.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0

    def expect(self, batch: ScheduledBatch, num_emitted) -> None:
        """Async scheduling, right after `batch` is launched (no drafts): its
        sequences' computed tokens, and a pending token for each that emits."""
        for i, seq in enumerate(batch.sequences):
            seq.num_computed_tokens = batch.num_computed_tokens[i] + batch.num_new_tokens[i]
            seq.num_pending += int(num_emitted[i])
        batch.expected = True

    def process(self, batch: ScheduledBatch, out: StepOutput, requests: dict[str, RequestState]) -> list[RequestOutput]:
        """Apply one step's output; returns the requests that made progress
        (finished ones for the last time: they are removed from `requests`)."""
        now = time.perf_counter()
        touched: dict[str, RequestState] = {}
        for i, seq in enumerate(batch.sequences):
            if seq.is_finished:  # async: finished or aborted while this step ran
                continue
            num_drafts, num_emitted = batch.num_drafts[i], int(out.num_emitted[i])
            seq.draft_token_ids = []
            # K/V of the tokens before the one a row emits are valid: all new
            # tokens but the drafts, then one more per accepted draft.
            computed = batch.num_computed_tokens[i] + batch.num_new_tokens[i] - num_drafts
            if num_drafts:
                self.num_draft_tokens += num_drafts
                self.num_accepted_tokens += num_emitted - 1
                self.num_verifications += 1
            if batch.expected:  # its progress is applied (expect); the pending token becomes this one
                seq.num_pending -= num_emitted
            valid = computed  # tokens whose K/V this step made valid
            for j in range(num_emitted):
                valid = computed + j
                self._append_token(seq, int(out.token_ids[i, j]), out, i, now)
                if seq.output.finish_reason is not None:
                    break
            if not batch.expected:
                seq.num_computed_tokens = valid
            if seq.status is SequenceStatus.RUNNING:  # not preempted while an async step ran
                self.block_manager.cache_full_blocks(seq.seq_id, seq.tokens, valid)
                self.block_manager.trim(seq.seq_id, seq.num_tokens)
            if num_emitted:
                touched[seq.request_id] = requests[seq.request_id]
            if seq.output.finish_reason is not None:
                seq.num_pending = 0  # a later step's token for it is dropped
                self.scheduler.finish(seq)
        results = []
        for state in touched.values():
            output = state.output()
            if output.finished:
                state.metrics.finished_time = now
                del requests[state.request_id]
            results.append(output)
        return results

    def _append_token(self, seq: Sequence, token: int, out: StepOutput, row: int, now: float) -> None:
        """Append one token and check the stops; out[row] holds its logprobs
        (only read for requests with logprobs, which never have drafts)."""
        params, completion = seq.params, seq.output
        completion.token_ids.append(token)
        seq.metrics.first_token_time = seq.metrics.first_token_time or now
        seq.metrics.last_token_time = now
        seq.metrics.num_output_tokens += 1
        if params.logprobs is not None:
            entry = {token: Logprob(float(out.logprobs[row, 0]), int(out.sampled_rank[row]))}
            for rank in range(params.logprobs):
                token_id = int(out.logprob_token_ids[row, 1 + rank])
                entry.setdefault(token_id, Logprob(float(out.logprobs[row, 1 + rank]), rank + 1))
            for token_id, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token_id]) if self.tokenizer else None
            completion.logprobs.append(entry)
            completion.cumulative_logprob += entry[token].logprob
        if seq.structured is not None:
            if not seq.structured.accept(token):
                # Only when llguidance gave up (out of fuel): the output can no longer follow the grammar.
                log.error("request %s: structured output stopped: %s", seq.request_id, seq.structured.error)
                completion.finish_reason = "stop"
            elif seq.structured.is_finished:
                completion.finish_reason = "stop"
        stop_token = token in (params.stop_token_ids or ()) or token in seq.eos_token_ids
        if stop_token:
            completion.finish_reason = "stop"
            completion.stop_reason = token if token in (params.stop_token_ids or ()) else None
        # Stop strings count from min_tokens on (vLLM's rule; EOS and stop ids are masked until then).
        check_stops = len(completion.token_ids) >= params.min_tokens
        if seq.detokenizer is not None:
            before = len(completion.text)
            if not stop_token or params.include_stop_str_in_output:  # vLLM: the stop token's text is not output
                completion.text += seq.detokenizer.add([token])
            if completion.finish_reason is None and check_stops:
                _cut_at_stop_string(completion, params, before)
        if completion.finish_reason is None and (
            len(completion.token_ids) >= params.max_tokens
            or len(seq.prompt_token_ids) + len(completion.token_ids) >= self.max_model_len
        ):
            completion.finish_reason = "length"
        if completion.finish_reason is not None and seq.detokenizer is not None and not isinstance(
            completion.stop_reason, str
        ):
            before = len(completion.text)
            completion.text += seq.detokenizer.flush()  # bytes held back for a character that never completed
            if check_stops:
                _cut_at_stop_string(completion, params, before)


def _cut_at_stop_string(completion: CompletionOutput, params, checked: int) -> bool:
    """End the completion at the first stop string in its text; the stop
    string itself is not returned unless include_stop_str_in_output (vLLM's
    default and option). The text before `checked` held no stop string, so
    only a string ending after it can be new: the search starts the longest
    stop string minus one character earlier. Each token then costs the stop
    strings times the few characters it added, not times the whole output."""
    stop = params.stop
    if not stop:
        return False
    start = max(0, checked - max(map(len, stop)) + 1)
    text = completion.text
    hits = [(position, s) for s in stop if (position := text.find(s, start)) >= 0]
    if not hits:
        return False
    position, string = min(hits)
    completion.text = text[:position + len(string)] if params.include_stop_str_in_output else text[:position]
    completion.finish_reason, completion.stop_reason = "stop", string
    return True

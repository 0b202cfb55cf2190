"""What the engine asks of a draft proposer, and which sequences it asks for.

A proposer has four members (and an EAGLE proposer a fifth, `observe`, fed
the target's features of every step; spec/eagle.py):

    propose(seqs, caps) -> list[list[int]]   up to caps[i] draft tokens per sequence
    sync(seq)        after the step's output processing: the sequence's
                     accepted tokens are final (a draft model rolls its cache
                     back to them)
    release(seq)     the sequence was preempted, finished or aborted
    num_compilations, device_time   for LLMEngine.stats()

Drafts are proposed only for the sequences of a pure-decode step (every
scheduled sequence owes exactly its last token), and only for requests
without repetition/presence/frequency penalties and without logprobs: the
verification program implements neither for draft rows, so those requests
decode one token per step, in the same batch as the speculating ones. Steps
that contain a prompt chunk (prefill) run without drafts altogether.
"""

from __future__ import annotations

from jaxinfer.engine.request import Sequence
from jaxinfer.engine.runner import uses_penalties
from jaxinfer.spec.config import SpeculativeConfig


def max_drafts(seq: Sequence, num_speculative_tokens: int, max_model_len: int) -> int:
    """How many drafts this sequence may verify now: 0 when it must not
    speculate, else K capped so that accepted drafts plus the target's own
    token never pass max_tokens or max_model_len."""
    params = seq.params
    if params.logprobs is not None or uses_penalties(seq):
        return 0
    remaining = params.max_tokens - len(seq.output_token_ids)
    return max(0, min(num_speculative_tokens, remaining - 1, max_model_len - seq.num_tokens - 1))


def build_proposer(spec: SpeculativeConfig, draft_model=None, engine_config=None, num_blocks: int = 0,
                   progress: bool = True):
    """The proposer for `spec`; draft_model: the loaded draft (load_draft_model),
    or for "eagle" the target itself (the head reuses its embedding and head)."""
    if spec.method == "ngram":
        from jaxinfer.spec.ngram import NgramProposer

        return NgramProposer(spec.max_n, spec.min_n)
    if spec.method == "eagle":
        from jaxinfer.spec.eagle import EagleProposer

        return EagleProposer(draft_model, engine_config, spec, progress)
    from jaxinfer.spec.draft_model import DraftModelProposer

    return DraftModelProposer(draft_model, engine_config, num_blocks, spec.num_speculative_tokens, progress)

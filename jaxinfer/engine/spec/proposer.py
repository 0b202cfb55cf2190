"""What the engine asks of a draft proposer, and which sequences it asks for.

After every step the engine calls `after_step(batch, out, started)`: the proposer
first takes in the step's results (`update`: a draft model rolls its cache
back to the accepted tokens, an EAGLE proposer keeps the target's features
of the accepted positions), then proposes drafts for every sequence of the
batch that will decode next step. The drafts go on the sequence
(`draft_token_ids`); the scheduler owes them in the next step as ordinary
tokens or drops them (engine/scheduler.py says when).

A sequence is offered up to K drafts, fewer near max_tokens or
max_model_len, and none when it has repetition/presence/frequency penalties
or logprobs (the verification program implements neither for draft rows) or
structured outputs (drafts are not checked against the grammar), so those
requests decode one token per step, in the same batch as the speculating ones.
When more sequences decode than `disable_by_batch_size`, nobody is offered
drafts for that step (a batch that large is faster without verification
rows); below it, with "adaptive" on (the default), nobody is offered drafts
while the measured cost of drafting steps says they are slower than plain
ones (engine/spec/policy.py). The step itself runs as always, and proposers
catch up on the tokens they skipped the next time they draft.

A proposer implements:

    propose(seqs, caps) -> list[list[int]]   up to caps[i] draft tokens per sequence
    update(batch, out)  the step's results are final (optional)
    release(seq)        the sequence was preempted, finished or aborted (optional)
    programs()          what its warm-up compiled; num_compilations, device_time
                        for LLMEngine.stats()
    needs_features      whether update() reads the target's features
"""

from __future__ import annotations

import time

from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.spec.config import SpeculativeConfig
from jaxinfer.engine.spec.policy import DraftPolicy


class Proposer:
    num_compilations = 0
    device_time = 0.0
    # Whether update() reads StepOutput.features (the target's runner then returns them).
    needs_features = False

    def __init__(self, num_speculative_tokens: int, max_model_len: int, disable_by_batch_size: int | None = None,
                 adaptive: bool = False):
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.disable_by_batch_size = disable_by_batch_size
        self.policy = DraftPolicy() if adaptive else None

    def max_drafts(self, seq: Sequence) -> int:
        """How many drafts this sequence may verify next step: 0 when it must
        not speculate, else K capped so that accepted drafts plus the target's
        own token never pass max_tokens or max_model_len."""
        params = seq.params
        if params.logprobs is not None or params.uses_penalties or params.constrains_tokens:
            return 0
        remaining = params.max_tokens - len(seq.output_token_ids)
        return max(0, min(self.k, remaining - 1, self.max_model_len - seq.num_tokens - 1))

    def after_step(self, batch: ScheduledBatch, out, started: float | None) -> None:
        """started: when the step began (time.perf_counter()), for the adaptive
        rule's timings; None when the step's time says nothing of its cost."""
        self.update(batch, out)
        # Finished sequences are gone; one that still owes prompt tokens does not decode next.
        decoding = [s for s in batch.sequences if not s.is_finished and s.num_computed_tokens == s.num_tokens - 1]
        drafted = False
        if (decoding and (self.disable_by_batch_size is None or len(decoding) <= self.disable_by_batch_size)
                and (self.policy is None or self.policy.should_draft(len(decoding)))):
            caps = [self.max_drafts(s) for s in decoding]
            seqs = [s for s, cap in zip(decoding, caps) if cap]
            if seqs:
                for seq, drafts in zip(seqs, self.propose(seqs, [cap for cap in caps if cap])):
                    seq.draft_token_ids = drafts
                    drafted = drafted or bool(drafts)
        if self.policy is not None:
            self.policy.record(batch, out, drafted, None if started is None else time.perf_counter() - started)

    def propose(self, seqs: list[Sequence], caps: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def programs(self) -> list[tuple]:
        return []

    def update(self, batch: ScheduledBatch, out) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class NoProposer(Proposer):
    """The engine without speculative decoding: no drafts, ever."""

    def __init__(self):
        super().__init__(0, 0)

    def after_step(self, batch, out, started) -> None:
        pass


def build_proposer(spec: SpeculativeConfig | None, draft_model=None, engine_config=None, num_blocks: int = 0,
                   progress: bool = True) -> Proposer:
    """The proposer for `spec`; draft_model: the loaded draft (load_draft_model),
    or for "eagle" the target itself (the head reuses its embedding and head)."""
    if spec is None:
        return NoProposer()
    if spec.method == "ngram":
        from jaxinfer.engine.spec.ngram import NgramProposer

        return NgramProposer(engine_config, spec)
    if spec.method == "eagle":
        from jaxinfer.engine.spec.eagle import EagleProposer

        return EagleProposer(draft_model, engine_config, spec, progress)
    from jaxinfer.engine.spec.draft_model import DraftModelProposer

    return DraftModelProposer(draft_model, engine_config, spec, num_blocks, progress)

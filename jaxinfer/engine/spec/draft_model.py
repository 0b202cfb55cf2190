"""Draft-model proposer: a second model with the target's vocabulary proposes
drafts greedily, on its own paged KV cache, run by its own ModelRunner
(forward programs only: a draft is the argmax of the draft's logits).

State per sequence (seq_id): blocks in the draft's BlockManager and the
number of leading tokens whose K/V the draft cache holds. A proposal feeds
every token the draft cache lacks, in chunks within max_num_batched_tokens
(the whole prompt the first time, possibly served by the draft's own prefix
cache; afterwards the one or two tokens of the last step); the step that
feeds the last token yields draft 1, and each further step feeds the
previous draft. Draft j sits at position n - 1 + j for a sequence of n
tokens; the last draft is never fed.

After each target step (`update`) the draft cache is rolled back to the
target's accepted length: tokens [0, target num_computed) are the same in both, and
the draft fed exactly those plus drafts, so its valid length is
min(fed, target num_computed); slots past it are rewritten before they are
read, and blocks past the sequence's length are trimmed. Only those valid
tokens are registered in the draft's prefix cache. On preemption, finish or
abort (`release`) the draft's blocks are freed; a recomputed sequence starts
again from the draft's prefix cache.

Drafts are greedy, also for sampled requests: the proposal distribution is
then one-hot (engine/verify.py), which keeps the target's output
distribution exact and ships no [K, vocab] distributions to
the verifier, at the price of a lower acceptance rate at high temperature
than sampling from the draft's own distribution would give.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.executable_cache import ExecutableCache
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.spec.config import SpeculativeConfig
from jaxinfer.engine.spec.proposer import Proposer
from jaxinfer.loading.model import Model, load
from jaxinfer.models import kv_cache


def load_draft_model(spec: SpeculativeConfig, target: Model, progress: bool = True) -> Model:
    """The draft for `spec`: spec.model loaded like the target (same dtype,
    spec.quantization passed to `load`), or with spec.model None the target
    itself (sharing its weights, or a quantized copy of them)."""
    if spec.model is None:
        if spec.quantization is None:
            return target
        if spec.quantization == "gguf":
            raise ValueError('speculative: quantization="gguf" needs speculative["model"] = the .gguf path')
        if target.quantization is not None:
            # Quantizing in memory starts from float weights; a second rounding of
            # the target's own codes is not a draft anyone asked for.
            raise ValueError(
                f"speculative: quantization={spec.quantization!r} makes the draft a quantized copy of the "
                f"target's float weights, but the target holds its weights as {target.quantization!r}; load the "
                'target with quantization=None, or give speculative["model"] a checkpoint to draft with')
        from jaxinfer.quant.params import quantize_params

        params = quantize_params(target.params, spec.quantization)
        if target.mesh is not None:
            from jaxinfer.parallel.placement import shard_params

            params = shard_params(params, target.mesh)
        return Model(target.config, params, target.tokenizer, target.dtype,
                     f"{target.source} ({spec.quantization} draft)", mesh=target.mesh, backend=target.backend)
    # On the target's mesh: the draft is sharded the same way (its head counts must allow it).
    draft = load(spec.model, dtype=target.dtype, progress=progress, mesh=target.mesh, quantization=spec.quantization,
                 backend=target.backend)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative: the draft model {draft.source} has vocab_size {draft.config.vocab_size} but the target "
            f"has {target.config.vocab_size}; a draft must share the target's tokenizer"
        )
    return draft


@jax.jit
def _argmax_step(logits):
    # Drafts are greedy; the lowest id wins ties, as in the sampler's greedy rows.
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclass(eq=False)
class _Proposal:
    """One sequence's proposal in progress."""

    seq_id: int
    context: Sequence[int]  # the sequence's tokens, read in place (Sequence.tokens: no copy a step)
    num_computed_tokens: int  # tokens whose K/V the draft cache holds
    cap: int
    drafts: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """The tokens to feed: the context, then the drafts so far but the
        cap-th (the last draft is never fed)."""
        return len(self.context) + min(len(self.drafts), self.cap - 1)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """(context + fed drafts)[start:end], reading only the part asked for."""
        n = len(self.context)
        return list(self.context[start:min(end, n)]) + self.drafts[max(start - n, 0):max(end - n, 0)]


class DraftModelProposer(Proposer):
    def __init__(self, draft: Model, config, spec: SpeculativeConfig, num_blocks: int, progress: bool = True):
        super().__init__(spec.num_speculative_tokens, config.max_model_len, spec.disable_by_batch_size,
                         spec.adaptive)
        self.model = draft
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        cache = kv_cache.allocate_kv_cache(draft.config, num_blocks, config.block_size, draft.dtype,
                                           config.kv_cache_dtype, mesh=draft.mesh,
                                           fp8_dtype=draft.backend.kv_fp8_dtype, zeros=draft.backend.zeros)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(
            draft.config, draft.params, cache, config.block_size, config.max_model_len, config.max_num_seqs,
            config.max_num_batched_tokens, draft.backend.with_attention(config.attention), sampling=False,
            mesh=draft.mesh,
            executable_cache=ExecutableCache.default(draft.mesh),
        )
        self.runner.warmup(progress)
        self._argmax_sizes = sorted({s for _, s, _ in self.runner.buckets()})
        for num_seqs in self._argmax_sizes:
            _argmax_step(self.runner._put(np.zeros((num_seqs, draft.config.vocab_size), np.float32)))
        self._computed: dict[int, int] = {}  # seq_id -> valid tokens in the draft cache
        self._fed: dict[int, int] = {}  # seq_id -> tokens fed by the last proposal (drafts included)

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations + len(self._argmax_sizes)

    def programs(self) -> list[tuple]:
        return self.runner.programs() + [("argmax", s) for s in self._argmax_sizes]

    def propose(self, seqs, caps: list[int]) -> list[list[int]]:
        proposals: list[_Proposal | None] = []
        bm = self.block_manager
        for seq, cap in zip(seqs, caps):
            tokens = seq.tokens
            if seq.seq_id not in self._computed:
                self._computed[seq.seq_id] = bm.allocate_prefix(seq.seq_id, tokens)
            # The last draft fed is draft cap - 1, at position len(tokens) + cap - 2.
            if not bm.allocate(seq.seq_id, len(tokens) + cap - 1):
                proposals.append(None)  # the draft cache is full: this sequence decodes without drafts
                continue
            proposals.append(_Proposal(seq.seq_id, tokens, self._computed[seq.seq_id], cap))
        # Every proposal owes the tokens its cache lacks (the whole prompt the
        # first time, afterwards the one or two tokens of the last step), then
        # one per further draft: paid like the target's scheduler pays them,
        # chunked within the token budget.
        pending = [p for p in proposals if p is not None]
        while pending:
            budget, batch, counts = self.max_num_batched_tokens, [], []
            for p in pending:
                if budget == 0 or len(batch) == self.max_num_seqs:
                    break
                num = min(p.num_tokens - p.num_computed_tokens, budget)
                batch.append(p)
                counts.append(num)
                budget -= num
            for p, num, token in zip(batch, counts, self._step(batch, counts)):
                p.num_computed_tokens += num
                if p.num_computed_tokens == p.num_tokens:  # the step fed its last token: a draft
                    p.drafts.append(token)
            pending = [p for p in pending if len(p.drafts) < p.cap]
        for p in filter(None, proposals):
            self._fed[p.seq_id] = p.num_computed_tokens
        return [p.drafts if p is not None else [] for p in proposals]

    def _step(self, batch: list[_Proposal], counts: list[int]) -> list[int]:
        tables = [self.block_manager.block_table_array(p.seq_id) for p in batch]
        step_tokens = [p.tokens_between(p.num_computed_tokens, p.num_computed_tokens + n)
                       for p, n in zip(batch, counts)]
        inputs = self.runner.inputs(step_tokens, [p.num_computed_tokens for p in batch], counts, tables)
        start = time.perf_counter()
        logits, _ = self.runner.forward(inputs)
        tokens = np.asarray(_argmax_step(logits))
        self.device_time += time.perf_counter() - start
        return tokens[: len(batch)].tolist()

    def update(self, batch, out) -> None:
        """Roll the draft cache back to what the target accepted: tokens
        [0, target num_computed) are the same in both, and the draft fed
        exactly those plus drafts."""
        for seq in batch.sequences:
            fed = self._fed.pop(seq.seq_id, None)
            if fed is None or seq.is_finished:
                continue
            computed = min(fed, seq.num_computed_tokens)
            self._computed[seq.seq_id] = computed
            self.block_manager.cache_full_blocks(seq.seq_id, seq.tokens, computed)
            self.block_manager.trim(seq.seq_id, seq.num_tokens)

    def release(self, seq) -> None:
        self._computed.pop(seq.seq_id, None)
        self._fed.pop(seq.seq_id, None)
        self.block_manager.free(seq.seq_id)

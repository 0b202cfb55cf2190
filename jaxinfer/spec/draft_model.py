"""Draft-model proposer: a second model with the target's vocabulary proposes
drafts greedily, on its own paged KV cache, run by its own ModelRunner.

State per sequence (seq_id): blocks in the draft's BlockManager and the
number of leading tokens whose K/V the draft cache holds. A proposal
(1) catches up: feeds every token the draft cache lacks, in chunks within
max_num_batched_tokens (the whole prompt the first time, possibly served by
the draft's own prefix cache; afterwards the one or two tokens of the last
step), and the step that feeds the last token yields draft 1; (2) runs one
decode step per further draft, feeding the previous draft. Draft j sits at
position n - 1 + j for a sequence of n tokens; the last draft is never fed.

After verification (`sync`) the draft cache is rolled back to the target's
accepted length: tokens [0, target num_computed) are the same in both, and
the draft fed exactly those plus drafts, so its valid length is
min(fed, target num_computed); slots past it are rewritten before they are
read, and blocks past the sequence's length are trimmed. Only those valid
tokens are registered in the draft's prefix cache. On preemption, finish or
abort (`release`) the draft's blocks are freed; a recomputed sequence starts
again from the draft's prefix cache.

Drafts are greedy, also for sampled requests: the proposal distribution is
then one-hot (draft_probs = None in spec/acceptance.verify), which keeps the
target's output distribution exact and ships no [K, vocab] distributions to
the verifier, at the price of a lower acceptance rate at high temperature
than sampling from the draft's own distribution would give.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import numpy as np

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.model import Model, load
from jaxinfer.models import kv_cache
from jaxinfer.spec.config import SpeculativeConfig


def load_draft_model(spec: SpeculativeConfig, target: Model, progress: bool = True) -> Model:
    """The draft for `spec`: spec.model loaded like the target (same dtype,
    spec.quantization passed to `load`), or with spec.model None the target
    itself (sharing its weights, or a quantized copy of them)."""
    if spec.model is None:
        if spec.quantization is None:
            return target
        if spec.quantization == "gguf":
            raise ValueError('speculative: quantization="gguf" needs speculative["model"] = the .gguf path')
        from jaxinfer.quant.params import quantize_params

        params = quantize_params(target.params, spec.quantization)
        if target.mesh is not None:
            from jaxinfer.parallel.placement import shard_params

            params = shard_params(params, target.mesh)
        return Model(target.config, params, target.tokenizer, target.dtype,
                     f"{target.source} ({spec.quantization} draft)", mesh=target.mesh)
    kwargs = {}
    if spec.quantization is not None:
        if "quantization" not in inspect.signature(load).parameters:
            raise ValueError("speculative['quantization'] is not supported: load() takes no quantization argument")
        kwargs["quantization"] = spec.quantization
    # On the target's mesh: the draft is sharded the same way (its head counts must allow it).
    draft = load(spec.model, dtype=target.dtype, progress=progress, mesh=target.mesh, **kwargs)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative: the draft model {draft.source} has vocab_size {draft.config.vocab_size} but the target "
            f"has {target.config.vocab_size}; a draft must share the target's tokenizer"
        )
    return draft


@dataclass(eq=False)
class _DraftView:
    """A sequence as the draft's runner sees it (what ModelRunner.prepare reads)."""

    seq_id: int
    tokens: list[int]  # the sequence's tokens, then the drafts proposed so far
    num_computed_tokens: int  # tokens fed to the draft cache
    cap: int
    drafts: list[int] = field(default_factory=list)

    def token_ids(self) -> list[int]:
        return self.tokens


class DraftModelProposer:
    def __init__(self, draft: Model, config, num_blocks: int, num_speculative_tokens: int, progress: bool = True):
        self.model = draft
        self.k = num_speculative_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        cache = kv_cache.allocate_kv_cache(draft.config, num_blocks, config.block_size, draft.dtype,
                                           config.kv_cache_dtype, mesh=draft.mesh)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(
            draft.config, draft.params, cache, config.block_size, config.max_model_len, config.max_num_seqs,
            config.max_num_batched_tokens, config.attention_backend, greedy_only=True, mesh=draft.mesh,
        )
        self.runner.warmup(progress)
        self._computed: dict[int, int] = {}  # seq_id -> valid tokens in the draft cache
        self._fed: dict[int, int] = {}  # seq_id -> tokens fed by the last proposal (drafts included)
        self.device_time = 0.0

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def propose(self, seqs, caps: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        views: list[tuple[int, _DraftView]] = []
        bm = self.block_manager
        for i, (seq, cap) in enumerate(zip(seqs, caps)):
            if cap <= 0:
                continue
            tokens = seq.token_ids()
            if seq.seq_id not in self._computed:
                self._computed[seq.seq_id] = bm.allocate_prefix(seq.seq_id, tokens)
            # The last draft fed is draft cap - 1, at position len(tokens) + cap - 2.
            if not bm.allocate(seq.seq_id, len(tokens) + cap - 1):
                continue  # the draft cache is full: this sequence decodes without drafts this step
            views.append((i, _DraftView(seq.seq_id, list(tokens), self._computed[seq.seq_id], cap)))
        pending = [v for _, v in views]
        while pending:  # catch up, chunked like the target's prefill
            budget, batch, counts = self.max_num_batched_tokens, [], []
            for v in pending:
                if budget == 0 or len(batch) == self.max_num_seqs:
                    break
                num = min(len(v.tokens) - v.num_computed_tokens, budget)
                batch.append(v)
                counts.append(num)
                budget -= num
            for v, num, token in zip(batch, counts, self._step(batch, counts)):
                v.num_computed_tokens += num
                if v.num_computed_tokens == len(v.tokens):
                    v.drafts.append(token)
            pending = [v for v in pending if not v.drafts]
        for _ in range(1, self.k):
            batch = [v for _, v in views if len(v.drafts) < v.cap]
            if not batch:
                break
            for v in batch:
                v.tokens.append(v.drafts[-1])
            for v, token in zip(batch, self._step(batch, [1] * len(batch))):
                v.num_computed_tokens += 1
                v.drafts.append(token)
        for i, v in views:
            self._fed[v.seq_id] = v.num_computed_tokens
            drafts[i] = v.drafts
        return drafts

    def _step(self, batch: list[_DraftView], counts: list[int]) -> list[int]:
        tables = [self.block_manager.block_table(v.seq_id) for v in batch]
        inputs, _ = self.runner.prepare(ScheduledBatch(batch, counts), tables)
        start = time.perf_counter()
        tokens = np.asarray(self.runner.run_greedy(inputs))
        self.device_time += time.perf_counter() - start
        return tokens[: len(batch)].tolist()

    def sync(self, seq) -> None:
        fed = self._fed.pop(seq.seq_id, None)
        if fed is None or seq.seq_id not in self._computed:
            return
        computed = min(fed, seq.num_computed_tokens)
        self._computed[seq.seq_id] = computed
        token_ids = seq.token_ids()
        self.block_manager.cache_full_blocks(seq.seq_id, token_ids, computed)
        self.block_manager.trim(seq.seq_id, len(token_ids))

    def release(self, seq) -> None:
        self._computed.pop(seq.seq_id, None)
        self._fed.pop(seq.seq_id, None)
        self.block_manager.free(seq.seq_id)

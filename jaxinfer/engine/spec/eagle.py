"""EAGLE proposer: drafts from the trained draft head (engine/spec/eagle_head.py)
over the target's own features.

The target's step returns the pre-norm hidden state of every row it computes
(StepOutput.features); after each step `update` keeps each sequence's rows
of the positions the target accepted (a verification step's rejected rows
are dropped), so each sequence holds the features of its last
`window` computed positions on the host (window x hidden floats: 37 KB for
the default model). A proposal for a sequence of n tokens, whose last token
x_{n-1} is owed, builds the window entries (x_q, f_{q-1}) for the last L <=
window positions q ending at n - 1, runs the head over them once, and then
K - 1 single-entry steps that feed each draft with the head's own predicted
feature (the head's K/V for the window live only inside that one jitted call).

A sequence whose features have a gap (its prompt was served from the prefix
cache, so the target never computed those positions) drafts from the
features it has, as long as there is at least one; right after a full
prefix hit of all but one token it decodes one step without drafts. Drafts
are greedy (see engine/spec/draft_model.py for why that keeps sampling exact).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.models.attention import attention_reference
from jaxinfer.engine.spec.eagle_head import (DEFAULT_HEAD, draft_logits, head_features, load_head,
                                             to_target_ids)
from jaxinfer.engine.spec.proposer import Proposer
from jaxinfer.utils import bucket_size, powers_of_two


def _buffer_attention(write_index, limit, num_entries: int):
    """Attention for the head inside one drafting call: writes the new rows'
    K/V into per-sequence buffers of num_entries entries at write_index [S, t]
    and attends causally to entries below `limit` [S] (the valid ones so far)."""
    key_index = jnp.arange(num_entries, dtype=jnp.int32)

    def attend(q, k, v, cache, layer_index):
        k_buf, v_buf = cache
        rows = jnp.arange(k.shape[0])[:, None]
        k_buf = k_buf.at[rows, write_index].set(k)
        v_buf = v_buf.at[rows, write_index].set(v)
        batch = k.shape[0]
        valid = key_index[None, :] < limit[:, None]
        out = attention_reference(q, k_buf, v_buf, write_index, jnp.broadcast_to(key_index, (batch, num_entries)),
                                  k_valid=valid)
        return out, (k_buf, v_buf)

    return attend


@functools.partial(jax.jit, static_argnames=("config", "num_drafts", "backend"))
def draft_tokens(head, target_params, tokens, features, first_position, lengths, *, config: ModelConfig,
                 num_drafts: int, backend):
    """Greedy drafts [S, num_drafts] from window entries tokens [S, W],
    features [S, W, hidden] (entry i: token at position first_position + i
    and the feature of the position before it), the first lengths[s] valid."""
    num_seqs, window = tokens.shape
    c = config
    num_entries = window + num_drafts
    shape = (num_seqs, num_entries, c.num_kv_heads, c.head_dim)
    dtype = target_params["final_norm"].dtype
    cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    rows = jnp.arange(num_seqs)
    index = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (num_seqs, window))
    out, cache = head_features(head, target_params, c, tokens, features, first_position[:, None] + index,
                               _buffer_attention(index, lengths, num_entries), cache, backend=backend)
    feature = out[rows, lengths - 1]
    drafts = []
    for j in range(num_drafts):
        # The argmax over the draft vocabulary, as a target id (what is verified and fed back).
        logits = draft_logits(head, target_params, c, feature, backend=backend)
        token = to_target_ids(head, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        drafts.append(token)
        if j + 1 == num_drafts:
            break
        at = (lengths + j)[:, None]
        out, cache = head_features(head, target_params, c, token[:, None], feature[:, None], first_position[:, None] + at,
                                   _buffer_attention(at, lengths + j + 1, num_entries), cache, backend=backend)
        feature = out[:, 0]
    return jnp.stack(drafts, axis=1)


class EagleProposer(Proposer):
    needs_features = True

    def __init__(self, target, engine_config, spec, progress: bool = True):
        super().__init__(spec.num_speculative_tokens, engine_config.max_model_len, spec.disable_by_batch_size,
                         spec.adaptive)
        if target.config.num_experts:
            raise ValueError("speculative method 'eagle' does not support mixtures of experts yet (its head is one "
                             "dense layer of the target's shape); use 'ngram' or 'draft_model'")
        self.target = target
        self.config = target.config
        self.head, self.window = load_head(spec.model or DEFAULT_HEAD, target.config, target.dtype)
        self.head = target.backend.arrange_eagle_head(self.head)
        self.device_time = 0.0
        self.buckets = powers_of_two(1, engine_config.max_num_seqs)  # the runner's decode buckets
        self._features: dict[int, tuple[int, np.ndarray]] = {}  # seq_id -> (end position, [<= window, hidden])
        for num_seqs in tqdm(self.buckets, desc="compiling draft head", disable=not progress, leave=False):
            self._draft(np.zeros((num_seqs, self.window), np.int32),
                        np.zeros((num_seqs, self.window, self.config.hidden_size), np.float32),
                        np.zeros(num_seqs, np.int32), np.ones(num_seqs, np.int32))
        self.num_compilations = len(self.buckets)

    def programs(self) -> list[tuple]:
        return [("draft_head", n) for n in self.buckets]

    def _draft(self, tokens, features, first_position, lengths) -> np.ndarray:
        start = time.perf_counter()
        out = np.asarray(draft_tokens(self.head, self.target.params, tokens, features.astype(self.target.dtype),
                                      first_position, lengths, config=self.config, num_drafts=self.k,
                                      backend=self.target.backend))
        self.device_time += time.perf_counter() - start
        return out

    def update(self, batch, out) -> None:
        """Keep, per sequence, the features of the positions the target has now
        computed (a verification step's rejected rows are dropped), at most
        `window` of the latest."""
        start = time.perf_counter()
        features = np.asarray(out.features)
        self.device_time += time.perf_counter() - start
        for i, seq in enumerate(batch.sequences):
            if seq.is_finished:  # released already
                continue
            first = batch.num_computed_tokens[i]
            rows = features[out.row_start[i]: out.row_start[i + 1]][: max(0, seq.num_computed_tokens - first)]
            end, kept = self._features.get(seq.seq_id, (None, None))
            if kept is not None and end == first:  # contiguous with what is kept
                rows = np.concatenate([kept, rows])
            self._features[seq.seq_id] = (seq.num_computed_tokens if len(rows) else first, rows[-self.window:])

    def release(self, seq) -> None:
        self._features.pop(seq.seq_id, None)

    def propose(self, seqs, caps: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        chosen = []
        for i, seq in enumerate(seqs):
            end, kept = self._features.get(seq.seq_id, (None, None))
            # Features through position n - 2 are needed for the entry of the owed token x_{n-1}.
            if kept is not None and len(kept) and end == seq.num_tokens - 1:
                chosen.append(i)
        if not chosen:
            return drafts
        num_seqs = bucket_size(len(chosen), 1)
        tokens = np.zeros((num_seqs, self.window), np.int32)
        features = np.zeros((num_seqs, self.window, self.config.hidden_size), np.float32)
        first_position = np.zeros(num_seqs, np.int32)
        lengths = np.ones(num_seqs, np.int32)
        for row, i in enumerate(chosen):
            seq = seqs[i]
            end, kept = self._features[seq.seq_id]
            length = len(kept)
            # Entries for positions end - length + 1 .. end (= n - 1), features of end - length .. end - 1.
            tokens[row, :length] = seq.token_ids_between(end - length + 1, end + 1)
            features[row, :length] = kept
            first_position[row] = end - length + 1
            lengths[row] = length
        out = self._draft(tokens, features, first_position, lengths)
        for row, i in enumerate(chosen):
            drafts[i] = out[row, : caps[i]].tolist()
        return drafts

"""Logprobs of a prompt's own tokens: vLLM's `prompt_logprobs`, and OpenAI's
`echo` with `logprobs` (how lm-eval-harness scores loglikelihood).

The engine computes logits only at the rows that sample, so the prompt's
rows are scored by a separate pass: the model's full-sequence forward
without a cache (`Model.logits`, loading/model.py; padded to a power-of-two
length, so at most log2(max_model_len) programs compile, each on first
use). It runs on its own worker thread (one at a time: each pass holds
[prompt tokens, vocab] float32 logits on the host), beside the engine
thread, which keeps stepping; it does not see LoRA adapters, so the server
refuses it for adapter models. Position i's entry scores token i given
tokens 0..i-1; the first token has none (None), as in vLLM.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.outputs import Logprob

_ROWS_PER_CHUNK = 256  # rows of log-softmax at a time: bounds the temporaries


def prompt_logprobs(model, tokenizer, token_ids: list[int], k: int) -> list[dict[int, Logprob] | None]:
    """[None, {token: Logprob, and the top k}...] for the prompt's tokens."""
    ids = np.asarray(token_ids, np.int64)
    if len(ids) < 2:
        return [None] * len(ids)
    logits = model.logits(ids[:-1])  # float32 [T - 1, vocab]: row i predicts token i + 1
    entries: list[dict[int, Logprob] | None] = [None]
    for start in range(0, len(ids) - 1, _ROWS_PER_CHUNK):
        rows = logits[start:start + _ROWS_PER_CHUNK].astype(np.float64)
        targets = ids[start + 1:start + 1 + len(rows)]
        peak = rows.max(axis=1, keepdims=True)
        logprobs = rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))
        chosen = logprobs[np.arange(len(rows)), targets]
        ranks = 1 + (logprobs > chosen[:, None]).sum(axis=1)
        top = np.argsort(-logprobs, axis=1, kind="stable")[:, :k] if k else np.zeros((len(rows), 0), np.int64)
        for r, target in enumerate(targets):
            entry = {int(target): Logprob(float(chosen[r]), int(ranks[r]))}
            for rank, token in enumerate(top[r], start=1):
                entry.setdefault(int(token), Logprob(float(logprobs[r, token]), rank))
            for token, lp in entry.items():
                lp.decoded_token = tokenizer.decode([token]) if tokenizer is not None else None
            entries.append(entry)
    return entries

"""Host-side numpy sampler: the plain, exact reference for token selection
(tests only; the engine samples on the device, jaxinfer/engine/sampler.py).

Everything is computed in float64 on one 1-D logit vector. The pipeline of
`sample_next_token` is the one vLLM uses:

1. penalties (repetition, then frequency, then presence) on the raw logits;
   logprobs are reported from this distribution;
2. temperature == 0: argmax, done;
3. divide by temperature;
4. top-k, then top-p, then min-p, each step on the probabilities left by the
   previous one (softmax over the surviving tokens);
5. draw from the softmax of what survives.

Tie rules (all order-free, so an on-device implementation can reproduce them
with threshold comparisons): top-k keeps every token whose logit is >= the
k-th largest, so ties at the k-th value can keep more than k tokens; top-p
keeps every token whose probability is >= the smallest probability in the
nucleus, so ties at the boundary are all kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxinfer.outputs import Logprob
from jaxinfer.sampling_params import SamplingParams


def make_rng(seed: int | Sequence[int] | None) -> np.random.Generator:
    """A request's random generator: np.random.default_rng(seed). None draws
    fresh OS entropy; a sequence such as [seed, sample_index] gives each of a
    request's n samples its own reproducible stream."""
    return np.random.default_rng(seed)


def _as_logits(logits) -> np.ndarray:
    # np.array copies, so callers' arrays (possibly float32/bfloat16) are never modified.
    out = np.array(logits, dtype=np.float64)
    if out.ndim != 1:
        raise ValueError(f"logits must be 1-D (vocab,), got shape {out.shape}")
    return out


def _token_ids(ids, vocab_size: int, what: str) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{what} contain ids outside [0, {vocab_size}): {ids.min()}..{ids.max()}")
    return ids


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 softmax; -inf entries get probability exactly 0."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax, max-shifted so large logits cannot overflow."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def apply_penalties(
    logits,
    output_token_ids: Sequence[int],
    prompt_token_ids: Sequence[int],
    repetition_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
) -> np.ndarray:
    """Return penalised float64 logits (vLLM semantics; the input is not modified).

    Repetition: every token id seen in the prompt or the output has a positive
    logit divided by the penalty, a non-positive one multiplied by it. Then
    frequency: subtract frequency_penalty * (occurrences in the output). Then
    presence: subtract presence_penalty once if the id occurs in the output.
    Prompt tokens are subject to the repetition penalty only.
    """
    logits = _as_logits(logits)
    vocab = logits.shape[0]
    output = _token_ids(output_token_ids, vocab, "output_token_ids")
    prompt = _token_ids(prompt_token_ids, vocab, "prompt_token_ids")
    counts = np.bincount(output, minlength=vocab)

    if repetition_penalty != 1.0:
        seen = counts > 0
        seen[prompt] = True
        penalised = np.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = np.where(seen, penalised, logits)
    if frequency_penalty != 0.0:
        logits = logits - frequency_penalty * counts
    if presence_penalty != 0.0:
        logits = logits - presence_penalty * (counts > 0)
    return logits


def filter_logits(logits, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Set the logits of filtered-out tokens to -inf; survivors keep their values.

    Expects logits already divided by the temperature. Applied in vLLM's
    order: top-k, then top-p on the softmax of the top-k survivors, then min-p
    on the softmax of the top-p survivors. At least one token (the most
    likely) always survives.

    - top_k <= 0 or >= vocab: disabled. Otherwise keep logits >= the k-th
      largest value (all ties at the k-th value are kept).
    - top_p == 1: disabled. Otherwise keep the smallest set of most likely
      tokens whose probabilities sum to >= top_p, plus any token tied with the
      least likely member of that set.
    - min_p == 0: disabled. Otherwise drop tokens with probability
      < min_p * (largest probability).
    """
    logits = _as_logits(logits)
    # Also rejects +inf / nan, whose softmax is undefined.
    if not np.isfinite(logits.max()):
        raise ValueError(f"cannot filter: largest logit is {logits.max()}")
    vocab = logits.shape[0]

    if 0 < top_k < vocab:
        kth_largest = np.partition(logits, vocab - top_k)[vocab - top_k]
        logits = np.where(logits >= kth_largest, logits, -np.inf)

    if top_p < 1.0:
        probs = softmax(logits)
        # Tokens already at -inf have probability 0 and cannot change the
        # cutoff; leaving them out of the sort matters after top-k on a 100k+ vocabulary.
        sorted_probs = np.sort(probs[np.isfinite(logits)])[::-1]
        # A token joins the nucleus while the mass ahead of it in sorted order
        # is still short of top_p. The first has mass 0 < top_p ahead of it,
        # so the nucleus is never empty.
        mass_before = np.concatenate(([0.0], np.cumsum(sorted_probs)[:-1]))
        nucleus_size = int(np.count_nonzero(mass_before < top_p))
        cutoff = sorted_probs[nucleus_size - 1]
        logits = np.where(probs >= cutoff, logits, -np.inf)

    if min_p > 0.0:
        probs = softmax(logits)
        logits = np.where(probs >= min_p * probs.max(), logits, -np.inf)

    return logits


def token_logprobs(raw_logprobs: np.ndarray, token_id: int, num_top: int) -> dict[int, Logprob]:
    """{token_id: Logprob} for the `num_top` most likely tokens plus `token_id`.

    raw_logprobs is a full log-softmax vector. Rank is 1-based: 1 + the number
    of tokens with a strictly larger logprob (ties share a rank). Among tied
    candidates for the top-`num_top`, lower token ids win. The sampled token
    comes first in the dict; it adds no entry when it is already in the top.
    decoded_token is left None for the caller to fill.
    """
    raw_logprobs = np.asarray(raw_logprobs, dtype=np.float64)

    def entry(t: int) -> Logprob:
        value = raw_logprobs[t]
        return Logprob(logprob=float(value), rank=int(np.count_nonzero(raw_logprobs > value)) + 1)

    result = {int(token_id): entry(int(token_id))}
    if num_top > 0:
        # Partition first so a 100k+ vocabulary is not fully sorted per token;
        # the candidates include every tie at the num_top-th value, in id order.
        num_top = min(num_top, raw_logprobs.shape[0])
        threshold = np.partition(raw_logprobs, -num_top)[-num_top]
        candidates = np.flatnonzero(raw_logprobs >= threshold)
        top = candidates[np.argsort(-raw_logprobs[candidates], kind="stable")[:num_top]]
        for t in top:
            result.setdefault(int(t), entry(int(t)))
    return result


def sample_next_token(
    logits,
    params: SamplingParams,
    rng: np.random.Generator,
    output_token_ids: Sequence[int] = (),
    prompt_token_ids: Sequence[int] = (),
) -> tuple[int, dict[int, Logprob] | None]:
    """Pick the next token from one position's logits.

    Penalties first; then argmax when params.temperature == 0 (rng is not
    consumed, lowest id wins ties), else temperature, top-k, top-p, min-p and
    one categorical draw from `rng`.

    The returned logprobs (when params.logprobs is not None) are those of the
    model's raw distribution: log_softmax of the penalised logits, before
    temperature and filtering (vLLM's default "raw_logprobs"). They cover the
    top params.logprobs tokens plus the sampled one; see `token_logprobs`.
    """
    logits = apply_penalties(
        logits,
        output_token_ids,
        prompt_token_ids,
        params.repetition_penalty,
        params.presence_penalty,
        params.frequency_penalty,
    )
    if not np.isfinite(logits.max()):
        raise ValueError(f"cannot sample: largest logit is {logits.max()}")

    if params.greedy:
        token = int(np.argmax(logits))
    else:
        filtered = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
        token = int(rng.choice(filtered.shape[0], p=softmax(filtered)))

    if params.logprobs is None:
        return token, None
    return token, token_logprobs(log_softmax(logits), token, params.logprobs)

"""vLLM's per-request token rules, as rows of the structured-output bitmask.

`allowed_token_ids`, `bad_words` and `min_tokens` each say, before a token
is sampled, which tokens it may not be. That is exactly what the packed
token bitmask of structured outputs carries (structured/matcher.py; the
sample program sets the clear bits' logits to -inf under a lax.cond), so
these rules need no program of their own: the host clears bits in the row
of every sequence that has a rule in force this step, after the grammar (if
any) filled it, and a sequence with no grammar starts from all ones.

    allowed_token_ids  the row is ANDed with the allowed set (packed once)
    bad_words          each word is tokenized with and without a leading
                       space; a one-token word is always banned, a longer
                       one's last token is banned where the output already
                       ends with the tokens before it (vLLM's rule)
    min_tokens         EOS and stop_token_ids are banned while fewer than
                       min_tokens tokens have been generated

The bits are llguidance's layout: bit j of int32 word w is token 32 w + j.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.structured.matcher import bitmask_width, fill_masks


class TokenRules:
    def __init__(self, params, tokenizer, vocab_size: int, eos_token_ids):
        self.min_tokens = params.min_tokens
        # min_tokens: what may not end the sequence early (EOS unless ignored, and the stop ids).
        self.min_token_bans = sorted(set(eos_token_ids) | set(params.stop_token_ids or ()))
        self.allowed_words = None
        if params.allowed_token_ids is not None:
            allowed = np.zeros(bitmask_width(vocab_size) * 32, bool)
            allowed[[t for t in params.allowed_token_ids if t < vocab_size]] = True
            self.allowed_words = _pack(allowed)
        self.always_banned: list[int] = []
        self.banned_after: list[tuple[tuple[int, ...], int]] = []  # (tokens before, banned last token)
        for word in params.bad_words or ():
            for text in dict.fromkeys((word, " " + word.lstrip())):
                ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
                if len(ids) == 1:
                    self.always_banned.append(ids[0])
                elif ids:
                    self.banned_after.append((tuple(ids[:-1]), ids[-1]))

    def in_force(self, output_token_ids: list[int]) -> bool:
        """Whether this step's mask must be filled for the sequence (a rule bans something now)."""
        return (self.allowed_words is not None or bool(self.always_banned) or bool(self.banned_after)
                or len(output_token_ids) < self.min_tokens)

    def apply(self, row: np.ndarray, output_token_ids: list[int]) -> None:
        """Clear the banned bits of one int32 bitmask row (in place)."""
        if self.allowed_words is not None:
            row &= self.allowed_words
        bans = list(self.always_banned)
        for before, last in self.banned_after:
            if len(output_token_ids) >= len(before) and tuple(output_token_ids[len(output_token_ids) - len(before):]) == before:
                bans.append(last)
        if len(output_token_ids) < self.min_tokens:
            bans += self.min_token_bans
        words = row.view(np.uint32)
        for token in bans:
            if token >> 5 < len(words):
                words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)


def _pack(allowed: np.ndarray) -> np.ndarray:
    """bool [32 W] -> int32 [W] in llguidance's bit order (little-endian bits within a word)."""
    return np.packbits(allowed.reshape(-1, 32), axis=1, bitorder="little").view("<u4").reshape(-1).view(np.int32)


def constrained_this_step(seq) -> bool:
    """A grammar, or a token rule in force for the sequence's next token."""
    return seq.structured is not None or (seq.token_rules is not None and
                                          seq.token_rules.in_force(seq.output_token_ids))


def fill_step_masks(rows: list[tuple[int, object]], bitmask: np.ndarray) -> None:
    """rows: (bitmask row, Sequence) of every sequence constrained this step.
    A grammar fills its row (llguidance, all such rows at once), the others
    start from all ones; then each sequence's token rules clear their bans."""
    grammars = [(i, seq.structured) for i, seq in rows if seq.structured is not None]
    if grammars:
        fill_masks(grammars, bitmask)
    for i, seq in rows:
        if seq.structured is None:
            bitmask[i] = -1
        if seq.token_rules is not None:
            seq.token_rules.apply(bitmask[i], seq.output_token_ids)

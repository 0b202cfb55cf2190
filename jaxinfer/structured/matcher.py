"""A sequence's place in its grammar, and the step's packed bitmask.

`StructuredState` wraps one llguidance LLMatcher, taken from the compiled
grammar's template: the output processor advances it with every emitted
token (`accept`), the runner asks it for the next token's mask (`fill_masks`
fills the rows of all constrained sequences of a step at once, on
llguidance's own threads). It lives on the Sequence, so it survives
preemption by recompute: the emitted tokens stay, and so does the state they
led to.

The bitmask is llguidance's: int32 [rows, ceil(vocab / 32)], bit j of word w
set when token 32 w + j is allowed.
"""

from __future__ import annotations

import llguidance
import llguidance.numpy as llnp
import numpy as np

_EXECUTOR: llguidance.LLExecutor | None = None


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredState:
    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past an emitted token; False if the grammar refuses it
        (the mask makes that impossible unless the matcher ran out of fuel)."""
        return self.matcher.consume_token(token)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS: the sequence ends."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def fill_masks(states: list[tuple[int, StructuredState]], bitmask: np.ndarray) -> None:
    """Fill bitmask[row] for each (row, state); other rows are left as they are."""
    global _EXECUTOR
    if len(states) == 1:
        row, state = states[0]
        llnp.fill_next_token_bitmask(state.matcher, bitmask, row)
        return
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    llnp.fill_next_token_bitmask_par(_EXECUTOR, [(s.matcher, row) for row, s in states], bitmask)


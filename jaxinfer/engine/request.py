"""One request as the engine tracks it: its prompt and its n sequences, and
the RequestOutput a caller sees."""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.engine.sequence import Sequence
from jaxinfer.outputs import RequestMetrics, RequestOutput


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence]
    metrics: RequestMetrics
    # Why the request failed after it was accepted (a grammar that did not compile), or None.
    error: str | None = None
    internal_error: bool = False  # the error is a failed step's (not the request's fault)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    def output(self) -> RequestOutput:
        cached = max(0, min(s.num_cached_tokens for s in self.sequences))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output for s in self.sequences],
            finished=self.is_finished,
            num_cached_tokens=cached,
            metrics=self.metrics,
            error=self.error,
            internal_error=self.internal_error,
        )

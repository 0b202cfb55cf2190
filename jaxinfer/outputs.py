"""What generation returns, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """Log-probability of one token, and its 1-based rank in the model's distribution."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    finish_reason is "stop" (EOS, a stop token or a stop string), "length"
    (max_tokens or the context limit) or "abort", and None while running.
    stop_reason is the stop string or stop token id that ended it, None for
    EOS or any other reason. logprobs holds one {token_id: Logprob} per
    generated token when requested.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic() seconds, or any one clock) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """(finished - first token) / (num_output_tokens - 1); None with fewer than 2 tokens."""
        if self.first_token_time is None or self.finished_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its n completions so far (or at the end)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Why the request failed after it was accepted, or None; internal_error:
    # the failure was the engine's (a step that raised), not the request's.
    error: str | None = None
    internal_error: bool = False

"""Per-request sampling settings, with vLLM's field names and defaults."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20


class InvalidSamplingParameter(ValueError):
    """A SamplingParams field has a bad type or value; the message starts with the field's name."""


def _int(name: str, value: Any) -> int:
    # bool is an Integral subclass, but True as a count or seed is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidSamplingParameter(f"{name} must be an int, got {value!r}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidSamplingParameter(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidSamplingParameter(f"{name} must be finite, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature == 0 means greedy decoding (top_k, top_p and min_p are then
    ignored). top_k of 0 or -1 disables top-k. `stop` and `stop_token_ids`
    are normalised to lists (None -> []). `logprobs=k` returns, per generated
    token, the k most likely tokens plus the sampled one. `seed` is the seed of
    this request's own random generator (None: fresh entropy).
    `skip_special_tokens=False` keeps special tokens (e.g. a chat template's
    markers) in the detokenized text.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.n = _int("n", self.n)
        if self.n < 1:
            raise InvalidSamplingParameter(f"n must be >= 1, got {self.n}")

        self.max_tokens = _int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidSamplingParameter(f"max_tokens must be >= 1, got {self.max_tokens}")

        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidSamplingParameter(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidSamplingParameter(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidSamplingParameter(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")

        self.min_p = _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidSamplingParameter(f"min_p must be in [0, 1], got {self.min_p}")

        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidSamplingParameter(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise InvalidSamplingParameter(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            # numpy's generators reject negative seeds; fail here, not mid-generation.
            if self.seed < 0:
                raise InvalidSamplingParameter(f"seed must be >= 0, got {self.seed}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParameter(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidSamplingParameter(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")

        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidSamplingParameter(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)):
            raise InvalidSamplingParameter(f"stop must be a str or a list of str, got {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise InvalidSamplingParameter(f"stop must contain only str, got {s!r}")
            if not s:
                raise InvalidSamplingParameter("stop strings must be non-empty, got ''")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
            ids = [ids]
        elif not isinstance(ids, (list, tuple)):
            raise InvalidSamplingParameter(f"stop_token_ids must be a list of int, got {ids!r}")
        out = [_int("stop_token_ids", i) for i in ids]
        for i in out:
            if i < 0:
                raise InvalidSamplingParameter(f"stop_token_ids must be non-negative, got {i}")
        return out

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs this request's token history ([vocab] inputs per row)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax; top_k / top_p / min_p are then ignored."""
        return self.temperature == 0.0

    def with_updates(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields replaced."""
        return dataclasses.replace(self, **changes)

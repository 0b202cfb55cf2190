"""Per-request sampling settings, with vLLM's field names and defaults."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
# Stop strings are checked after every token (only where a new token can
# complete one, engine/output_processor.py), so their number and length are
# bounded: 10**5 of them would stall every request sharing the engine.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# logit_bias entries and bad_words: host work per step grows with them (bad_words) or
# they fill a [vocab] row once per step (logit_bias); bounded for the same reason.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256


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


# -- structured outputs -------------------------------------------------------
# StructuredOutputsParams: what a request's output must match, with vLLM's
# names (`SamplingParams(structured_outputs=...)`).
#
# Exactly one of `json` (a JSON schema, as a dict or a JSON string),
# `regex`, `choice` (a list of strings), `grammar` (a Lark grammar, or GBNF as
# llama.cpp writes it) or `json_object=True` (any JSON object). Checked here
# without a tokenizer: the kinds, the types, that a JSON string parses. Whether
# the schema or grammar compiles is known only to llguidance
# (structured/grammar.py), off the step path.

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class InvalidStructuredOutputs(InvalidSamplingParameter):
    """A StructuredOutputsParams is malformed; the message starts with "structured_outputs"."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidStructuredOutputs(
                f"structured_outputs: give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InvalidStructuredOutputs(f"structured_outputs.json: not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidStructuredOutputs(
                    f"structured_outputs.json: a JSON schema must be an object, got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidStructuredOutputs(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidStructuredOutputs(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (None, True, False):
            raise InvalidStructuredOutputs(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """Hashable and canonical (a schema's key order does not matter): the compile cache's key."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(value)
        return kind, "" if kind == "json_object" else value

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's JSON (the server's `structured_outputs` field)."""
        if not isinstance(fields, dict):
            raise InvalidStructuredOutputs(f"structured_outputs must be an object, got {fields!r}")
        unknown = sorted(set(fields) - set(STRUCTURED_OUTPUT_KINDS))
        if unknown:
            raise InvalidStructuredOutputs(f"structured_outputs: unknown field(s) {unknown}; known: {list(STRUCTURED_OUTPUT_KINDS)}")
        return cls(**fields)


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature == 0 means greedy decoding (top_k, top_p and min_p are then
    ignored). top_k of 0 or -1 disables top-k. `stop` and `stop_token_ids`
    are normalised to lists (None -> []). `logprobs=k` returns, per generated
    token, the k most likely tokens plus the sampled one. `seed` is the seed of
    this request's own random generator (None: fresh entropy).
    `skip_special_tokens=False` keeps special tokens (e.g. a chat template's
    markers) in the detokenized text. `structured_outputs` constrains the
    output to a JSON schema, regex, choice or grammar (StructuredOutputsParams,
    or a dict of its fields).

    vLLM's token rules: `min_tokens` (EOS and stop_token_ids cannot be
    sampled, and stop strings are not checked, before that many tokens),
    `allowed_token_ids` (only these may be sampled), `bad_words` (the last
    token of each word's tokenization is banned wherever the output already
    ends with the tokens before it), `logit_bias` ({token id: bias in [-100,
    100]} added to the logits before penalties, as OpenAI's), and
    `include_stop_str_in_output` (a matched stop string stays in the text).
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
    structured_outputs: StructuredOutputsParams | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False

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

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParameter(f"{name} must be a bool, got {getattr(self, name)!r}")

        self.min_tokens = _int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParameter(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                                           f"got {self.min_tokens}")
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise InvalidSamplingParameter(
                    f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = [_int("allowed_token_ids", i) for i in self.allowed_token_ids]
            if min(self.allowed_token_ids) < 0:
                raise InvalidSamplingParameter("allowed_token_ids must be non-negative token ids")
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if (not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words)):
                raise InvalidSamplingParameter(f"bad_words must be a list of non-empty strings, got {words!r}")
            if len(words) > MAX_BAD_WORDS or max(map(len, words), default=0) > MAX_BAD_WORD_CHARS:
                raise InvalidSamplingParameter(f"bad_words: at most {MAX_BAD_WORDS} words of at most "
                                               f"{MAX_BAD_WORD_CHARS} characters")
            self.bad_words = list(words)

        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidSamplingParameter(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            except TypeError as e:
                raise InvalidSamplingParameter(f"structured_outputs: {e}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidSamplingParameter(
                f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")

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
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParameter(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if max(map(len, stop), default=0) > MAX_STOP_STRING_CHARS:
            raise InvalidSamplingParameter(f"stop: a stop string may have at most {MAX_STOP_STRING_CHARS} "
                                           f"characters, got {max(map(len, stop))}")
        return list(stop)

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise InvalidSamplingParameter(f"logit_bias must map token ids to numbers, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidSamplingParameter(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        out = {}
        for key, value in bias.items():
            try:  # OpenAI's JSON keys are strings of token ids
                token = int(key) if isinstance(key, str) else _int("logit_bias", key)
            except ValueError:
                raise InvalidSamplingParameter(f"logit_bias: keys must be token ids, got {key!r}") from None
            value = _float("logit_bias", value)
            if token < 0 or not -100 <= value <= 100:
                raise InvalidSamplingParameter(
                    f"logit_bias: token ids must be >= 0 and biases in [-100, 100], got {key!r}: {value}")
            out[token] = value
        return out

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
        """Whether sampling needs [vocab] inputs per row: the token history of
        repetition/presence/frequency penalties, or a logit_bias row (the
        sampler's "full" variant, engine/programs.py)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.logit_bias is not None)

    @property
    def constrains_tokens(self) -> bool:
        """Whether some tokens are masked out on the host before sampling (the
        structured-output bitmask path): a grammar, or vLLM's token rules."""
        return (self.structured_outputs is not None or self.allowed_token_ids is not None
                or self.bad_words is not None or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax; top_k / top_p / min_p are then ignored."""
        return self.temperature == 0.0

    def with_updates(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields replaced."""
        return dataclasses.replace(self, **changes)

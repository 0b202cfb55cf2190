"""The `speculative=` engine option, parsed and validated.

    LLM(..., speculative={"method": "ngram", "num_speculative_tokens": 4, "max_n": 4, "min_n": 1})
    LLM(..., speculative={"method": "draft_model", "num_speculative_tokens": 4,
                          "model": None | path, "quantization": None | "int8" | ...})

ngram: prompt lookup (spec/ngram.py), no extra model. draft_model: a second
model with the target's vocabulary (spec/draft_model.py); "model" is any path
`jaxinfer.load` accepts, None meaning the target checkpoint itself (its
already loaded weights, quantized in memory when "quantization" is given).
eagle: a trained draft head over the target's features (spec/eagle.py);
"model" is the head's .safetensors file, None meaning the head shipped in
checkpoints/ for the embedded default model.

    LLM(..., speculative={"method": "eagle", "num_speculative_tokens": 4, "model": None | head path})

Every method also takes "disable_by_batch_size": drafting is off for a step
when more sequences than this decode (the target's verification of K + 1
rows per sequence costs more than the accepted drafts save once the batch
already fills the machine); None drafts at every batch size. Left out, each
method gets the crossover measured for it (DISABLE_BY_BATCH_SIZE,
BENCHMARKS.md). And "adaptive" (default True): below that batch size, a
step drafts only while drafting measures faster than plain decoding on this
machine, model and text (engine/spec/policy.py); False drafts at every step
it may (what tests of the machinery and acceptance measurements want).
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle")
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "max_n", "min_n", "disable_by_batch_size", "adaptive"},
    "draft_model": {"method", "num_speculative_tokens", "model", "quantization", "disable_by_batch_size", "adaptive"},
    "eagle": {"method", "num_speculative_tokens", "model", "disable_by_batch_size", "adaptive"},
}
# The largest batch at which each method came out ahead (or, for those that
# never did, closest) on the 2-core CPU VM (scripts/bench_speculative.py,
# BENCHMARKS.md, "Speculative decoding"): every method lost to plain decoding at batch 8
# and 32, so drafting is on only while a single sequence decodes. On a GPU,
# where verification rows are nearly free, pass a larger value or None.
DISABLE_BY_BATCH_SIZE = {"ngram": 1, "draft_model": 1, "eagle": 1}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    max_n: int = 4
    min_n: int = 1
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig or a dict -> SpeculativeConfig | None; a
        ValueError names the offending key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
                             f"got {type(value).__name__}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative['method'] must be one of {METHODS}, got {method!r}")
        unknown = sorted(set(value) - _KEYS[method])
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {unknown} for method {method!r}; "
                             f"allowed: {sorted(_KEYS[method])}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative['num_speculative_tokens'] is required (the drafts per step, e.g. 4)")
        value = {"disable_by_batch_size": DISABLE_BY_BATCH_SIZE[method], **value}
        config = cls(**value)
        if config.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", config.disable_by_batch_size)
        if not isinstance(config.adaptive, bool):
            raise ValueError(f"speculative['adaptive'] must be True or False, got {config.adaptive!r}")
        _positive_int("num_speculative_tokens", config.num_speculative_tokens)
        _positive_int("max_n", config.max_n)
        _positive_int("min_n", config.min_n)
        if config.min_n > config.max_n:
            raise ValueError(f"speculative: min_n ({config.min_n}) must be <= max_n ({config.max_n})")
        if config.model is not None and not isinstance(config.model, str) and not hasattr(config.model, "__fspath__"):
            raise ValueError(f"speculative['model'] must be a path or None, got {config.model!r}")
        return config


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative['{name}'] must be a positive int, got {value!r}")

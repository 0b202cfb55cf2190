"""The sampling defaults a model ships in its generation_config.json.

vLLM applies a model's own generation_config.json (temperature, top_p,
top_k, min_p, repetition_penalty) to every request field that the request
leaves unset, and so does the server here: a chat model tuned to sample at
temperature 0.7 with top_p 0.8 is served that way unless asked otherwise.
Read from a Hugging Face model directory; a GGUF file or a jaxinfer
checkpoint carries none. Values that SamplingParams would refuse are
skipped with a warning rather than failing every request.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from jaxinfer.sampling_params import InvalidSamplingParameter, SamplingParams

log = logging.getLogger("jaxinfer.server")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(source) -> dict:
    """{field: value} of the model directory's generation_config.json ({} without one)."""
    path = Path(str(source)) / "generation_config.json"
    if not str(source) or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("%s: not read (%s); no sampling defaults from it", path, e)
        return {}
    defaults = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{key: value})
        except InvalidSamplingParameter as e:
            log.warning("%s: %s; ignored", path, e)
            continue
        defaults[key] = value
    if defaults:
        log.info("sampling defaults from %s (where a request sets none): %s", path, defaults)
    return defaults

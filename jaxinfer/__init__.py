"""jaxinfer: a JAX/XLA inference engine for Llama-family language models.

Public API::

    from jaxinfer import LLM, LoRARequest, SamplingParams, StructuredOutputsParams, load

Names are resolved lazily so that `import jaxinfer` (and the CLI's `--help`)
does not pay for importing JAX.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxinfer.llm",
    "load": "jaxinfer.loading.model",
    "Model": "jaxinfer.loading.model",
    "SamplingParams": "jaxinfer.sampling_params",
    "StructuredOutputsParams": "jaxinfer.sampling_params",
    "InvalidSamplingParameter": "jaxinfer.sampling_params",
    "RequestOutput": "jaxinfer.outputs",
    "CompletionOutput": "jaxinfer.outputs",
    "Logprob": "jaxinfer.outputs",
    "ModelConfig": "jaxinfer.config",
    "LoRARequest": "jaxinfer.lora.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

"""Structured outputs (JSON schema, regex, choice, grammar) with llguidance.
The spec, StructuredOutputsParams, is in jaxinfer/sampling_params.py (as in vLLM).

grammar.py  spec -> llguidance grammar; the compile worker, cache, tokenizers
matcher.py  a sequence's matcher and the step's packed token bitmask

engine/ imports these; nothing here imports engine/ or server/.
"""

"""The `gguf` package, imported without its optional Mistral tokenizer support.

gguf/vocab.py (imported by the package's __init__) imports mistral_common
whenever it is installed, for its MistralVocab, which jaxinfer never uses:
that import was 0.4 s of a 2 s warm start to a GGUF's first token. While
gguf is first imported here, mistral_common reads as not installed (a None
entry in sys.modules makes its import raise ImportError, which gguf catches);
the entry is removed straight after, so mistral_common imports normally for
anyone else. Only gguf's own MistralVocab (a conversion tool) is left
without it in this process."""

from __future__ import annotations

import sys

if "gguf" not in sys.modules and "mistral_common" not in sys.modules:
    sys.modules["mistral_common"] = None
    try:
        import gguf
    finally:
        if sys.modules.get("mistral_common", 0) is None:
            del sys.modules["mistral_common"]

import gguf  # noqa: E402  (the package itself, whichever way it was first imported)

__all__ = ["gguf"]

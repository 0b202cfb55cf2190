"""From a StructuredOutputsParams to a compiled llguidance grammar, off the step path.

`GrammarCompiler.submit(spec)` returns a Future of a `CompiledGrammar`: the
spec's llguidance grammar, checked and built into a template LLMatcher for
this tokenizer, from which every sequence takes its own copy (deep_copy is
cheap; building is what can take 100 ms+ for a large schema). One worker
thread compiles (llguidance drops the GIL while it builds, so steps go on);
futures are cached by the spec's canonical key (a schema's key order does
not matter), failures included, since a spec that did not compile never
will. At most `max_pending` distinct specs wait at once; one more raises
GrammarQueueFull (a server answers 429). The engine enforces the timeout: a request whose grammar is not ready
after `timeout` seconds fails; its compile runs on and is cached.

The llguidance tokenizer (LLTokenizer) is built on the worker too, on the
first structured request (about 1 s for a 49k vocabulary), never at start-up.
It is built from what we load, for each of our tokenizer kinds:
  HFTokenizer (tokenizer.json, and a GGUF byte-level BPE vocabulary, which
      tokenizer.py rebuilds as a `tokenizers` Tokenizer)  the tokenizer.json text
  SentencePieceTokenizer (tokenizer.model, and a GGUF sentencepiece vocabulary)
      each piece's bytes: "\u2581" is a space, "<0xNN>" the byte NN, control
      pieces are special (llguidance never lets a grammar's text produce them)
with the model's EOS ids set explicitly (llguidance would guess one), and
the vocabulary widened to the model's logits (padded rows are never allowed).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from jaxinfer.sampling_params import StructuredOutputsParams

# Any JSON object ("json_object": True, the server's {"type": "json_object"}).
_ANY_OBJECT = {"type": "object"}
# Compact JSON (no whitespace between tokens): a small model at temperature 1
# otherwise spends its max_tokens on blank lines. vLLM's default allows
# whitespace (its `disable_any_whitespace=False`); this is our choice.
_JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 256
# Distinct specs waiting for (or in) the worker at most: a flood of distinct
# schemas must not queue minutes of compiling ahead of everyone else's.
MAX_PENDING = 32


class GrammarError(ValueError):
    """A spec that llguidance cannot compile; the message names the problem."""


class GrammarQueueFull(GrammarError):
    """More distinct grammars wait for the one compile worker than it accepts."""



def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (a JSON string) of a spec; GrammarError when even that fails."""
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = _ANY_OBJECT if kind == "json_object" else spec.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except Exception as e:  # noqa: BLE001 - llguidance raises ValueError and friends; all mean a bad spec
        raise GrammarError(f"structured_outputs.{kind}: {e}") from None


def _sentencepiece_bytes(piece: str, control: bool) -> bytes:
    if control:
        return b"\xff" + piece.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


class _PieceVocabulary:
    """What llguidance.TokenizerWrapper reads: every token's bytes, and a way to tokenize text."""

    def __init__(self, tokenizer):
        processor = tokenizer.processor
        specials = set(tokenizer._special_ids)
        self.tokens = []
        for i in range(processor.get_piece_size()):
            control = i in specials or processor.is_control(i) or processor.is_unknown(i)
            self.tokens.append(_sentencepiece_bytes(processor.id_to_piece(i), control))
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(specials)
        self._encode = processor.encode

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


def make_lltokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """An LLTokenizer over `vocab_size` (the model's logits) ids for one of our Tokenizers."""
    eos = sorted(tokenizer.eos_token_ids)
    if not eos:
        raise GrammarError("structured outputs need the model's EOS token, and its tokenizer names none")
    if tokenizer.vocab_size > vocab_size:  # the bitmask has one bit per logit
        raise GrammarError(f"structured outputs need the tokenizer's {tokenizer.vocab_size} tokens to fit the "
                           f"model's {vocab_size} logits")
    n_vocab = vocab_size
    if hasattr(tokenizer, "rust_tokenizer"):  # HFTokenizer
        return llguidance.LLTokenizer(tokenizer.rust_tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos)
    if hasattr(tokenizer, "processor"):  # SentencePieceTokenizer
        wrapper = llguidance.TokenizerWrapper(_PieceVocabulary(tokenizer))
        return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)
    raise GrammarError(f"structured outputs do not support the tokenizer {type(tokenizer).__name__}")


@dataclass
class CompiledGrammar:
    """A checked grammar and a template matcher that no token has advanced."""

    spec_key: tuple[str, str]
    template: llguidance.LLMatcher
    seconds: float  # how long building the matcher took

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, max_pending: int = MAX_PENDING):
        if tokenizer is None:
            raise GrammarError("structured outputs need a tokenizer, and this model has none")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: llguidance.LLTokenizer | None = None  # built on the worker only
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxinfer-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.RLock()  # a future done at once runs _done inside submit's lock
        self.max_pending = max_pending
        self.num_pending = 0  # submitted and not done (under _lock)

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (on the worker, when the first compile asks for it)."""
        if self._lltokenizer is None:
            self._lltokenizer = make_lltokenizer(self._tokenizer, self.vocab_size)
        return self._lltokenizer

    def submit(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self.num_pending >= self.max_pending:
                raise GrammarQueueFull(f"structured_outputs: {self.num_pending} grammars are already waiting to "
                                       f"compile (at most {self.max_pending}); retry later")
            self.num_pending += 1
            future = self._worker.submit(self.compile, spec)
            future.add_done_callback(self._done)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _done(self, _future) -> None:
        with self._lock:
            self.num_pending -= 1

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile now, on the calling thread (the worker runs this)."""
        import time

        grammar = grammar_text(spec)
        start = time.perf_counter()
        # The constructor reports a bad grammar through is_error() and drops the
        # GIL while it builds (validate_grammar would hold it, stalling steps).
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs.{spec.kind}: {matcher.get_error()}")
        return CompiledGrammar(spec.key(), matcher, time.perf_counter() - start)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

"""Tokenizers: one interface over HF `tokenizers`, sentencepiece, and GGUF-embedded vocabularies.

`load_tokenizer(path)` reads a Hugging Face style directory (tokenizer.json or tokenizer.model plus
the optional JSON configs next to it); `tokenizer_from_gguf(reader)` rebuilds the tokenizer a GGUF
file describes in its metadata. Both return a `Tokenizer`, whose `detokenizer()` streams text.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import sentencepiece
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

log = logging.getLogger(__name__)

# GGUF token types; sentencepiece numbers its piece types the same way.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns of BPE families, as in each model's own tokenizer.json.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"gpt2", "mpt", "olmo", "jais"}
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}

# Control tokens that end a turn although the GGUF does not list them as eos/eot (llama.cpp
# stops on these too): without this an instruct model can run past its answer.
_END_OF_TURN_TEXTS = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "<|end_of_text|>", "<EOT>"}


# Texts longer than this are encoded through the tokenizers library's GIL-free path.
_GIL_FREE_CHARS = 16384


class TokenizerError(ValueError):
    """A tokenizer file is missing or unusable, or a chat template failed."""


class Tokenizer:
    """Base class: subclasses supply `_encode_text`, `decode`, `id_to_piece`."""

    def __init__(self, *, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos_token: bool, chat_template: str | None, extra_eos_ids=()):
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids = frozenset(int(i) for i in (eos_token_id, *extra_eos_ids) if i is not None)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template

    def _encode_text(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def id_to_piece(self, token_id: int) -> str:
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._encode_text(text)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, **kwargs) -> str:
        """kwargs become template variables (e.g. `tools`, a list of OpenAI
        tool definitions, as Hugging Face passes them); chat_template
        replaces the model's own (a server's --chat-template)."""
        source = chat_template or self.chat_template
        if not source:
            raise TokenizerError("this model has no chat template; pass a raw prompt instead")
        template = _compile_template(source)
        context = {
            "bos_token": self.id_to_piece(self.bos_token_id) if self.bos_token_id is not None else "",
            "eos_token": self.id_to_piece(self.eos_token_id) if self.eos_token_id is not None else "",
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except TokenizerError:
            raise
        except Exception as e:  # a template bug should read as one, not as a jinja2 traceback
            raise TokenizerError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (its piece's
        length: a byte-level piece has a character per byte, a sentencepiece
        piece one per character), so a text of C characters has at least
        C / max_token_chars tokens: what lets a server refuse an over-long
        prompt before tokenizing it."""
        return max((len(self.id_to_piece(i)) for i in range(self.vocab_size)), default=1) or 1

    def detokenizer(self, prompt_token_ids=(), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens)

    def save(self, directory) -> list[str]:
        """Write the tokenizer as a Hugging Face style directory that `load_tokenizer` reads back to the
        same ids, special tokens and chat template. Returns the names of the files written."""
        raise NotImplementedError

    def _save_configs(self, directory: Path, bos_text: str | None, eos_text: str | None) -> list[str]:
        config = {"add_bos_token": self.add_bos_token}
        if bos_text is not None:
            config["bos_token"] = bos_text
        if eos_text is not None:
            config["eos_token"] = eos_text
        if self.chat_template:
            config["chat_template"] = self.chat_template
        # generation_config.json carries the ids no text can name: every end-of-turn id (the first is
        # the fallback EOS), and a BOS that a sentencepiece model cannot mark as its own.
        generation = {}
        eos_ids = [self.eos_token_id] if self.eos_token_id is not None else []
        eos_ids += sorted(self.eos_token_ids - set(eos_ids))
        if eos_ids:
            generation["eos_token_id"] = eos_ids
        if self.bos_token_id is not None:
            generation["bos_token_id"] = self.bos_token_id
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                         encoding="utf-8")
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
        return ["tokenizer_config.json", "generation_config.json"]

    def __repr__(self):
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, add_bos_token={self.add_bos_token})")


class HFTokenizer(Tokenizer):
    """Backed by a `tokenizers.Tokenizer`; it parses added/special tokens in text itself."""

    def __init__(self, rust_tokenizer: tokenizers.Tokenizer, **kwargs):
        # A tokenizer.json may carry truncation/padding meant for training; both would corrupt prompts.
        rust_tokenizer.no_truncation()
        rust_tokenizer.no_padding()
        self.rust_tokenizer = rust_tokenizer
        super().__init__(vocab_size=rust_tokenizer.get_vocab_size(with_added_tokens=True), **kwargs)

    def _encode_text(self, text):
        # BOS is ours to add (see `encode`), so the tokenizers library's post-processor stays out of it.
        if len(text) > _GIL_FREE_CHARS:
            # encode_batch releases the GIL while it works (encode holds it: 8 MB of text
            # froze every other thread of a server for ~6 s), so other threads run meanwhile.
            return self.rust_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self.rust_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids, skip_special_tokens=True):
        # Ids past the vocabulary (a padded embedding) are dropped by the tokenizers library; negative ones we drop.
        ids = [i for i in map(int, token_ids) if i >= 0]
        return self.rust_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id):
        token_id = int(token_id)
        return (self.rust_tokenizer.id_to_token(token_id) or "") if token_id >= 0 else ""

    def save(self, directory):
        directory = Path(directory)
        self.rust_tokenizer.save(str(directory / "tokenizer.json"))
        bos = self.rust_tokenizer.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        eos = self.rust_tokenizer.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None
        return ["tokenizer.json", *self._save_configs(directory, bos, eos)]


class SentencePieceTokenizer(Tokenizer):
    """Backed by a `sentencepiece.SentencePieceProcessor`.

    sentencepiece never matches control pieces ("<s>", "[INST]") in text, but chat templates write
    them as text, so `encode` cuts the text at them and encodes each fragment on its own. Each
    fragment then gets its own dummy-prefix space, as in llama.cpp and HF's legacy Llama tokenizer.
    """

    def __init__(self, processor: sentencepiece.SentencePieceProcessor, extra_special_texts=(), **kwargs):
        self.processor = processor
        n = processor.get_piece_size()
        special = {processor.id_to_piece(i): i for i in range(n) if processor.is_control(i)}
        for text in extra_special_texts:
            i = processor.piece_to_id(text)
            if processor.id_to_piece(i) == text:
                special[text] = i
        special = {text: i for text, i in special.items() if text}
        self._special_ids = frozenset(special.values())
        self._special_by_text = special
        self._special_re = (re.compile("(" + "|".join(map(re.escape, sorted(special, key=len, reverse=True))) + ")")
                            if special else None)
        proto = sp_pb2.ModelProto.FromString(processor.serialized_model_proto())
        self._strips_leading_space = proto.normalizer_spec.add_dummy_prefix
        super().__init__(vocab_size=n, **kwargs)

    def _encode_text(self, text):
        if self._special_re is None:
            return self.processor.encode(text)
        ids = []
        for k, part in enumerate(self._special_re.split(text)):
            if k % 2:
                ids.append(self._special_by_text[part])
            elif part:
                ids.extend(self.processor.encode(part))
        return ids

    def decode(self, token_ids, skip_special_tokens=True):
        ids = [i for i in map(int, token_ids) if 0 <= i < self.vocab_size]
        if skip_special_tokens:
            return self.processor.decode([i for i in ids if i not in self._special_ids])
        # sentencepiece renders control pieces as "", so decode the runs between them separately.
        out, run = [], []
        for i in ids:
            if i in self._special_ids:
                out.append(self._decode_run(run, at_start=not out))
                out.append(self.processor.id_to_piece(i))
                run = []
            else:
                run.append(i)
        out.append(self._decode_run(run, at_start=not out))
        return "".join(out)

    def _decode_run(self, run, at_start):
        text = self.processor.decode(run)
        # sentencepiece drops the dummy-prefix space of its input's first piece; mid-text it is real.
        if not at_start and run and self._strips_leading_space:
            if self.processor.id_to_piece(run[0]).startswith("\u2581"):
                text = " " + text
        return text

    def id_to_piece(self, token_id):
        token_id = int(token_id)
        return self.processor.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else ""

    def save(self, directory):
        directory = Path(directory)
        proto = sp_pb2.ModelProto.FromString(self.processor.serialized_model_proto())
        # Special texts that came from a config rather than the model become control pieces, so the
        # reloaded model splits the same texts out without needing that config.
        for i in self._special_ids:
            proto.pieces[i].type = _CONTROL
        # sentencepiece names its BOS/EOS by piece and only accepts control pieces; a BOS/EOS that is
        # not one (or none at all) must not be re-derived from the defaults "<s>" / "</s>".
        def own_piece(token_id):
            special = token_id is not None and token_id in self._special_ids
            return proto.pieces[token_id].piece if special else None

        bos, eos = own_piece(self.bos_token_id), own_piece(self.eos_token_id)
        proto.trainer_spec.bos_piece = bos or "<jaxinfer:no-bos>"
        proto.trainer_spec.eos_piece = eos or "<jaxinfer:no-eos>"
        (directory / "tokenizer.model").write_bytes(proto.SerializeToString())
        return ["tokenizer.model", *self._save_configs(directory, bos, eos)]


class IncrementalDetokenizer:
    """Turns generated ids into text deltas.

    Each `add` decodes only a window from the last emitted boundary, and compares it with the
    text that window already produced. The delta is held back while the window ends in U+FFFD,
    i.e. while a multi-byte character is still split across tokens to come.
    """

    _CONTEXT_TOKENS = 6  # enough prompt tail for a sentencepiece leading space to decode as text

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids=(), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(t) for t in list(prompt_token_ids)[-self._CONTEXT_TOKENS:]]
        self._prefix = 0  # window start: everything before it is settled
        self._read = len(self._ids)  # everything before this has been emitted
        self.text = ""

    def add(self, token_ids) -> str:
        self._ids.extend(int(t) for t in token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        if after.startswith(before):
            delta = after[len(before):]
        else:  # only when the prompt context itself ended mid-character
            common = 0
            while common < min(len(before), len(after)) and before[common] == after[common]:
                common += 1
            delta = after[common:]
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[:self._prefix]  # keep the buffer as small as the window
        self._read -= self._prefix
        self._prefix = 0
        self.text += delta
        return delta


@lru_cache(maxsize=16)
def _compile_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson HTML-escapes "<", ">", "&", "'", which would leak into prompts.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"chat template does not parse: {e}") from e


# ---------------------------------------------------------------------------------------------
# Hugging Face style directories


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from e


def _token_text(value) -> str | None:
    """A special token as configs spell it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_chat_template(config: dict, directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")  # transformers >= 4.43 layout
    return template or None


def load_tokenizer(path) -> Tokenizer:
    path = Path(path)
    if path.is_file():
        directory, file = path.parent, path
    elif path.is_dir():
        directory = path
        file = next((path / n for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()), None)
        if file is None:
            raise TokenizerError(f"{path}: no tokenizer found (looked for tokenizer.json and tokenizer.model)")
    else:
        raise TokenizerError(f"{path}: no such file or directory")

    config = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
    generation = _read_json(directory / "generation_config.json")
    gen_eos = generation.get("eos_token_id")
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else [i for i in (gen_eos or []) if isinstance(i, int)]
    gen_bos = generation.get("bos_token_id") if isinstance(generation.get("bos_token_id"), int) else None
    bos_text, eos_text = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    chat_template = _config_chat_template(config, directory)

    if file.suffix == ".json":
        try:
            rust_tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:
            raise TokenizerError(f"{file}: not a tokenizers JSON file: {e}") from e
        bos = rust_tokenizer.token_to_id(bos_text) if bos_text else None
        eos = rust_tokenizer.token_to_id(eos_text) if eos_text else None
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No config flag: the tokenizer.json post-processor says whether a BOS is prepended.
            plain = rust_tokenizer.encode("a", add_special_tokens=False).ids
            full = rust_tokenizer.encode("a").ids
            add_bos = len(full) > len(plain) and full[1:len(plain) + 1] == plain
            if add_bos and bos is None:
                bos = full[0]
        if eos is None and gen_eos:
            eos = gen_eos[0]
        return HFTokenizer(rust_tokenizer, bos_token_id=bos, eos_token_id=eos, add_bos_token=bool(add_bos),
                           chat_template=chat_template, extra_eos_ids=gen_eos)

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromFile(str(file))
    except Exception as e:
        raise TokenizerError(f"{file}: not a sentencepiece model: {e}") from e

    def piece_id(text, fallback):
        if text is not None:
            i = processor.piece_to_id(text)
            return i if processor.id_to_piece(i) == text else None
        return fallback if fallback >= 0 else None

    eos = piece_id(eos_text, processor.eos_id())
    if eos is None and gen_eos:
        eos = gen_eos[0]
    bos = piece_id(bos_text, processor.bos_id())
    if bos is None and bos_text is None:
        bos = gen_bos
    return SentencePieceTokenizer(
        processor, extra_special_texts=[t for t in (bos_text, eos_text) if t],
        bos_token_id=bos, eos_token_id=eos,
        add_bos_token=bool(config.get("add_bos_token", True)),  # Llama-family sentencepiece default
        chat_template=chat_template, extra_eos_ids=gen_eos)


# ---------------------------------------------------------------------------------------------
# GGUF


def tokenizer_from_gguf(reader) -> Tokenizer | None:
    """reader: a loading.gguf_file.GGUFFile (its fields hold decoded values)."""
    meta = reader.fields
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    model = meta.get("tokenizer.ggml.model")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    enders = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    enders += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _END_OF_TURN_TEXTS]
    common = dict(bos_token_id=bos, eos_token_id=eos, extra_eos_ids=[i for i in enders if i is not None],
                  chat_template=meta.get("tokenizer.chat_template"))

    if model == "gpt2":
        rust_tokenizer = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [],
                                  meta.get("tokenizer.ggml.pre"))
        return HFTokenizer(rust_tokenizer, add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)), **common)
    if model == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:  # without scores, file order is the best guess at merge priority
            scores = [-float(i) for i in range(len(tokens))]
        processor = _sentencepiece_bpe(tokens, scores, types, meta.get("tokenizer.ggml.unknown_token_id"),
                                       bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        return SentencePieceTokenizer(processor, add_bos_token=add_bos, **common)
    raise TokenizerError(f"GGUF tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', 'llama')")


def _byte_level_bpe(tokens, types, merges, pre) -> tokenizers.Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ignore_merges, normalizer = False, None
    if pre in _GPT2_PRE:
        pre_tokenizer = byte_level
    elif pre in _DIGITS_THEN_GPT2_PRE:
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        # Llama 3's tokenizer.json looks whole words up in the vocabulary before merging.
        ignore_merges = pre in _LLAMA3_PRE
        normalizer = normalizers.NFC() if pre in _QWEN2_PRE else None
    else:
        log.warning("GGUF tokenizer.ggml.pre %r is not known; using the GPT-2 pre-tokenizer, "
                    "so some texts may tokenize differently from the original model", pre)
        pre_tokenizer = byte_level

    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise TokenizerError(f"GGUF tokenizer.ggml.merges entry {merge!r} is not 'left right'")
        pairs.append((left, right))
    vocab = {token: i for i, token in enumerate(tokens)}
    rust_tokenizer = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    rust_tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        rust_tokenizer.normalizer = normalizer
    rust_tokenizer.decoder = decoders.ByteLevel()
    # Registered as added tokens, these are matched whole in text and decoded verbatim.
    rust_tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    rust_tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return rust_tokenizer


def _sentencepiece_bpe(tokens, scores, types, unk_id, add_space_prefix) -> sentencepiece.SentencePieceProcessor:
    proto = sp_pb2.ModelProto()
    valid_types = {_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE}
    if len(scores) != len(tokens):
        raise TokenizerError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    if unk_id is None:
        unk_id = next((i for i, ty in enumerate(types) if ty == _UNKNOWN), 0)
    if not 0 <= unk_id < len(tokens):
        raise TokenizerError(f"GGUF tokenizer.ggml.unknown_token_id {unk_id} is outside the vocabulary")
    byte_pieces = {f"<0x{b:02X}>" for b in range(256)}
    # sentencepiece accepts byte pieces only as the full set of 256, which turns on byte fallback.
    has_bytes = byte_pieces <= {t for t, ty in zip(tokens, types) if ty == _BYTE}
    if not has_bytes and _BYTE in types:
        log.warning("GGUF vocabulary has some but not all 256 byte tokens; treating them as ordinary tokens")
    for i, (token, score, ty) in enumerate(zip(tokens, scores, types)):
        piece = proto.pieces.add()
        piece.piece, piece.score = token, float(score)
        # sentencepiece needs exactly one UNKNOWN piece; the file's unknown id names it.
        if i == unk_id:
            piece.type = _UNKNOWN
        elif ty == _UNKNOWN or ty not in valid_types or (ty == _BYTE and not has_bytes):
            piece.type = _NORMAL
        else:
            piece.type = ty
    trainer = proto.trainer_spec
    trainer.model_type = sp_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = has_bytes
    trainer.unk_id, trainer.unk_piece = unk_id, tokens[unk_id]
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = add_space_prefix
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto.SerializeToString())
    except Exception as e:
        raise TokenizerError(f"GGUF sentencepiece vocabulary is not loadable: {e}") from e
    return processor

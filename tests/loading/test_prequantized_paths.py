"""A GPTQ 4-bit checkpoint (group 32, tests/prequantized_writers.py) loaded as
stored through the engine's other paths: LoRA adapters over its int4 weights,
n-gram speculative decoding, and `jaxinfer convert` to a jaxinfer (orbax)
checkpoint. Tensor parallelism over it runs with the other multi-device
checks (tests/parallel_checks.py, group "tp-gptq").

The reference is HF transformers holding the GPTQ weights' dequantized values
(computed in float64 numpy from the format's formula by the writer), with
PEFT for the adapters."""

import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer import LLM, LoRARequest, SamplingParams
from jaxinfer.cli import main
from jaxinfer.quant.tensor import QuantizedTensor
from tests.lora_helpers import last_row_logits, make_adapter, peft_model
from tests.prequantized_writers import gptq_checkpoint
from tests.tiny_models import assert_logits_close, hf_greedy, hf_logits, make_hf_model

# Repeated n-grams, so that the n-gram proposer drafts from the prompt.
PROMPTS = [[5, 17, 99, 3, 64, 5, 17, 99, 3, 64, 5, 17], [120, 7, 7, 81, 33, 1, 120, 7, 7, 81]]
NEW_TOKENS = 10
ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=32)
GROUP_SIZE = 32
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def greedy(n=NEW_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def untiled(params):
    """The plain layout of every QuantizedTensor (a CPU load with AVX-512 tiles them: quant/tensor.py)."""
    return jax.tree.map(lambda w: w.untiled() if isinstance(w, QuantizedTensor) else w, params,
                        is_leaf=lambda w: isinstance(w, QuantizedTensor))


@pytest.fixture(scope="module")
def gptq(tmp_path_factory):
    """(directory, reference): the checkpoint and the HF model holding its dequantized weights."""
    return gptq_checkpoint(make_hf_model("llama", seed=3), tmp_path_factory.mktemp("gptq"), 4, GROUP_SIZE, True,
                           "gptq")


@pytest.fixture(scope="module")
def adapter(gptq, tmp_path_factory):
    # PEFT's random A / B depend on the seed and the shapes only: made on the float reference model.
    return make_adapter(gptq[1], tmp_path_factory.mktemp("adapter"), 1, r=8, lora_alpha=16, target_modules=EVERY)


@pytest.fixture(scope="module")
def llm(gptq):
    """The plain engine over the GPTQ directory, with LoRA enabled."""
    return LLM(str(gptq[0]), progress=False, enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)


def test_loaded_as_stored_int4(llm):
    assert llm.model.quantization == "stored"
    for key in ("wq", "wo", "w_down"):
        w = llm.model.params["layers"][key]
        assert isinstance(w, QuantizedTensor) and w.scheme == "int4" and w.group_size == GROUP_SIZE, w


def test_lora_over_gptq_base(llm, gptq, adapter):
    """A mixed batch (no adapter, the adapter) in one forward: the base row
    equals HF on the dequantized weights, the adapter row PEFT over them; the
    stored float16 scales are exact in float32, so only float32 summation
    order separates them."""
    directory, reference = gptq
    lora = LoRARequest("every", 1, adapter)
    llm.engine.validate_lora("check", lora)
    logits = last_row_logits(llm, PROMPTS, [0, 1])
    assert_logits_close(logits[0], hf_logits(reference, PROMPTS[0])[-1])
    expected = hf_logits(peft_model(reference, adapter), PROMPTS[1])[-1]
    assert_logits_close(logits[1], expected)
    assert np.abs(expected - hf_logits(reference, PROMPTS[1])[-1]).max() > 0.1 * np.abs(expected).max()
    tokens = llm.generate([PROMPTS[1]], greedy(), use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    assert tokens == hf_greedy(peft_model(reference, adapter), PROMPTS[1], NEW_TOKENS)


def test_ngram_speculative_decoding_equals_plain(llm, gptq):
    directory, reference = gptq
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    assert plain == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    spec = LLM(str(directory), progress=False, **ENGINE,
               speculative=dict(method="ngram", num_speculative_tokens=3, max_n=3, disable_by_batch_size=None,
                                adaptive=False))
    assert spec.model.quantization == "stored"
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(), use_tqdm=False)] == plain
    stats = spec.stats()
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] > 0, stats


def test_convert_keeps_the_stored_int4(gptq, tmp_path, capsys):
    """`jaxinfer convert GPTQ_DIR OUT_DIR`: the int4 codes, scales and offsets
    written as loaded (no float copy), restored bit for bit, the same logits."""
    directory, reference = gptq
    out = tmp_path / "orbax"
    assert main(["convert", str(directory), str(out)]) == 0
    assert "(as stored)" in capsys.readouterr().out
    restored = jaxinfer.load(str(out), progress=False)
    direct = jaxinfer.load(str(directory), progress=False)
    (got, tree), (want, want_tree) = (jax.tree_util.tree_flatten(untiled(m.params)) for m in (restored, direct))
    assert tree == want_tree  # QuantizedTensor leaves with their scheme and group size
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
    w = restored.params["layers"]["w_down"]
    assert w.scheme == "int4" and w.data.dtype == np.uint8 and w.group_size == GROUP_SIZE
    for prompt in PROMPTS:
        logits = restored.logits(prompt)
        assert np.array_equal(logits, direct.logits(prompt))
        assert_logits_close(logits, hf_logits(reference, prompt))

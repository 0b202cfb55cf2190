"""The `attention` option: the engine gives the same greedy tokens with the
Pallas kernels (in interpret mode on CPU) as with the CPU's native kernel,
on the default model; the option's names and older aliases resolve in the
backend."""

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.backends import CpuBackend, GpuBackend, XlaBackend
from jaxinfer.engine.config import EngineConfig

# Few buckets: every warm-up compilation traces the interpret-mode kernels.
SMALL = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.mark.slow
def test_pallas_interpret_engine_matches_native():
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        # Longer than the 64-token step budget: prefilled in chunks, then decoded beside the others.
        "Once upon a time, in a small village at the edge of a great forest, there lived an old woman who "
        "kept bees. Every morning she walked to the hives, lifted the lids, and listened to the hum inside. "
        "In spring the hum was bright and quick; in autumn it slowed, like a song sung by tired voices. "
        "One year, when the first frost came early, the hum stopped altogether, and the villagers said",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    native = LLM(progress=False, attention="native", **SMALL)
    pallas = LLM(progress=False, attention="pallas", **SMALL)
    assert pallas.engine.runner.backend.interpret  # off a GPU, Pallas runs in interpret mode
    assert len(native.tokenizer.encode(prompts[2])) > SMALL["max_num_batched_tokens"]
    expected = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in pallas.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # Both decode-only and mixed steps ran through the kernels, each in a bucket of the grid.
    assert pallas.stats()["num_compilations_off_grid"] == 0


def test_unknown_attention_is_rejected():
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention="triton", **SMALL)
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(attention_backend="triton", **SMALL)
    with pytest.raises(ValueError, match="does not run on GpuBackend"):
        GpuBackend().with_attention("native")


def test_older_attention_names_resolve_in_the_backend():
    assert EngineConfig(attention_backend="jnp", **SMALL).attention == "jnp"  # the older option name
    assert CpuBackend().with_attention(None).attention == "native"
    assert CpuBackend().with_attention("xla").attention == "native"  # the platform's own non-Pallas attention
    assert XlaBackend().with_attention("xla").attention == "reference"
    assert CpuBackend(native=False).with_attention(None).attention == "reference"  # a mesh: no custom call
    assert CpuBackend().with_attention("jnp").attention == "reference"
    assert CpuBackend().with_attention("pallas_interpret") == CpuBackend(attention="pallas", interpret=True)
    assert GpuBackend().attention == "pallas" and not GpuBackend().interpret

"""The engine gives the same greedy tokens with the Pallas kernels (in
interpret mode on CPU) as with the plain-jnp backend, on the default model."""

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig

# Few buckets: every warm-up compilation traces the interpret-mode kernels.
SMALL = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)


def test_pallas_interpret_engine_matches_xla():
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
    xla = LLM(progress=False, attention_backend="xla", **SMALL)
    pallas = LLM(progress=False, attention_backend="pallas_interpret", **SMALL)
    assert len(xla.tokenizer.encode(prompts[2])) > SMALL["max_num_batched_tokens"]
    expected = [o.outputs[0].token_ids for o in xla.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in pallas.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # Both decode-only and mixed steps ran through the kernels (compiled at warm-up, no more after).
    pallas.wait_compiled()
    assert pallas.stats()["num_compilations"] == len(pallas.engine.runner.programs())


def test_unknown_attention_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="triton", **SMALL)

"""Multi-device checks, run by tests/parallel/test_tensor_data_parallel.py in one subprocess whose
XLA_FLAGS give JAX 8 virtual CPU devices, so that the rest of the
suite keeps seeing one device. `python -m tests.parallel_checks GROUP...`;
each group asserts and prints what it compared; a failure exits non-zero
(`multihost DIR`: one process of the two-process lockstep check).

References are independent of the code under test: the single-device
(no mesh) uncached full-sequence forward of the same checkpoint and
quantization, the single-device engine, and HF transformers' logits.
"""

from __future__ import annotations

import logging
import re
import sys
import tempfile
import time
from contextlib import contextmanager

import jax
import numpy as np

from jaxinfer import LLM, SamplingParams, load
from jaxinfer.parallel.mesh import replica_meshes
from jaxinfer.parallel.sharding import is_replicated, param_specs
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.tensor import QuantizedTensor
from tests.tiny_models import assert_logits_close, hf_logits, make_hf_model, save_hf_model

ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
VOCAB = 128


def log(*args):
    print(*args, flush=True)


def workload(num=6, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 30, num)]
    max_tokens = [int(m) for m in rng.integers(1, 9, num)]
    return prompts, max_tokens


def greedy(n, logprobs=None):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def reference_greedy(model, prompts, max_tokens):
    """Greedy tokens and their log-probabilities from uncached single-device forwards."""
    tokens_out, logprobs_out = [], []
    for prompt, n in zip(prompts, max_tokens):
        tokens, lps = list(prompt), []
        for _ in range(n):
            logits = model.logits(tokens)[-1].astype(np.float64)
            token = int(logits.argmax())
            lps.append(float(logits[token] - logits.max() - np.log(np.exp(logits - logits.max()).sum())))
            tokens.append(token)
        tokens_out.append(tokens[len(prompt):])
        logprobs_out.append(lps)
    return tokens_out, logprobs_out


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.compiled: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.compiled.append(message[:120])


@contextmanager
def count_compilations(llm):
    """The XLA compilations inside the block beyond the step programs `llm`
    compiles on demand (its runners' own count, one compilation each; the
    runners cannot see a recompilation for a changed input sharding): the
    list it yields holds every compilation logged in the block if there were
    more, else stays empty."""
    runners = [replica.runner for replica in getattr(llm.engine, "replicas", [llm.engine])]
    programs_before = sum(runner.num_compilations for runner in runners)
    handler = _CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    extra = []
    try:
        yield extra
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
        if len(handler.compiled) > sum(runner.num_compilations for runner in runners) - programs_before:
            extra.extend(handler.compiled)


def _flat(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def _parts(path, leaf, spec):
    if isinstance(leaf, InputOrdered):  # the permuted weight split like any other, its order replicated
        yield from _parts(path, leaf.weight, spec.weight)
        yield f"{path}/order", leaf.order, spec.order
    elif isinstance(leaf, QuantizedTensor):
        for name in ("data", "scales", "offsets"):
            if getattr(leaf, name) is not None:
                yield f"{path}/{name}", getattr(leaf, name), getattr(spec, name)
    else:
        yield path, leaf, spec


# Replicated by declaration: the norms, and per-channel scales (offsets) of row-parallel weights.
DECLARED_REPLICATED = re.compile(r"^(final_norm|layers/(attn_norm|mlp_norm|q_norm|k_norm|router|shared_expert_gate)"
                                 r"|layers/(wo|w_down|shared_w_down)/(scales|offsets)|layers/\w+/order)$")


def check_param_shardings(params, mesh) -> int:
    """Each array's actual sharding is its declared spec; a declared split
    gives each device exactly 1 / N of that axis; nothing is replicated
    unless declared so (and the declared-replicated set is the expected one)."""
    n = mesh.size
    declared = param_specs(params, n)
    flat_specs = dict(_flat(declared))
    checked = 0
    for path, leaf in _flat(params):
        for name, array, spec in _parts(path, leaf, flat_specs[path]):
            expected = jax.sharding.NamedSharding(mesh, spec)
            assert array.sharding.is_equivalent_to(expected, array.ndim), (name, array.sharding, spec)
            assert set(array.sharding.device_set) == set(mesh.devices.flat), name
            if is_replicated(spec):
                assert DECLARED_REPLICATED.match(name), f"{name} is replicated but should be split"
                assert array.sharding.is_fully_replicated
            else:
                assert not array.sharding.is_fully_replicated, f"{name} declared {spec} but fully replicated"
                axis = [a for a, s in enumerate(spec) if s is not None][0]
                for shard in array.addressable_shards:
                    expect = list(array.shape)
                    expect[axis] //= n
                    assert list(shard.data.shape) == expect, (name, shard.data.shape, expect)
            checked += 1
    return checked


def check_kv_sharding(llm, tp):
    config = llm.engine.runner.config
    for pool in llm.engine.runner.kv_cache:
        assert pool.sharding.spec[3] == "model", pool.sharding
        for shard in pool.addressable_shards:
            assert shard.data.shape[3] == config.num_kv_heads // tp


def tp_group(backend: str, quantization: str | None, variant="llama_tp", sizes=(2, 4, 8), collectives=None):
    directory = save_hf_model(make_hf_model(variant, seed=7), tempfile.mkdtemp())
    prompts, max_tokens = workload()
    single = load(directory, progress=False, quantization=quantization)
    ref_tokens, ref_logprobs = reference_greedy(single, prompts, max_tokens)
    probe = list(range(3, 3 + 29))
    ref_logits = single.logits(probe)
    if quantization is None:
        assert_logits_close(ref_logits, hf_logits(make_hf_model(variant, seed=7), probe))
    for tp in sizes:
        start = time.perf_counter()
        llm = LLM(directory, progress=False, quantization=quantization, tensor_parallel_size=tp,
                  attention=backend, **ENGINE)
        startup = time.perf_counter() - start
        assert llm.model.mesh.size == tp
        num_arrays = check_param_shardings(llm.model.params, llm.model.mesh)
        check_kv_sharding(llm, tp)
        logits = llm.model.logits(probe)
        logits_err = float(np.abs(logits - ref_logits).max())
        assert_logits_close(logits, ref_logits, rtol=1e-5)
        llm.wait_compiled()  # the buckets left to the background compile, before counting
        with count_compilations(llm) as compiled:
            outputs = llm.generate(prompts, [greedy(n, logprobs=1) for n in max_tokens], use_tqdm=False)
        assert not compiled, f"compiled after warm-up: {compiled}"
        lp_err = 0.0
        for out, tokens, lps in zip(outputs, ref_tokens, ref_logprobs):
            completion = out.outputs[0]
            assert completion.token_ids == tokens, (tp, completion.token_ids, tokens)
            got = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
            lp_err = max(lp_err, float(np.abs(np.array(got) - np.array(lps)).max()))
        assert lp_err < 1e-4, lp_err
        if tp == 4:
            (collectives or check_collectives)(llm)
        log(f"{variant} {backend} {quantization or 'float'} TP{tp}: kv_heads {llm.model.config.num_kv_heads}, "
            f"{num_arrays} arrays as declared, tokens equal, max |logits diff| {logits_err:.2e}, "
            f"max |logprob diff| {lp_err:.2e}, startup {startup:.1f}s")


def compiled_forward(llm, layout: str):
    """(the HLO text of the engine's own compiled forward for its smallest
    bucket of `layout`, that bucket's tokens, its seqs)."""
    r = llm.engine.runner
    n_tok, n_seq, _ = min(b for b in r.buckets() if b[2] == layout)
    return r._executables[("forward", n_tok, n_seq, layout)].as_text(), n_tok, n_seq


def collectives_of(llm, decode: bool):
    """Collective ops of the engine's compiled decode or mixed step: ([(op, result type)], tokens, seqs)."""
    text, n_tok, n_seq = compiled_forward(llm, "decode" if decode else "mixed")
    found = []
    for line in text.split("\n"):
        m = re.search(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(", line)
        if m:
            found.append((m.group(2), m.group(1)))
    return found, n_tok, n_seq


def check_collectives(llm):
    """The compiled step: two all-reduces per layer (one scan body) plus the
    vocab-parallel lookup, all of activation size; the only all-gather is the
    logits rows. No weight or KV-pool gather."""
    hidden = llm.model.config.hidden_size
    for decode in (True, False):
        found, n_tok, n_seq = collectives_of(llm, decode)
        reduces = [t for op, t in found if op == "all-reduce"]
        gathers = [t for op, t in found if op == "all-gather"]
        others = [op for op, _ in found if op not in ("all-reduce", "all-gather")]
        assert len(reduces) == 3 and all(re.match(rf"f32\[(1,)?{n_tok},{hidden}\]", t) for t in reduces), found
        assert len(gathers) == 1 and re.match(rf"f32\[{n_seq},{VOCAB}\]", gathers[0]), found
        assert not others, found
        log(f"  {'decode' if decode else 'mixed'} step collectives: {found}")


def check_moe_collectives(llm):
    """A MoE's compiled step: all-reduces of activations only (the experts'
    shares summed where a dense model sums w_down's), no gather of a weight
    or the KV pool: the all-gathers are the logits rows and the experts'
    group sizes (one int32 per expert)."""
    hidden, num_experts = llm.model.config.hidden_size, llm.model.config.num_experts
    for decode in (True, False):
        found, n_tok, n_seq = collectives_of(llm, decode)
        rows = n_tok * llm.model.config.num_experts_per_tok
        for op, t in found:
            if op == "all-reduce":
                assert re.match(rf"f32\[((1,)?{n_tok},{hidden}|{rows},\d+)\]", t), found
            else:
                assert op == "all-gather" and re.match(rf"(f32\[{n_seq},{VOCAB}\]|s32\[{num_experts}\])", t), found
        log(f"  {'decode' if decode else 'mixed'} step collectives: {found}")


def moe_group():
    """Mixtures of experts beside the attention's tensor parallelism: Qwen2-MoE
    (int8, shared expert, a dense layer) at TP 4, its 8 experts split whole
    over the devices (expert parallelism; the collectives checked), and
    Mixtral at TP 8, whose 4 experts do not divide, each split on its hidden
    size; the single-device model's logits and greedy tokens. (Two engines:
    each size costs ~15 s of the suite.)"""
    tp_group("xla", "int8", variant="qwen2_moe_tp", sizes=(4,), collectives=check_moe_collectives)
    tp_group("xla", None, variant="mixtral_tp", sizes=(8,))


def specs_group():
    """Shardings of float / int8 / int4 / fp8 / orbax-restored params, KV-head
    replication with biases and tied embeddings, and that loading hands
    devices only their slices."""
    from jaxinfer.convert import convert

    directory = save_hf_model(make_hf_model("llama_tp", seed=7), tempfile.mkdtemp())
    mesh8 = replica_meshes(8)[0]
    probe = list(range(5, 5 + 20))

    # Loading puts only slices: every callback of make_array_from_callback is asked for one device's part.
    calls = []
    original = jax.make_array_from_callback

    def spying(shape, sharding, callback, *args, **kwargs):
        def recorded(index):
            out = callback(index)
            calls.append((tuple(shape), sharding, out.shape))
            return out
        return original(shape, sharding, recorded, *args, **kwargs)

    jax.make_array_from_callback = spying
    try:
        model = load(directory, progress=False, mesh=mesh8)
    finally:
        jax.make_array_from_callback = original
    assert calls
    for shape, sharding, got in calls:
        assert got == sharding.shard_shape(shape), (shape, got)
    split = sum(1 for shape, sharding, got in calls if got != shape)
    log(f"load TP8: {len(calls)} device slices put, {split} of them a strict part of their tensor, "
        f"{check_param_shardings(model.params, mesh8)} arrays as declared")

    for quantization in ("int8", "int4", "fp8"):
        single = load(directory, progress=False, quantization=quantization)
        sharded = load(directory, progress=False, quantization=quantization, mesh=mesh8)
        n = check_param_shardings(sharded.params, mesh8)
        assert_logits_close(sharded.logits(probe), single.logits(probe), rtol=1e-5)
        log(f"{quantization} TP8: {n} arrays as declared, logits equal single-device")

    # orbax restore with target shardings (KV heads replicated, then repeated on device).
    with tempfile.TemporaryDirectory() as tmp:
        for quantize in ("none", "int8"):
            out = f"{tmp}/ckpt-{quantize}"
            convert(directory, out, quantize=quantize, progress=False, log=lambda *a, **k: None)
            single = load(out, progress=False)
            for tp in (2, 8):
                mesh = replica_meshes(tp)[0]
                restored = load(out, progress=False, mesh=mesh)
                n = check_param_shardings(restored.params, mesh)
                assert_logits_close(restored.logits(probe), single.logits(probe), rtol=1e-5)
                log(f"orbax {quantize} TP{tp}: {n} arrays restored as declared, logits equal single-device")

    # GGUF blocks kept quantized (32-row groups): at TP 2 the row-parallel
    # weights' 2 groups split with their rows, at TP 4 a group straddles shards.
    import gguf

    from tests.gguf_writer import write_gguf

    small = make_hf_model("llama", seed=7)  # 4 heads, 2 KV heads, head_dim 16
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
            path = str(write_gguf(small, f"{tmp}/m-{qtype.name}.gguf", qtype))
            single = load(path, progress=False, quantization="gguf")
            for tp in (2, 4):
                mesh = replica_meshes(tp)[0]
                sharded = load(path, progress=False, quantization="gguf", mesh=mesh)
                assert isinstance(sharded.params["layers"]["wo"], QuantizedTensor)
                n = check_param_shardings(sharded.params, mesh)
                assert_logits_close(sharded.logits(probe), single.logits(probe), rtol=1e-5)
                log(f"GGUF {qtype.name} kept quantized, TP{tp}: {n} arrays as declared, logits equal single-device")

    # Biases repeated with the KV heads, tied (vocab-split) embeddings: against HF.
    qwen = make_hf_model("qwen2_tp", seed=7)
    qwen_dir = save_hf_model(qwen, tempfile.mkdtemp())
    for tp in (2, 4, 8):
        mesh = replica_meshes(tp)[0]
        sharded = load(qwen_dir, progress=False, mesh=mesh)
        check_param_shardings(sharded.params, mesh)
        assert_logits_close(sharded.logits(probe), hf_logits(qwen, probe))
    log("qwen2 (q/k/v biases, tied embeddings) TP2/4/8: logits equal HF")



def lora_group():
    """LoRA under tensor parallelism: a mixed batch (base model and two
    adapters, one adapting every target) at TP 4 (KV heads repeated, so
    the k/v adapters' B columns are repeated with them) gives
    the single-device LoRA engine's logits, which match PeftModel's; each
    A/B buffer is split like its base weight; greedy tokens equal the
    single-device engine's, with no compilation after warm-up. Then the same
    at TP 2 over int8 base weights, against the single-device int8 engine."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxinfer import LoRARequest
    from jaxinfer.parallel.sharding import COLUMN_PARALLEL
    from tests.lora_helpers import last_row_logits, make_adapter, peft_model

    root = tempfile.mkdtemp()
    base = make_hf_model("llama_tp", seed=7)
    directory = save_hf_model(base, f"{root}/base")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    loras = [LoRARequest("all", 1, make_adapter(base, f"{root}/all", 1, r=8, lora_alpha=16, target_modules=every)),
             LoRARequest("kv", 2, make_adapter(base, f"{root}/kv", 2, r=4, lora_alpha=4,
                                               target_modules=["k_proj", "v_proj", "down_proj"]))]
    options = dict(ENGINE, max_num_seqs=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in (6, 5, 4)]  # 15 rows: within max_num_batched_tokens
    ids = [0, 1, 2]
    requests = [None, *loras]

    def run(llm):
        llm.wait_compiled()
        for lora in loras:
            llm.engine.validate_lora("check", lora)
        logits = last_row_logits(llm, prompts, ids)
        with count_compilations(llm) as compiled:
            outputs = llm.generate(prompts, greedy(5), use_tqdm=False, lora_request=requests)
        assert not compiled, f"compiled after warm-up: {compiled}"
        return logits, [o.outputs[0].token_ids for o in outputs]

    single_logits, single_tokens = run(LLM(directory, progress=False, **options))
    for prompt, lora, row in zip(prompts, requests, single_logits):
        assert_logits_close(row, hf_logits(base if lora is None else peft_model(base, lora.lora_path), prompt)[-1])
    for tp in (4,):  # KV heads repeated; TP 2 runs below, over int8 base weights
        llm = LLM(directory, progress=False, tensor_parallel_size=tp, **options)
        mesh = llm.model.mesh
        for key, (a, b) in llm.engine.lora.buffers.items():
            column = key in COLUMN_PARALLEL  # output split: B on its output axis; input split: A on its input axis
            specs = (P(), P(None, None, None, "model")) if column else (P(None, "model", None, None), P())
            for array, spec in zip((a, b), specs):
                assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), (key, array.sharding)
        logits, tokens = run(llm)
        assert_logits_close(logits, single_logits, rtol=1e-5)
        assert tokens == single_tokens, (tp, tokens, single_tokens)
        log(f"LoRA TP{tp} (kv_heads {llm.model.config.num_kv_heads}): A/B split with their base weights, "
            f"mixed-batch logits equal single-device (max |diff| {np.abs(logits - single_logits).max():.2e}), "
            f"greedy tokens equal, no compilation")
    # int8 base weights (quantized matmuls per shard) with the float LoRA term beside them.
    int8_logits, int8_tokens = run(LLM(directory, progress=False, quantization="int8", **options))
    logits, tokens = run(LLM(directory, progress=False, quantization="int8", tensor_parallel_size=2, **options))
    assert_logits_close(logits, int8_logits, rtol=1e-5)
    assert tokens == int8_tokens, (tokens, int8_tokens)
    log(f"LoRA int8 TP2: mixed-batch logits equal single-device int8 (max |diff| "
        f"{np.abs(logits - int8_logits).max():.2e}), greedy tokens equal")


def dp_group():
    """DP 2 x TP 2 on 4 of the devices: a mixed batch equals the single-device engine."""
    directory = save_hf_model(make_hf_model("llama_tp", seed=11), tempfile.mkdtemp())
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 30, 8)]
    params = [
        greedy(6, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=7, seed=1, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=5, seed=2, n=2, ignore_eos=True),
        greedy(3),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, max_tokens=6, seed=3, ignore_eos=True),
        greedy(8),
        SamplingParams(temperature=1.2, min_p=0.05, max_tokens=4, seed=4, ignore_eos=True, logprobs=1),
        greedy(1),
    ]
    options = ENGINE
    single = LLM(directory, progress=False, **options)
    expected = single.generate(prompts, params, use_tqdm=False)
    llm = LLM(directory, progress=False, tensor_parallel_size=2, data_parallel_size=2, **options)
    replicas = llm.engine.replicas
    assert len(replicas) == 2
    devices = [set(r.model.mesh.devices.flat) for r in replicas]
    assert not devices[0] & devices[1] and len(devices[0] | devices[1]) == 4
    for r in replicas:
        check_param_shardings(r.model.params, r.model.mesh)
    llm.wait_compiled()  # the buckets left to the background compile, before counting
    with count_compilations(llm) as compiled:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert not compiled, compiled
    for got, want in zip(outputs, expected):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], (got, want)
        for c, w in zip(got.outputs, want.outputs):
            if w.logprobs is not None:
                for a, b in zip(c.logprobs, w.logprobs):
                    assert a.keys() == b.keys()
                    assert max(abs(a[k].logprob - b[k].logprob) for k in a) < 1e-4
    served = [r.stats()["prefix_cache_queries"] for r in replicas]
    assert all(served), served  # both replicas took requests
    log(f"DP2 x TP2: {len(prompts)} mixed requests equal single-device; prompt tokens per replica {served}")


def multihost_group():
    """One of two processes of a lockstep run (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID set by the caller, 2 CPU devices each):
    TP 4 over both processes' devices. Prints this process's outputs as JSON
    for the caller to compare across processes and with one device."""
    import json

    from jaxinfer.parallel.distributed import initialize

    # Cross-process collectives on CPU go through gloo (GPUs use NCCL by themselves).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    assert initialize(), "no coordinator in the environment"
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    prompts, params = multihost_requests()
    llm = LLM(sys.argv[2], progress=False, tensor_parallel_size=4, **ENGINE)
    assert {d.process_index for d in llm.model.mesh.devices.flat} == {0, 1}
    outputs = llm.generate(prompts, params, use_tqdm=False)
    log("RESULT " + json.dumps([o.outputs[0].token_ids for o in outputs]))


def multihost_requests():
    prompts = [[1, 2, 3, 4, 5], list(range(10, 31)), [7, 8, 9]]
    params = [greedy(6), greedy(4),
              SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True),  # unseeded: host 0's seed
              ]
    return prompts, params


def gptq_tp_group():
    """GPTQ 4-bit checkpoints (tests/prequantized_writers.py) loaded as stored:
    groups of 32 at TP 2 (KV heads split), each shard of wo / w_down holding
    whole groups, its scales and offsets split with its packed int4 rows; and
    asymmetric gptq_v2 groups of 64 at TP 4 (KV heads repeated, int4 codes and
    scales with them), two groups over four shards, so the scales of wo /
    w_down are replicated beside the split rows; and an act-order (desc_act)
    checkpoint at TP 2, its permuted rows split like any others and each
    row-parallel input gathered by its order before the split. Greedy tokens equal the
    single-device load's and HF's on the dequantized float64 reference,
    logits the single-device load's."""
    from pathlib import Path

    from tests.prequantized_writers import gptq_checkpoint
    from tests.tiny_models import hf_greedy

    prompts, max_tokens = workload()
    probe = list(range(3, 3 + 29))
    for tp, group_size, sym, fmt, act_order in ((2, 32, True, "gptq", None), (4, 64, False, "gptq_v2", None),
                                                (2, 16, True, "gptq", 3)):
        directory, reference = gptq_checkpoint(make_hf_model("llama_tp", seed=7), Path(tempfile.mkdtemp()), 4,
                                               group_size, sym, fmt, act_order_seed=act_order)
        single = load(str(directory), progress=False)
        assert single.quantization == "stored"
        ref_tokens, _ = reference_greedy(single, prompts, max_tokens)
        assert ref_tokens == [hf_greedy(reference, p, n) for p, n in zip(prompts, max_tokens)]
        llm = LLM(str(directory), progress=False, tensor_parallel_size=tp, **ENGINE)
        for key in ("wo", "w_down"):  # row-parallel: the packed rows split, the scales with them where whole
            w = llm.model.params["layers"][key]
            assert isinstance(w, InputOrdered) == (act_order is not None), w
            w = w.weight if isinstance(w, InputOrdered) else w
            assert isinstance(w, QuantizedTensor) and w.scheme == "int4" and w.group_size == group_size, w
            groups, rows = w.scales.shape[1], w.data.shape[1]
            local_groups = groups // tp if groups % tp == 0 else groups
            for part in (w.scales, w.offsets):
                assert {s.data.shape[1] for s in part.addressable_shards} == {local_groups}, (key, part.sharding)
            assert {s.data.shape[1] for s in w.data.addressable_shards} == {rows // tp}
        num_arrays = check_param_shardings(llm.model.params, llm.model.mesh)
        check_kv_sharding(llm, tp)
        assert_logits_close(llm.model.logits(probe), single.logits(probe), rtol=1e-5)
        outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert tokens == ref_tokens, (tp, tokens, ref_tokens)
        log(f"GPTQ int4 {fmt}{' act-order' if act_order else ''} groups of {group_size} TP{tp}: {num_arrays} arrays as declared, wo / w_down "
            f"scales {'split with their rows' if local_groups < groups else 'replicated'}, greedy tokens equal "
            "single-device and HF")


GROUPS = {
    "tp-xla": lambda: tp_group("xla", None),
    "tp-gptq": gptq_tp_group,
    # int8 weights and the Pallas kernels (per shard, shard_map) together: the
    # float XLA group above is the baseline that tells the two apart.
    # TP 4 only: the Pallas kernels run interpreted (each size ~12 s), and the
    # float group covers TP 2 and TP 8's replicated KV heads.
    "tp-pallas-int8": lambda: tp_group("pallas", "int8", sizes=(4,)),
    "specs": specs_group,
    "dp": dp_group,
    "lora": lora_group,
    "moe": moe_group,
}

# Printed before each group's lines (run_groups), for the caller to split them.
GROUP_START = "=== group "


def run_groups(names: list[str]) -> bool:
    """Each group in turn, in this one process (JAX, torch and the tiny
    checkpoints take ~10 s to bring up in each new one, and programs of equal
    shapes compile once); a group that fails prints its traceback and the
    next still runs. Each group's lines follow its GROUP_START marker.
    -> whether all passed."""
    import traceback

    passed = True
    for name in names:
        log(f"{GROUP_START}{name}")
        start = time.perf_counter()
        try:
            GROUPS[name]()
        except Exception:
            traceback.print_exc(file=sys.stdout)
            log(f"{name}: FAILED")
            passed = False
        else:
            log(f"{name}: ok in {time.perf_counter() - start:.1f}s")
    return passed


if __name__ == "__main__":
    if sys.argv[1] == "multihost":  # one of two processes; its checkpoint directory follows
        multihost_group()
    else:
        sys.exit(0 if run_groups(sys.argv[1:]) else 1)

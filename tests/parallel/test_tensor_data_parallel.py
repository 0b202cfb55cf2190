"""Tensor and data parallelism.

The multi-device checks run in one subprocess (tests/parallel_checks.py) with
XLA_FLAGS=--xla_force_host_platform_device_count=8: the flag must be set
before JAX starts, and the rest of the suite keeps its single device. A two-process lockstep run (jax.distributed on
localhost, gloo collectives) stands in for multi-host. The partition rules, the KV-head rule, the load
balancer and the CLI / multi-host argument plumbing are checked here,
in-process.
"""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.engine.data_parallel import DataParallelEngine, outstanding_steps
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.parallel.distributed import distributed_args
from jaxinfer.parallel.sharding import (
    expand_kv_heads,
    kv_head_replication,
    logical_spec,
    part_spec,
    sharded_config,
)
from tests.xla_flags import cpu_devices_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def group_logs() -> dict[str, str]:
    """Every group of tests/parallel_checks.py, run in one subprocess of 8
    devices (DP 2 x TP 2 uses 4): {group: its printed lines, ending in
    "GROUP: ok" or its traceback and "GROUP: FAILED"}; the whole output where
    a group printed nothing (the process died)."""
    from tests.parallel_checks import GROUP_START, GROUPS

    env = cpu_devices_env(8)
    proc = subprocess.run([sys.executable, "-m", "tests.parallel_checks", *GROUPS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    logs = {}
    for part in proc.stdout.split(GROUP_START)[1:]:
        name, _, lines = part.partition("\n")
        logs[name] = lines
    whole = f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return {group: logs.get(group) or whole for group in GROUPS}


def _check(group_logs, group):
    out = group_logs[group]
    print(out)
    assert f"{group}: ok" in out, out[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("group", ["tp-xla", "tp-pallas-int8", "tp-gptq", "specs"])
def test_tensor_parallel_equals_single_device(group_logs, group):
    """TP 2/4/8 greedy tokens, logprobs and logits equal the single-device
    model's (float/XLA; int8 weights with the Pallas kernels under shard_map
    at TP 4; GPTQ int4 checkpoints as stored at TP 2 and 4, also HF's);
    every weight's sharding is its declared spec; orbax and safetensors loads
    land in shards; the compiled step has only the Megatron collectives."""
    _check(group_logs, group)


@pytest.mark.slow
def test_lora_tensor_parallel_equals_single_device(group_logs):
    """LoRA adapters at TP 4 (and TP 2 over int8 weights): A/B split with their base weights, a
    mixed-adapter batch's logits and greedy tokens equal the single-device
    LoRA engine's (itself checked against PeftModel)."""
    _check(group_logs, "lora")


@pytest.mark.slow
def test_expert_parallel_equals_single_device(group_logs):
    """MoE models at TP 4 and 8: experts split whole over the devices, or
    each split on its hidden size, beside the attention's TP; logits,
    greedy tokens and logprobs equal the single-device model's."""
    _check(group_logs, "moe")


@pytest.mark.slow
def test_data_parallel_2x2_equals_single_device(group_logs):
    _check(group_logs, "dp")


@pytest.mark.slow
def test_multihost_lockstep_two_processes(tmp_path):
    """Two processes on this machine, joined by jax.distributed (gloo for CPU
    collectives), run TP 4 over their 2 + 2 devices in lockstep: both print
    the same outputs (the unseeded sampled request included: its seed comes
    from host 0), and the greedy ones equal the single-device forward."""
    import json
    import socket

    from jaxinfer import load
    from tests.parallel_checks import multihost_requests, reference_greedy
    from tests.tiny_models import make_hf_model, save_hf_model

    directory = str(save_hf_model(make_hf_model("llama_tp", seed=7), tmp_path))
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = []
    for process_id in range(2):
        env = cpu_devices_env(2, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                              JAX_PROCESS_ID=str(process_id))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.parallel_checks", "multihost", directory],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"{out[-3000:]}\n{err[-6000:]}"
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    assert results[0] == results[1]
    prompts, params = multihost_requests()
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0]
    expected, _ = reference_greedy(load(directory, progress=False), [prompts[i] for i in greedy_rows],
                                   [params[i].max_tokens for i in greedy_rows])
    assert [results[0][i] for i in greedy_rows] == expected
    assert len(results[0][2]) == params[2].max_tokens


# -- partition rules ------------------------------------------------------------------------


def _config(**overrides):
    base = dict(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=8, num_kv_heads=2, head_dim=16)
    return ModelConfig(**{**base, **overrides})


def test_megatron_specs():
    shape = (2, 64, 128)
    for key in ("wq", "wk", "wv", "w_gate", "w_up"):
        assert logical_spec(f"layers/{key}", shape, 4) == P(None, None, "model")
    for key in ("wo", "w_down"):
        assert logical_spec(f"layers/{key}", (2, 128, 64), 4) == P(None, "model", None)
    assert logical_spec("layers/bk", (2, 64), 4) == P(None, "model")
    assert logical_spec("layers/attn_norm", (2, 64), 4) == P()
    assert logical_spec("embed", (128, 64), 4) == P("model", None)  # vocab-parallel
    assert logical_spec("embed", (130, 64), 4) == P(None, "model")  # vocab does not divide: hidden
    assert logical_spec("lm_head", (64, 128), 4) == P(None, "model")
    with pytest.raises(ValueError, match="does not split"):
        logical_spec("layers/w_up", (2, 64, 100), 8)


def test_quantized_part_specs():
    row = logical_spec("layers/wo", (2, 128, 64), 4)
    assert part_spec(row, "data", (2, 128, 64), 4) == P(None, "model", None)
    assert part_spec(row, "data", (2, 64, 64), 4) == P(None, "model", None)  # int4: two rows a byte
    assert part_spec(row, "scales", (2, 1, 64), 4) == P(None, None, None)  # per channel: replicated
    assert part_spec(row, "scales", (2, 4, 64), 4) == P(None, "model", None)  # whole groups per shard
    assert part_spec(row, "offsets", (2, 2, 64), 4) == P(None, None, None)  # a group straddles shards
    column = logical_spec("layers/wq", (2, 64, 128), 4)
    assert part_spec(column, "scales", (2, 1, 128), 4) == P(None, None, "model")


def test_kv_head_rule():
    assert kv_head_replication(8, 4) == 1  # split, 2 per device
    assert kv_head_replication(2, 2) == 1
    assert kv_head_replication(2, 8) == 4  # each KV head on 4 devices
    assert kv_head_replication(1, 4) == 4
    with pytest.raises(ValueError, match="must divide num_kv_heads"):
        kv_head_replication(3, 2)
    assert sharded_config(_config(), 8).num_kv_heads == 8
    assert sharded_config(_config(), 2) == _config()
    with pytest.raises(ValueError, match="attention heads"):
        sharded_config(_config(), 16)
    with pytest.raises(ValueError, match="MLP hidden"):
        sharded_config(_config(intermediate_size=100), 8)


def test_expand_kv_heads_keeps_query_to_kv_mapping():
    """After repeating, query head h must still read original KV head h // (H / KV)."""
    heads, kv, head_dim, n = 8, 2, 3, 8
    w = np.arange(5 * kv * head_dim).reshape(5, kv * head_dim)
    r = kv_head_replication(kv, n)
    expanded = expand_kv_heads(w, kv, r).reshape(5, kv * r, head_dim)
    original = w.reshape(5, kv, head_dim)
    for h in range(heads):
        new_group = heads // (kv * r)
        np.testing.assert_array_equal(expanded[:, h // new_group], original[:, h // (heads // kv)])


# -- data-parallel load balancing --------------------------------------------------------------


class _FakeSeq:
    def __init__(self, prompt, max_tokens):
        self.prompt_token_ids = list(prompt)
        self.num_computed_tokens = 0
        self.params = SimpleNamespace(max_tokens=max_tokens)
        self.output = SimpleNamespace(token_ids=[])
        self.is_finished = False

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output.token_ids)

    @property
    def output_token_ids(self):
        return self.output.token_ids


class _FakeReplica:
    """The slice of LLMEngine the balancer reads: the engine's own count of
    outstanding tokens over its scheduler's sequences, and the step budget."""

    model = tokenizer = None
    config = SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4)
    outstanding_tokens = LLMEngine.outstanding_tokens

    def __init__(self):
        self.requests = {}
        self.scheduler = SimpleNamespace(running=[], waiting=[])

    def add_request(self, request_id, prompt_token_ids, params, prompt=None, lora_request=None):
        seqs = [_FakeSeq(prompt_token_ids, params.max_tokens) for _ in range(params.n)]
        self.requests[request_id] = SimpleNamespace(sequences=seqs)
        self.scheduler.waiting.extend(seqs)


def test_requests_go_to_the_replica_with_least_outstanding_steps():
    replicas = [_FakeReplica(), _FakeReplica()]
    engine = DataParallelEngine(replicas)
    params = lambda m, n=1: SimpleNamespace(max_tokens=m, n=n)  # noqa: E731
    assert engine.add_request("a", [1] * 128, params(4)) == 0  # both empty: the first
    assert outstanding_steps(replicas[0]) == 128 / 64 + 4 / 4  # 3 steps
    # A long output outweighs a long prompt: 12 tokens to generate = 3 steps, 64 prompt tokens = 1.
    assert engine.add_request("b", [1] * 4, params(10)) == 1  # 0 < 3
    assert outstanding_steps(replicas[1]) == 4 / 64 + 10 / 4
    assert engine.add_request("c", [1] * 4, params(4)) == 1  # 2.5625 < 3
    assert engine.add_request("d", [1] * 4, params(4, n=2)) == 0  # 3 < 3.625; n counts per sequence
    assert replicas[0].outstanding_tokens() == (128 + 8, 4 + 8)
    # Replica 0's first prompt is computed and 3 of its 4 tokens generated.
    seq = replicas[0].requests["a"].sequences[0]
    seq.output.token_ids = [0] * 3
    seq.num_computed_tokens = seq.num_tokens
    assert replicas[0].outstanding_tokens() == (8, 1 + 8)
    assert engine.add_request("e", [1] * 3, params(2)) == 0  # 2.375 < 3.625
    assert engine.replica_of == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1], params(1))


# -- multi-host and CLI plumbing (nothing multi-host can run here) ------------------------------


def test_distributed_args_from_flags_and_environment():
    assert distributed_args(environ={}) is None
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed_args(environ=env) == dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3)
    # Flags win over the environment.
    assert distributed_args("h:1", 2, 0, environ=env) == dict(coordinator_address="h:1", num_processes=2,
                                                              process_id=0)
    with pytest.raises(ValueError, match="without a coordinator"):
        distributed_args(num_processes=2, environ={})
    with pytest.raises(ValueError, match="needs process_id"):
        distributed_args("h:1", 2, environ={})
    with pytest.raises(ValueError, match=r"\[0, num_processes\)"):
        distributed_args("h:1", 2, 2, environ={})


def test_cli_passes_parallel_sizes_and_initializes_first(monkeypatch):
    import jaxinfer
    import jaxinfer.parallel.distributed as distributed
    from jaxinfer import cli

    events = []

    class Stop(Exception):
        pass

    def fake_llm(*args, **kwargs):
        events.append(("LLM", kwargs["tensor_parallel_size"], kwargs["data_parallel_size"]))
        raise Stop

    monkeypatch.setattr(jaxinfer, "LLM", fake_llm)
    monkeypatch.setattr(distributed, "initialize", lambda *a: events.append(("init", *a)))
    for argv in (["generate", "--tensor-parallel-size", "4", "--data-parallel-size", "2", "hi"],
                 ["bench", "throughput", "--tensor-parallel-size", "4", "--data-parallel-size", "2"]):
        events.clear()
        with pytest.raises(Stop):
            cli.main(argv[:1 + (argv[0] == "bench")] + ["--coordinator-address", "h:9", "--num-processes", "2",
                                                         "--process-id", "1"] + argv[1 + (argv[0] == "bench"):])
        assert events == [("init", "h:9", 2, 1), ("LLM", 4, 2)]


def test_too_few_devices_is_a_clear_error():
    from jaxinfer.parallel.mesh import replica_meshes

    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        replica_meshes(2, 1)  # this process sees one CPU device

"""Context parallelism: ring attention over a KV pool split across devices.

The multi-device checks (tests/ring_checks.py) run in one subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, set before JAX starts;
one process for all groups because JAX, torch and the tiny checkpoints cost
seconds to bring up each time. References: float64 numpy attention for the
ring itself, the single-device model's uncached forward for the engine.
The allocator's ownership and balance, the size rules and the CLI flag are
checked here, in-process.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer.cli import _parallel_options, build_parser
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.block_ownership import OwnedFreeBlocks, block_owner
from jaxinfer.parallel.mesh import check_parallel_sizes
from tests.xla_flags import cpu_devices_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_context_parallel_engine_and_attention_equal_single_device():
    """Ring attention equals float64 numpy on ragged steps (cached prefixes,
    new chunks, decode rows, a sliding window) at CP 2, 4, 8 and CP 2 x TP 2;
    engines at CP 8 (prompts up to 8k tokens), CP 4 and CP 2 x TP 2 give the
    single-device model's greedy tokens and logprobs, with chunked prefill
    and a prefix-cache hit, and compile nothing after warm-up; a context 4x
    one device's budget is served at CP 4 with balanced blocks; the compiled
    steps hold only the ring's permutes, the statistics' all-to-all / all-gather
    (and TP's usual collectives)."""
    env = cpu_devices_env(8)
    groups = ["attention", "capacity", "engine"]
    proc = subprocess.run([sys.executable, "-m", "tests.ring_checks", *groups], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"ring checks failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    print(proc.stdout)
    for group in groups:
        assert f"{group}: ok" in proc.stdout


def test_blocks_come_from_the_device_with_the_most_room():
    """A growing sequence's blocks go round-robin over the devices (device 0
    has the null block, so one fewer), each block is owned by the device
    whose contiguous range holds it, and freed blocks go back to their owner."""
    num_blocks, devices = 32, 4
    bm = BlockManager(num_blocks, block_size=4, enable_prefix_caching=False, num_devices=devices)
    bm.allocate_prefix(0, [0] * 80)  # prefix caching is off: no blocks yet
    assert bm.allocate(0, 80)
    table = bm.block_table(0)
    owners = [block_owner(b, num_blocks, devices) for b in table]
    assert all(b // 8 == o for b, o in zip(table, owners))
    counts = [owners.count(d) for d in range(devices)]
    assert max(counts) - min(counts) <= 1, counts
    # Device 0 starts one block short (block 0), so the first block comes from device 1.
    assert owners[:4] == [1, 2, 3, 0], owners
    assert 0 not in table
    free_before = bm._free.free_per_device()
    bm.free(0)
    assert bm._free.free_per_device() == [f + c for f, c in zip(free_before, counts)]
    assert sorted(bm._free) == list(range(1, num_blocks))


def test_owned_free_list_rules():
    with pytest.raises(ValueError, match="multiple"):
        OwnedFreeBlocks(30, 4)
    free = OwnedFreeBlocks(16, 2)
    taken = [free.popleft() for _ in range(15)]
    assert sorted(taken) == list(range(1, 16)) and not free and len(free) == 0
    for b in taken:
        free.append(b)
    assert free.free_per_device() == [7, 8]


def test_context_parallel_size_rules():
    # The step's rows split evenly over the context axis, and the smallest token bucket is 16.
    with pytest.raises(ValueError, match="must divide 16"):
        check_parallel_sizes(1, 1, 8, context_parallel_size=3)
    with pytest.raises(ValueError, match="needs 8 devices"):
        check_parallel_sizes(2, 1, 4, context_parallel_size=4)
    with pytest.raises(ValueError, match="positive int"):
        check_parallel_sizes(1, 1, 8, context_parallel_size=0)
    check_parallel_sizes(2, 1, 8, context_parallel_size=4)


def test_cli_context_parallel_flag():
    args = build_parser().parse_args(["generate", "--model", "m", "--context-parallel-size", "4",
                                      "--tensor-parallel-size", "2", "hi"])
    assert _parallel_options(args) == dict(tensor_parallel_size=2, data_parallel_size=None, context_parallel_size=4)

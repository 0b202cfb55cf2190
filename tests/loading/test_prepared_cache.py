"""The prepared-params cache (loading/prepared_cache.py): a second load of a
GGUF reads the params the first one converted and arranged, and they are
the first load's, leaf for leaf, with the same tokens; anything the params
depend on (the file's times or content, the quantization) changing, or a
damaged entry, loads by converting again. The reference each time is a load
that converts the file (the cache off or empty)."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

import jaxinfer
import jaxinfer.utils
from jaxinfer.quant.kquant import KQuantTensor
from jaxinfer.loading.prepared_cache import PreparedParamsCache, finish_writes
from jaxinfer.quant.mixed_stack import MixedStack
from tests.cpu_features import needs_vec16
from tests.gguf_writer import write_kquant_mix
from tests.tiny_models import make_hf_model

Q = gguf.GGMLQuantizationType
# Two types in one weight (a MixedStack) and K-quants elsewhere, as a Q4_K_M file mixes them.
MIX = {"blk.1.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K, "output.weight": Q.Q6_K}
TOKENS = np.arange(1, 30)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """This test's own cache directory. JAX's persistent compilation cache
    stays off in this process (load() would turn it on where the directory
    is set): only the prepared cache reads the directory."""
    monkeypatch.delenv("JAXINFER_DISABLE_COMPILATION_CACHE", raising=False)
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jaxinfer.utils, "_cache_enabled", True)
    return tmp_path / "cache"


def entries(cache_dir):
    return sorted(cache_dir.glob("*/prepared/*.params"))


def load(model, caplog, **options):
    """(model, whether its params came from the cache)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxinfer.loading.prepared_cache"):
        loaded = jaxinfer.load(None if model is None else str(model), progress=False, **options)
        finish_writes()  # the entry is written behind the load
    return loaded, any("prepared params read from" in r.getMessage() for r in caplog.records)


def uncached_load(model, monkeypatch, **options):
    with monkeypatch.context() as m:
        m.setenv("JAXINFER_DISABLE_COMPILATION_CACHE", "1")
        return jaxinfer.load(None if model is None else str(model), progress=False, **options)


def assert_same_params(a, b):
    leaves_a, tree_a = jax.tree.flatten(a.params)
    leaves_b, tree_b = jax.tree.flatten(b.params)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def greedy(model, prompt, steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    return ids[len(prompt):]


def kquant_file(path, seed: int):
    return write_kquant_mix(make_hf_model("llama_kquant", seed=13), path, MIX, seed)


def test_default_model_second_load_reads_the_first_loads_params(cache_dir, caplog):
    first, hit = load(None, caplog)
    assert not hit and len(entries(cache_dir)) == 1
    second, hit = load(None, caplog)
    assert hit and len(entries(cache_dir)) == 1
    assert_same_params(first, second)
    prompt = first.tokenizer.encode("The capital of France is")
    assert greedy(second, prompt, 4) == greedy(first, prompt, 4)


@needs_vec16
def test_kquant_file_hit_and_quantization_miss(tmp_path, cache_dir, caplog):
    path = kquant_file(tmp_path / "m.gguf", seed=6)
    first, hit = load(path, caplog)
    assert not hit
    assert isinstance(first.params["layers"]["wv"], MixedStack)
    assert isinstance(first.params["lm_head"], KQuantTensor) and first.params["lm_head"].tile
    second, hit = load(path, caplog)
    assert hit
    assert_same_params(first, second)
    np.testing.assert_array_equal(second.logits(TOKENS), first.logits(TOKENS))

    a8, hit = load(path, caplog, quantization="gguf-a8")
    assert not hit and len(entries(cache_dir)) == 2
    assert a8.params["lm_head"].activation_block
    a8_again, hit = load(path, caplog, quantization="gguf-a8")
    assert hit
    assert_same_params(a8, a8_again)


def test_an_entry_written_behind_a_load_is_whole_when_the_process_exits(tmp_path, cache_dir, caplog, monkeypatch):
    """The entry is written on a thread after load() returns; a process that
    exits at once (a one-shot `jaxinfer generate`) still leaves it whole,
    and the next load reads it."""
    path = kquant_file(tmp_path / "m.gguf", seed=6)
    env = {**os.environ, "JAXINFER_CACHE_DIR": str(cache_dir)}
    env.pop("JAXINFER_DISABLE_COMPILATION_CACHE", None)
    child = f"import jaxinfer; jaxinfer.load({str(path)!r}, progress=False)"
    subprocess.run([sys.executable, "-c", child], env=env, check=True, cwd=Path(__file__).parents[2])
    assert len(entries(cache_dir)) == 1 and not list(cache_dir.glob("*/prepared/.tmp-*"))
    loaded, hit = load(path, caplog)
    assert hit
    assert_same_params(loaded, uncached_load(path, monkeypatch))


def test_a_touched_or_rewritten_file_loads_afresh(tmp_path, cache_dir, caplog, monkeypatch):
    path = kquant_file(tmp_path / "m.gguf", seed=6)
    load(path, caplog)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    _, hit = load(path, caplog)
    assert not hit and len(entries(cache_dir)) == 2

    # Other blocks in the same bytes, written in place, with the times put back.
    stat = os.stat(path)
    other = kquant_file(tmp_path / "other.gguf", seed=7).read_bytes()
    assert len(other) == stat.st_size and other != path.read_bytes()
    with open(path, "r+b") as file:
        file.write(other)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    rewritten, hit = load(path, caplog)
    assert not hit
    assert_same_params(rewritten, uncached_load(path, monkeypatch))


@pytest.mark.parametrize("damage", ["header", "cut short", "not an entry"])
def test_a_damaged_entry_is_rebuilt(tmp_path, cache_dir, caplog, monkeypatch, damage):
    path = kquant_file(tmp_path / "m.gguf", seed=6)
    load(path, caplog)
    [entry] = entries(cache_dir)
    data = entry.read_bytes()
    if damage == "header":
        data = data[:40] + bytes(b ^ 0xFF for b in data[40:60]) + data[60:]
    elif damage == "cut short":
        data = data[:len(data) - 4096]
    else:
        data = b"\0" * 100
    entry.write_bytes(data)
    rebuilt, hit = load(path, caplog)
    assert not hit and any("ignoring prepared params cache entry" in r.getMessage() for r in caplog.records)
    assert_same_params(rebuilt, uncached_load(path, monkeypatch))
    assert entries(cache_dir) == [entry] and entry.read_bytes() != data
    _, hit = load(path, caplog)
    assert hit


def test_the_least_recently_used_entries_make_room_past_the_cap(tmp_path):
    params = {"w": np.arange(12288, dtype=np.float32), "b": np.ones(3, np.int8)}  # an entry is 56 KiB
    cache = PreparedParamsCache(tmp_path, max_bytes=120 * 1024)
    cache.write("a", params)
    cache.write("b", params)
    os.utime(tmp_path / "a.params", ns=(10**18, 10**18))
    os.utime(tmp_path / "b.params", ns=(15 * 10**17, 15 * 10**17))
    assert cache.read("a") is not None  # now the most recently used
    cache.write("c", params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.params", "c.params"]
    read = cache.read("c")
    assert jax.tree.structure(read) == jax.tree.structure(params)
    for key, value in params.items():
        assert read[key].dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(read[key]), value)
    PreparedParamsCache(tmp_path / "small", max_bytes=16 * 1024).write("d", params)  # larger than its cap
    assert not (tmp_path / "small" / "d.params").exists()

"""`jaxinfer convert`: load a checkpoint (HF directory, GGUF, or a jaxinfer checkpoint) as float,
optionally quantize it (round to nearest, or AWQ with calibration text), and write a jaxinfer
(orbax) checkpoint that `load()` / `LLM()` restore straight onto the device. A quantized HF
checkpoint (GPTQ, AWQ, compressed-tensors, fp8: loading/prequantized/) converted without
--quantize keeps its weights in their stored forms, not widened to float."""

from __future__ import annotations

from pathlib import Path

import numpy as np

QUANTIZE_CHOICES = ("none", "int8", "int4", "int4-awq", "fp8")
# AWQ calibration: rows of this many tokens, this many rows per batch, at most this many batches.
CALIBRATION_SEQ_LEN = 512
CALIBRATION_BATCH_SIZE = 4
CALIBRATION_MAX_BATCHES = 8
AWQ_GROUP_SIZE = 128  # or gcd(in, 128) where 128 does not divide a weight's input size (jaxinfer/calibration.py)


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def disk_size(path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def calibration_token_batches(tokenizer, text: str, seq_len: int = CALIBRATION_SEQ_LEN,
                              batch_size: int = CALIBRATION_BATCH_SIZE,
                              max_batches: int = CALIBRATION_MAX_BATCHES) -> list[np.ndarray]:
    """Calibration text -> int32 token batches [batch, seq_len] (consecutive slices of the text;
    a tail shorter than seq_len is dropped unless it is all there is)."""
    ids = np.asarray(tokenizer.encode(text), np.int32)
    if len(ids) < 2:
        raise ValueError("the calibration text is empty (it tokenizes to fewer than 2 tokens)")
    seq_len = min(seq_len, len(ids))
    rows = ids[: len(ids) // seq_len * seq_len].reshape(-1, seq_len)
    rows = rows[: batch_size * max_batches]
    return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]


def _check_options(quantize: str, group_size, calibration, include_head: bool) -> None:
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if quantize == "int4-awq":
        if calibration is None:
            raise ValueError("int4-awq needs calibration text: pass --calibration FILE (plain text, a few "
                             "thousand tokens of the kind of text the model will see)")
        if not Path(calibration).is_file():
            raise ValueError(f"calibration file {calibration} does not exist")
        if include_head:
            raise ValueError("--include-head is not supported with int4-awq (AWQ scales the linear layers "
                             "inside the blocks only)")
    elif calibration is not None:
        raise ValueError(f"--calibration only applies to int4-awq, not to --quantize {quantize}")
    if quantize == "none" and (group_size is not None or include_head):
        raise ValueError("--group-size and --include-head need --quantize")
    if quantize == "fp8" and group_size is not None:
        raise ValueError("fp8 is per output channel only; leave --group-size unset")


def _load_quantization(src, quantize: str) -> str | None:
    """"stored" for a quantized HF directory left unquantized by the convert (its GPTQ / AWQ /
    compressed-tensors / fp8 weights as published, in quant/tensor.py's forms), else None: the float
    weights that --quantize starts from, or that are written as they are."""
    from jaxinfer.loading.params import STORED
    from jaxinfer.loading.prequantized.source import quantization_config

    if quantize != "none" or src is None:
        return None
    path = Path(src).expanduser()
    return STORED if (path / "config.json").is_file() and quantization_config(path) else None


def convert(src, out_dir, quantize: str = "none", group_size: int | None = None, calibration=None,
            dtype: str = "float32", include_head: bool = False, progress: bool = True, overwrite: bool = False,
            log=print) -> dict:
    """Convert `src` into a jaxinfer checkpoint at `out_dir`; returns the sizes (bytes) it reported.

    src: a HF directory, a .gguf file, a jaxinfer checkpoint, or None for the default model.
    quantize: none | int8 | int4 | int4-awq | fp8 (linear weights of every layer; the head too
    with include_head; from the dequantized weights of a quantized HF checkpoint, which "none"
    keeps as stored). dtype: of everything left unquantized.
    """
    from jaxinfer.backends import XlaBackend
    from jaxinfer.loading.model import load

    _check_options(quantize, group_size, calibration, include_head)
    if Path(out_dir).expanduser().exists() and not overwrite:  # before minutes of loading, not after
        raise FileExistsError(f"{out_dir} already exists; choose another directory or pass --overwrite")
    # Quantized below, from float, or kept as stored; stacked layers (the checkpoint's layout) whatever
    # the platform.
    model = load(src, dtype=dtype, progress=progress, quantization=_load_quantization(src, quantize),
                 backend=XlaBackend())
    return convert_model(model, out_dir, quantize, group_size, calibration, include_head, progress, overwrite, log)


def convert_model(model, out_dir, quantize: str = "none", group_size: int | None = None, calibration=None,
                  include_head: bool = False, progress: bool = True, overwrite: bool = False, log=print) -> dict:
    """`convert` for an already loaded `Model` (its dtype is kept for unquantized weights): float, or
    with quantize "none" also a "stored" load of a quantized HF checkpoint, whose forms are written as
    they are."""
    import jax.numpy as jnp

    from jaxinfer.loading.orbax import save_checkpoint
    from jaxinfer.loading.model import Model
    from jaxinfer.quant.params import params_nbytes

    _check_options(quantize, group_size, calibration, include_head)
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; choose another directory or pass --overwrite")
    source_bytes = disk_size(model.source) if model.source and Path(model.source).exists() else 0
    before = params_nbytes(model.params)
    params = model.params
    if quantize in ("int8", "int4", "fp8"):
        from jaxinfer.quant.params import quantize_params

        params = quantize_params(params, quantize, group_size, include_head)
    elif quantize == "int4-awq":
        from jaxinfer.calibration import awq_quantize_params

        if model.tokenizer is None:
            raise ValueError(f"{model.source} has no tokenizer, so the calibration text cannot be tokenized")
        text = Path(calibration).read_text(encoding="utf-8")
        batches = calibration_token_batches(model.tokenizer, text)
        params = awq_quantize_params(params, model.config, batches, group_size or AWQ_GROUP_SIZE)
    after = params_nbytes(params)
    dtype = jnp.dtype(model.dtype).name
    kept = quantize == "none" and model.quantization == "stored"
    written_as = "as stored" if kept else quantize
    quantized = Model(model.config, params, model.tokenizer, model.dtype, model.source)
    extra = {"quantize": "stored" if kept else quantize, "group_size": group_size, "include_head": include_head,
             "dtype": dtype, "calibration": Path(calibration).name if calibration else None}
    save_checkpoint(quantized, out_dir, progress=progress, overwrite=overwrite, extra_metadata={"convert": extra})
    written = disk_size(out_dir)
    log(f"source     {model.source}: {format_bytes(source_bytes)} on disk")
    log(f"params     {format_bytes(before)} ({'quantized, ' if kept else ''}{dtype}) -> {format_bytes(after)} "
        f"({written_as}"
        f"{', head included' if include_head else ''}), {after / before:.1%}")
    log(f"checkpoint {out_dir}: {format_bytes(written)} on disk")
    return {"source_bytes": source_bytes, "params_bytes_before": before, "params_bytes_after": after,
            "checkpoint_bytes": written}

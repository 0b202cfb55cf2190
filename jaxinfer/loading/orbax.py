"""jaxinfer checkpoints: the params pytree as an orbax checkpoint, restored straight onto the device.

A checkpoint is a directory:

    params/                 orbax (tensorstore) checkpoint of the params, QuantizedTensor leaves
                            stored as {data, scales[, offsets]} sub-dicts of plain arrays
    jaxinfer_config.json    format + version, the ModelConfig, the params structure (per parameter:
                            logical shape, dtype or scheme / group size and each part's shape and
                            dtype) and the size and sha256 of every other file
    tokenizer.json | tokenizer.model, tokenizer_config.json, generation_config.json

The structure is what the restore target is built from, so nothing is read before the device
arrays are allocated with their shardings; it is also checked against the shapes the config
implies. Sizes are checked when the directory is opened and checksums before the restore, so a
truncated or damaged file fails loudly even where tensorstore would read it without complaint
(a truncated orbax manifest copy, a zeroed chunk). `save_checkpoint` writes into a hidden sibling
directory and renames it into place, so OUT_DIR either holds a complete checkpoint or does not exist.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.quant.params import QUANTIZED_KEYS
from jaxinfer.quant.input_order import InputOrdered
from jaxinfer.quant.tensor import SCHEMES, QuantizedTensor

FORMAT = "jaxinfer-orbax"
FORMAT_VERSION = 1
CONFIG_FILE = "jaxinfer_config.json"
PARAMS_DIR = "params"
_PARTS = ("data", "scales", "offsets")
_PART_DTYPES = {"int8": "int8", "int4": "uint8", "fp8": "float8_e4m3fn", "w8a8": "int8"}
_HASH_CHUNK = 16 << 20
QUANTIZABLE = (*(f"layers/{key}" for key in QUANTIZED_KEYS), "lm_head")


def is_orbax_checkpoint(path) -> bool:
    """A jaxinfer checkpoint, or what is left of one whose metadata file is gone."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() or (path / PARAMS_DIR / "_CHECKPOINT_METADATA").is_file()


# ---------------------------------------------------------------------------------------------
# params <-> flat {"layers/wq": leaf} and the structure metadata


def _flatten(params: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in params.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, path + "/"))
        else:
            flat[path] = value
    return flat


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, name = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return tree


def _spec(array) -> dict:
    return {"shape": list(array.shape), "dtype": jnp.dtype(array.dtype).name}


def params_structure(params: dict) -> dict:
    """{path: entry} describing every leaf: {"shape", "dtype"} for a plain array; for a
    QuantizedTensor its logical shape, scheme, group size and the spec of each stored part."""
    structure = {}
    for path, leaf in _flatten(params).items():
        if isinstance(leaf, InputOrdered):
            raise ValueError(f"{path} is an act-order weight (input rows stored permuted: quant/input_order.py), "
                             "which a jaxinfer checkpoint does not hold; convert with --quantize (from the "
                             "dequantized weights), or load the quantized directory itself")
        if isinstance(leaf, QuantizedTensor):
            parts = {name: _spec(getattr(leaf, name)) for name in _PARTS if getattr(leaf, name) is not None}
            structure[path] = {"shape": list(leaf.shape), "scheme": leaf.scheme, "group_size": leaf.group_size,
                               "parts": parts}
        else:
            structure[path] = _spec(leaf)
    return structure


def _storage_tree(params: dict) -> dict:
    """The pytree orbax writes: only dicts and arrays (no custom nodes, no None)."""
    flat = {}
    for path, leaf in _flatten(params).items():
        if isinstance(leaf, QuantizedTensor):
            flat.update({f"{path}/{name}": getattr(leaf, name) for name in _PARTS if getattr(leaf, name) is not None})
        else:
            flat[path] = leaf
    return _nest(flat)


def _expected_part_specs(entry: dict) -> dict:
    """The parts a quantized entry must have, derived from its logical shape, scheme and group size."""
    *lead, rows, cols = entry["shape"]
    scheme, group = entry["scheme"], entry["group_size"]
    data_rows = rows // 2 if scheme == "int4" else rows
    specs = {"data": {"shape": [*lead, data_rows, cols], "dtype": _PART_DTYPES[scheme]},
             "scales": {"shape": [*lead, rows // group, cols], "dtype": "float32"}}
    if scheme == "int4":
        specs["offsets"] = dict(specs["scales"])
    return specs


def _check_structure(structure: dict, config: ModelConfig, where: str) -> None:
    from jaxinfer.models.llama import param_shapes

    expected = {path: list(shape) for path, shape in _flatten(param_shapes(config)).items()}
    if config.tie_word_embeddings and "lm_head" in structure:
        # quantize_params(include_head=True) gives a tied model a quantized copy of embed.T as its head.
        expected["lm_head"] = [config.hidden_size, config.vocab_size]
    missing = sorted(set(expected) - set(structure))
    unexpected = sorted(set(structure) - set(expected))
    if missing:
        raise CheckpointError(f"{where}: the params structure lacks {', '.join(missing)}")
    if unexpected:
        raise CheckpointError(f"{where}: the params structure has parameters this model does not use: "
                              f"{', '.join(unexpected)}")
    for path, entry in structure.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
            raise CheckpointError(f"{where}: the params structure entry for {path} is malformed: {entry!r}")
        if "scheme" in entry and path not in QUANTIZABLE:  # the model multiplies only these via quant/linear.py
            raise CheckpointError(f"{where}: parameter {path} is stored quantized, but only the linear "
                                  f"weights ({', '.join(QUANTIZABLE)}) can be")
        if entry["shape"] != expected[path]:
            raise CheckpointError(f"{where}: parameter {path} has shape {tuple(entry['shape'])}, but the config "
                                  f"implies {tuple(expected[path])}")
        if "scheme" in entry:
            scheme, group = entry.get("scheme"), entry.get("group_size")
            rows = entry["shape"][-2]
            if scheme not in SCHEMES or not isinstance(group, int) or group < 1 or rows % group:
                raise CheckpointError(f"{where}: parameter {path} has an invalid quantization "
                                      f"(scheme {scheme!r}, group_size {group!r}, {rows} input rows)")
            if entry.get("parts") != _expected_part_specs(entry):
                raise CheckpointError(f"{where}: parameter {path} ({scheme}, group {group}) lists parts "
                                      f"{entry.get('parts')!r}, expected {_expected_part_specs(entry)!r}")
        else:
            try:
                dtype = jnp.dtype(entry["dtype"]) if isinstance(entry.get("dtype"), str) else None
            except TypeError:
                dtype = None
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise CheckpointError(f"{where}: parameter {path} has dtype {entry.get('dtype')!r}, "
                                      f"expected a float dtype")


# ---------------------------------------------------------------------------------------------
# config and file manifest


def config_to_dict(config: ModelConfig) -> dict:
    fields = dataclasses.asdict(config)
    fields["rope_scaling"] = dict(config.rope_scaling) if config.rope_scaling else None
    return fields


def config_from_dict(fields: dict, where: str) -> ModelConfig:
    if not isinstance(fields, dict):
        raise CheckpointError(f"{where}: 'config' is not an object")
    fields = dict(fields)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = tuple(sorted(fields["rope_scaling"].items()))
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    required = {f.name for f in dataclasses.fields(ModelConfig)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if unknown := sorted(set(fields) - names):
        raise CheckpointError(f"{where}: config has unknown fields {unknown}")
    if missing := sorted(required - set(fields)):
        raise CheckpointError(f"{where}: config lacks the fields {missing}")
    return ModelConfig(**fields)


def _sha256(path: Path, bar=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return digest.hexdigest()


def _file_manifest(directory: Path, bar=None) -> dict:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CONFIG_FILE)
    if bar is not None:
        bar.total = (bar.total or 0) + sum(p.stat().st_size for p in files)
        bar.refresh()
    return {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p, bar)}
            for p in files}


# ---------------------------------------------------------------------------------------------
# saving


def _checkpointer():
    import orbax.checkpoint as ocp

    # Uncompressed: zstd saves ~10% on trained weights and little on quantized ones, but makes the
    # restore about 2.5x slower on a 2-core CPU (default model: 4.0 s instead of 1.5 s).
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def save_checkpoint(model, out_dir, progress: bool = True, overwrite: bool = False,
                    extra_metadata: dict | None = None) -> Path:
    """Write `model` (a loaded `Model`: config, params, tokenizer) as a jaxinfer checkpoint at out_dir.

    The directory appears only once complete: everything is written into a hidden sibling and
    renamed; on any error the sibling is removed and out_dir is left as it was. An existing
    out_dir is an error unless `overwrite`. `extra_metadata` (JSON-able) is stored under "extra".
    """
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; choose another directory or overwrite it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    structure = params_structure(model.params)
    param_bytes = sum(leaf.nbytes for leaf in _flatten(model.params).values())
    bar = tqdm(total=param_bytes, desc=f"saving {out_dir.name}", unit="B", unit_scale=True, disable=not progress,
               leave=False)
    try:
        tmp.mkdir()
        _checkpointer().save(tmp / PARAMS_DIR, _storage_tree(model.params))
        bar.update(param_bytes)
        tokenizer_files = model.tokenizer.save(tmp) if model.tokenizer is not None else []
        bar.set_description(f"checksumming {out_dir.name}")
        metadata = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "config": config_to_dict(model.config),
            "dtype": jnp.dtype(model.dtype).name,
            "params": structure,
            "tokenizer": {"type": type(model.tokenizer).__name__, "files": tokenizer_files}
            if model.tokenizer is not None else None,
            "source": getattr(model, "source", ""),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "extra": extra_metadata or {},
            "files": _file_manifest(tmp, bar),
        }
        # Written last: a directory without it is not a checkpoint at all.
        (tmp / CONFIG_FILE).write_text(_dumps(metadata))
        _replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return out_dir


def _dumps(metadata: dict) -> str:
    text = json.dumps(metadata, indent=1, ensure_ascii=False)
    # One line per shape instead of one per dimension.
    return re.sub(r"\[\s*([-0-9,\s]*?)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)


def _replace(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# loading


class OrbaxCheckpoint:
    """An opened (metadata read and checked, sizes verified) jaxinfer checkpoint; `restore` reads the params."""

    def __init__(self, directory: Path, metadata: dict, config: ModelConfig):
        self.directory = directory
        self.description = str(directory)
        self.metadata = metadata
        self.config = config
        self.structure = metadata["params"]
        self.dtype = np.dtype(jnp.dtype(metadata.get("dtype", "float32")))

    @property
    def stored_dtype(self) -> np.dtype:
        """The dtype of the unquantized parameters as written (dtype="auto")."""
        return self.dtype

    def _error(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.directory}: {problem}")

    def verify_checksums(self, progress: bool = False) -> None:
        files = self.metadata["files"]
        total = sum(entry["size"] for entry in files.values())
        with tqdm(total=total, desc="verifying checkpoint", unit="B", unit_scale=True, disable=not progress,
                  leave=False) as bar:
            for name, entry in files.items():
                if _sha256(self.directory / name, bar) != entry["sha256"]:
                    raise self._error(f"{name} does not match its checksum: the file is corrupt")

    def _stored_specs(self) -> dict:
        """storage path -> (shape, dtype) as written, from the structure."""
        specs = {}
        for path, entry in self.structure.items():
            if "scheme" in entry:
                for name, part in entry["parts"].items():
                    specs[f"{path}/{name}"] = (tuple(part["shape"]), jnp.dtype(part["dtype"]))
            else:
                specs[path] = (tuple(entry["shape"]), jnp.dtype(entry["dtype"]))
        return specs

    def _check_stored_arrays(self, specs: dict) -> None:
        """orbax's own metadata of params/ against the structure, before anything is allocated."""
        try:
            stored = _flatten(_checkpointer().metadata(self.directory / PARAMS_DIR).item_metadata.tree)
        except Exception as e:
            raise self._error(f"cannot read the orbax metadata of {PARAMS_DIR}/: {type(e).__name__}: "
                              f"{str(e)[:500]}") from e
        problems = [f"{path} is not on disk" for path in specs if path not in stored]
        problems += [f"{path} is on disk but not in the structure" for path in stored if path not in specs]
        for path, (shape, dtype) in specs.items():
            if path in stored:
                on_disk = (tuple(stored[path].shape), jnp.dtype(stored[path].dtype))
                if on_disk != (shape, dtype):
                    problems.append(f"{path} is {on_disk[1].name}{list(on_disk[0])} on disk, "
                                    f"expected {dtype.name}{list(shape)}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise self._error(f"the arrays in {PARAMS_DIR}/ do not match the params structure: "
                              f"{'; '.join(problems[:5])}{more}")

    def _is_plain(self, path: str) -> bool:
        return path in self.structure and "scheme" not in self.structure[path]

    def restore(self, dtype=None, sharding=None, verify_checksums: bool = True, progress: bool = False) -> dict:
        """Read the params onto the device(s).

        dtype: the float dtype for plain (unquantized) parameters; None keeps the stored one. Quantized
        parts keep their stored dtypes. sharding: None (the default device), a `jax.sharding.Sharding`
        for every array, or a callable (path, shape, dtype) -> Sharding, e.g. to shard the layers.
        """
        import orbax.checkpoint as ocp

        if verify_checksums:
            self.verify_checksums(progress)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        sharding_for = sharding if callable(sharding) else (lambda path, shape, dtype: sharding)
        float_dtype = np.dtype(dtype) if dtype is not None else None

        stored = self._stored_specs()
        self._check_stored_arrays(stored)
        specs = {  # what to restore as: plain float parameters cast (by orbax) to `dtype`
            path: (shape, float_dtype if float_dtype is not None and self._is_plain(path) else dt)
            for path, (shape, dt) in stored.items()}
        target, restore_args = {}, {}
        for path, (shape, dt) in specs.items():
            s = sharding_for(path, shape, dt)
            target[path] = jax.ShapeDtypeStruct(shape, dt, sharding=s)
            restore_args[path] = ocp.ArrayRestoreArgs(sharding=s, global_shape=shape, dtype=dt)
        try:
            restored = _checkpointer().restore(
                self.directory / PARAMS_DIR,
                args=ocp.args.PyTreeRestore(item=_nest(target), restore_args=_nest(restore_args)))
        except Exception as e:  # tensorstore / orbax errors name files inside; say which checkpoint
            raise self._error(f"orbax could not restore the params: {type(e).__name__}: {str(e)[:500]}") from e
        flat = _flatten(restored)
        if set(flat) != set(specs):
            raise self._error(f"restored params have entries {sorted(set(flat) ^ set(specs))} "
                              f"that the structure does not list")
        for path, (shape, dt) in specs.items():
            array = flat[path]
            if tuple(array.shape) != shape or jnp.dtype(array.dtype) != dt:
                raise self._error(f"{path} was restored as {array.dtype}{list(array.shape)}, "
                                  f"expected {dt.name}{list(shape)}")
        params = {}
        for path, entry in self.structure.items():
            if "scheme" in entry:
                params[path] = QuantizedTensor(flat[f"{path}/data"], flat[f"{path}/scales"],
                                               flat.get(f"{path}/offsets"), entry["scheme"], entry["group_size"])
            else:
                params[path] = flat[path]
        return _nest(params)


def open_orbax_checkpoint(path):
    """-> (ModelConfig, OrbaxCheckpoint, Tokenizer | None, description), like `open_checkpoint`."""
    directory = Path(path).expanduser().absolute()
    config_path = directory / CONFIG_FILE
    try:
        metadata = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: {CONFIG_FILE} is missing; the checkpoint is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{directory}: {CONFIG_FILE} is not valid JSON ({e}); the checkpoint is corrupt") from None
    where = str(directory)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {CONFIG_FILE} does not describe a {FORMAT} checkpoint")
    version = metadata.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{where}: format_version {version!r} is not supported (this jaxinfer reads "
                              f"up to {FORMAT_VERSION}); upgrade jaxinfer")
    for key in ("config", "params", "files"):
        if not isinstance(metadata.get(key), dict):
            raise CheckpointError(f"{where}: {CONFIG_FILE} lacks '{key}'")
    try:
        config = config_from_dict(metadata["config"], where)
    except (TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: config is invalid: {e}") from None
    _check_structure(metadata["params"], config, where)
    files = metadata["files"]
    if not any(name.startswith(PARAMS_DIR + "/") for name in files):
        raise CheckpointError(f"{where}: the file manifest lists no {PARAMS_DIR}/ files")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{where}: the file manifest entry for {name} is malformed")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{where}: the file manifest names {name}, outside the checkpoint")
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{where}: {name} is missing; the checkpoint is incomplete")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{where}: {name} is {size} bytes, expected {entry['size']} "
                                  f"({'truncated' if size < entry['size'] else 'altered'})")
    checkpoint = OrbaxCheckpoint(directory, metadata, config)
    tokenizer = None
    if metadata.get("tokenizer"):
        from jaxinfer.tokenizer import TokenizerError, load_tokenizer

        try:
            tokenizer = load_tokenizer(directory)
        except TokenizerError as e:
            raise CheckpointError(f"{where}: cannot load the tokenizer: {e}") from None
    return config, checkpoint, tokenizer, where

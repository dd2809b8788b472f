"""A model's architecture and special tokens, read from GGUF metadata or config.json
(for a synthetic model: its config.json or a preset of shared.model_files).

`load_base_config` reads what every family shares (shapes, context length, special
tokens, rope): the gateway needs no more. The family options (MoE, latent attention,
recurrent layers, windows, Gemma's decoder) are typed here, since `spillway up`'s
start-up checks read them too, and read by the worker's family modules
(`services/worker/models/`): from config.json, which they get as `extra["hf_config"]`, or
from a GGUF file's keys under its architecture's prefix, `extra["gguf_keys"]` (what the
table of shared/gguf_arch.py does not say). Needs neither torch nor the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spillway.shared.model_files import SYNTHETIC_CONFIGS, ModelSource


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
    # Family options (the defaults are plain Llama).
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3)
    # Per layer: the sliding attention window (a key is seen when it lies less than this
    # many positions back) or None for full attention; () for full attention everywhere.
    layer_windows: tuple[int | None, ...] = ()
    moe: MoEConfig | None = None
    # Multi-head latent attention (DeepSeek-V3). The cache then holds one "head" per token,
    # num_kv_heads = 1 of head_dim = kv_lora_rank + qk_rope_head_dim: the compressed latent
    # and the rotated shared key, read as both K and V (see services/worker/layers/mla.py).
    mla: MLAConfig | None = None
    # Hybrid families (Mamba2 or gated DeltaNet layers among the attention layers).
    hybrid: HybridConfig | None = None
    # Multi-token-prediction layers after the decoder layers (DeepSeek-V3's
    # num_nextn_predict_layers): each predicts one token further ahead (`mtp`).
    num_mtp_layers: int = 0
    # The gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU),
    # set by the family module, which refuses any other its config names.
    hidden_act: str = "silu"
    # Gemma 2 / 3's decoder (set by services/worker/models/gemma.py; the defaults are
    # Llama's): the embeddings times embedding_scale; an RMSNorm on the attention's and the
    # MLP's outputs too, before each residual add; the softmax scale (None: head_dim **
    # -0.5); attention scores and the final logits soft-capped, x -> cap * tanh(x / cap);
    # and the windowed layers' rotary at a base of their own, unscaled (Gemma 3's local base).
    embedding_scale: float = 1.0
    sandwich_norms: bool = False
    attention_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_rope_theta: float | None = None

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: one q_proj, no low-rank query
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary pairs are adjacent dims (x0, x1), (x2, x3), ...


@dataclass(frozen=True)
class HybridConfig:
    """A hybrid model's recurrent layers and family options. Most layers keep a fixed-size
    state per sequence (`services/worker/state_pool.py`) in place of a KV cache."""

    # Per layer: "attention", "mamba2" (Granite 4.0-H) or "gated_delta" (Qwen3-Next).
    layer_kinds: tuple[str, ...]
    conv_width: int  # the short causal convolution's kernel size
    # Mamba2: heads x head_dim x state size, B/C shared by groups of heads.
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    # Gated DeltaNet: key/value heads and widths.
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    # Granite's multipliers (1.0: none) and whether its attention rotates at all.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the softmax scale; None: head_dim ** -0.5
    logits_scaling: float = 1.0  # the logits are divided by it
    rope: bool = True
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotates
    # The always-on dense MLP beside the experts (its width; 0: none) and whether a
    # sigmoid of a learned gate scales it (Qwen3-Next).
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False

    def state_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k != "attention"]


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward: how tokens are routed and which layers have it."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP (False)
    scoring: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3's)
    norm_topk_prob: bool = True  # the chosen weights renormalised to sum to one
    num_shared_experts: int = 0  # always-on experts, one dense MLP of n times the width
    n_group: int = 1  # sigmoid routing: experts in groups, the best topk_group kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False  # e_score_correction_bias: used for choosing only


def load_base_config(source: ModelSource) -> ModelConfig:
    """The fields every family shares. A GGUF file's metadata is parsed once per process
    (`shared.gguf_file.open_gguf`): the weights' loading reads the same parse."""
    if source.kind == "gguf":
        return _from_gguf(source.path)
    if source.kind == "synthetic":
        return _synthetic(source.path)
    return _from_hf_folder(source.path)


def gguf_fields(path: Path) -> dict[str, Any]:
    """Scalar, string and array metadata of a GGUF file (token tables left out: they are
    large)."""
    from spillway.shared.gguf_file import SkippedArray, open_gguf

    fields = open_gguf(path).fields
    return {k: v for k, v in fields.items() if not isinstance(v, SkippedArray)}


def _from_gguf(path: Path) -> ModelConfig:
    """The hyperparameters under the file's architecture prefix, read as transformers reads
    them (shared/gguf_arch.py says what differs between architectures). The keys under
    that prefix are kept as `extra["gguf_keys"]` (the prefix left out) for the worker's
    family module to read its options from."""
    from spillway.shared.gguf_arch import gguf_architecture

    f = gguf_fields(path)
    arch = gguf_architecture(f)
    prefix = f"{arch.name}."
    keys = {k.removeprefix(prefix): v for k, v in f.items() if k.startswith(prefix)}

    def a(name: str, default: Any = None) -> Any:
        return keys.get(name, default)

    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    layers = int(a("block_count"))
    head_dim = int(a(arch.head_dim_key, hidden // heads))
    window = a(arch.sliding_window_key) if arch.sliding_window_key else None
    eos = f.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch.model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(a("feed_forward_length", 0)),
        vocab_size=int(a("vocab_size", 0)) or _gguf_vocab_size(path),
        context_length=int(a("context_length", 2048)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        # Filled in by the weight loader when output.weight is present.
        tie_word_embeddings=True,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        extra={"chat_template": f.get("tokenizer.chat_template"), "gguf_keys": keys},
        qk_norm=arch.qk_norm,
        layer_windows=(int(window),) * layers if window else (),
    )


def _gguf_vocab_size(path: Path) -> int:
    from spillway.shared.gguf_file import SkippedArray, open_gguf

    tokens = open_gguf(path).fields["tokenizer.ggml.tokens"]
    return tokens.length if isinstance(tokens, SkippedArray) else len(tokens)


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
    """From config.json and generation_config.json, as dicts: the fields every family
    shares, read as transformers reads them (the worker's family module reads the rest
    from `extra["hf_config"]`). Options no family serves exactly are refused by name."""
    arch = cfg.get("model_type", "llama")
    prefix = None
    # Gemma 3's image-text checkpoint: its language model is served, and read here since
    # its context length, vocabulary and EOS ids (what the gateway reads) are text_config's.
    if arch == "gemma3":
        cfg, prefix, arch = gemma3_text_config(cfg), "language_model.", "gemma3_text"
    _refuse_unsupported_options(arch, cfg)
    eos = list(_as_ids(cfg.get("eos_token_id")))
    eos += [e for e in _as_ids(gen.get("eos_token_id")) if e not in eos]
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = rope_parameters(cfg)
    return ModelConfig(
        architecture=arch,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos),
        extra={"rope": rope, "hf_config": cfg, "weights_prefix": prefix},
    )


# Gemma3TextConfig's defaults: an image-text checkpoint's text_config as transformers 4
# wrote it leaves out every key equal to them.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
}  # fmt: skip


def gemma3_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's image-text checkpoint (model_type gemma3) as its language model:
    text_config over Gemma3TextConfig's defaults, the outer config's EOS ids and tying.
    Gemma3ForConditionalGeneration never soft-caps its logits, so no final cap is read;
    its weights lie under `language_model.` (the loader strips it and leaves the vision
    tower and the projector out)."""
    text = {**_GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
    for key in ("eos_token_id", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return {**text, "model_type": "gemma3_text", "final_logit_softcapping": None}


def _refuse_unsupported_options(arch: str, cfg: dict[str, Any]) -> None:
    """The options no family serves (each family refuses its own, and the MLP
    activations it does not run: `refuse_options` in the worker's models/family.py)."""
    refuse_rope(arch, rope_parameters(cfg))
    if cfg.get("mlp_bias"):
        raise ValueError(f"{arch}: unsupported mlp_bias=True")
    if cfg.get("quantization_config"):
        kind = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{arch}: unsupported quantization_config ({kind})")


# The rope scaling kinds served exactly (services/worker/layers/rope.py), and the keys each needs.
ROPE_SCALING_KINDS = ("default", "linear", "llama3", "yarn")
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}


def refuse_rope(arch: str, rope: dict[str, Any]) -> None:
    """ValueError naming a rope scaling kind not served, or the keys it lacks (`rope`: as
    `rope_parameters` resolves it)."""
    kind = rope["rope_type"]
    if kind not in ROPE_SCALING_KINDS:
        supported = ", ".join(ROPE_SCALING_KINDS)
        raise ValueError(f"{arch}: unsupported rope scaling {kind!r} (supported: {supported})")
    missing = [k for k in _ROPE_KEYS.get(kind, ()) if rope.get(k) is None]
    if missing:
        raise ValueError(f"{arch}: rope scaling {kind!r} lacks {', '.join(missing)}")


def rope_parameters(cfg: dict[str, Any], rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rope parameters as transformers resolves them: the legacy rope_scaling merged
    with rope_parameters (or `rope`, where a family keeps its own elsewhere: Gemma 3's
    full-attention layers'), rope_type named, and for scaled kinds the pretraining context
    (a top-level original_max_position_embeddings first, else the config's context)."""
    if rope is None:
        rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    else:
        rope = dict(rope)
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn"):
        context = int(cfg.get("max_position_embeddings", 2048))
        original = cfg.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = int(
            original or rope.get("original_max_position_embeddings") or context
        )
        if rope["rope_type"] == "yarn" and rope.get("factor") is None:
            rope["factor"] = context / rope["original_max_position_embeddings"]
    return rope

"""Model weights from a GGUF file or a Hugging Face safetensors folder, as torch tensors
(or random ones for a synthetic model).

Every source ends in the same `ModelWeights`: q/k/v fused into one projection and
gate/up fused into another, so each layer runs one matmul for each, in the Hugging Face
layout (rotate-half RoPE, weights `[out_features, in_features]`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from spillway.kernels.cpu.info import cpu_flags
from spillway.kernels.cpu.matvec import BLOCK_CODES, INTEGER_BLOCK_TYPES, BlockWeight
from spillway.kernels.cpu.quantized_weight import (
    QuantizedExperts,
    QuantizedWeight,
    Weight,
    dequantize,
)
from spillway.services.worker.layers.moe_weights import read_moe_weights
from spillway.services.worker.models.family import Family
from spillway.services.worker.models.registry import family_for, load_model_config
from spillway.services.worker.tensor_files import safetensors_tensors
from spillway.services.worker.weights import LayerWeights, ModelWeights
from spillway.shared.gguf_arch import gguf_architecture
from spillway.shared.gguf_file import GGUFFile, forget_gguf, open_gguf
from spillway.shared.model_config import ModelConfig
from spillway.shared.model_files import ModelSource

log = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# bfloat16 must beat float32 by this much to be chosen: the measurement is short and noisy.
BF16_MIN_SPEEDUP = 1.2
BF16_UNITS = ("avx512_bf16", "amx_bf16")


def resolve_dtype(dtype: str, device: torch.device, auto: str = "exact") -> torch.dtype:
    """`auto`: bfloat16 on CUDA. On the CPU, float32 (the exact mode) unless `auto` is
    "fastest": then bfloat16 where this CPU has bfloat16 units and a start-up measurement
    finds it at least BF16_MIN_SPEEDUP times faster (without such units bfloat16 matmuls
    run emulated, several times slower than float32)."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    if auto != "fastest":
        return torch.float32
    units = [f for f in BF16_UNITS if f in cpu_flags()]
    f32_s, bf16_s = time_matmul(torch.float32), time_matmul(torch.bfloat16)
    speedup = f32_s / bf16_s
    chosen = torch.bfloat16 if units and speedup >= BF16_MIN_SPEEDUP else torch.float32
    log.info(
        "dtype auto (fastest): bfloat16 runs %.2fx float32's speed here, bfloat16 units: %s;"
        " chose %s",
        speedup,
        ", ".join(units) or "none",
        str(chosen).removeprefix("torch."),
    )
    return chosen


def time_matmul(dtype: torch.dtype, rows: int = 64, size: int = 1024, rounds: int = 5) -> float:
    """Best seconds of one [rows, size] x [size, size] product in `dtype` on the CPU."""
    x = torch.randn(rows, size).to(dtype)
    w = torch.randn(size, size).to(dtype)
    best = float("inf")
    with torch.inference_mode():
        torch.nn.functional.linear(x, w)
        for _ in range(rounds):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return best


def load_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype,
    mtp: bool = False,
    keep_quantized: bool = True,
) -> tuple[ModelConfig, ModelWeights]:
    """The model's config (tie_word_embeddings as found in the weights) and its weights
    (with `mtp`, its multi-token-prediction layer too: Hugging Face folders only).

    From a GGUF file in the exact mode (CPU, float32) with `keep_quantized`, the
    projections, the embedding and a MoE layer's stacked experts stay in the file's blocks
    (`QuantizedWeight`, `QuantizedExperts`): memory about the file's size. Without it
    (`--quantize int8`, whose many-row products quantize float32 weights) they load
    dequantized, the blocks kept beside for few-row steps."""
    if source.kind == "synthetic":
        from spillway.services.worker.synthetic import synthetic_weights

        config = load_model_config(source)
        return config, synthetic_weights(config, device, dtype)
    if source.kind == "gguf":
        config = load_model_config(source)
        reader = open_gguf(source.path)  # the parse the config came from
        # The file's blocks hold the float32 weights' exact values: worth keeping for those.
        exact_blocks = device.type == "cpu" and dtype == torch.float32
        tensors, raw_blocks = _gguf_tensors(
            reader, config, exact_blocks, only_blocks=exact_blocks and keep_quantized
        )
        del reader
        forget_gguf(source.path)  # every tensor was copied: the file's pages may go
        names = GGUF_NAMES
    else:
        config = load_model_config(source)
        tensors, raw_blocks = {**safetensors_tensors(source.path)}, {}
        prefix = config.extra.get("weights_prefix")
        if prefix is not None:
            tensors = language_model_tensors(tensors, prefix)
        names = HF_NAMES
    family = family_for(config.architecture)
    weights = _assemble(tensors, names, config, family, device, dtype, raw_blocks, mtp=mtp)
    release_freed_memory()
    tied = weights.lm_head is weights.embed
    if tied != config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=tied)
    return config, weights


def language_model_tensors(tensors: dict[str, Weight], prefix: str) -> dict[str, Weight]:
    """An image-text checkpoint's language model named as a causal LM's: `{prefix}model.*`
    (transformers 5's own layout: `model.{prefix}*`) as `model.*`, `{prefix}lm_head.*` as
    `lm_head.*`; the rest (the vision tower, the projector) left out."""
    renames = (
        (f"{prefix}model.", "model."), (f"model.{prefix}", "model."), (prefix, ""),
        ("lm_head.", "lm_head."),
    )  # fmt: skip
    out = {}
    for name, tensor in tensors.items():
        for old, new in renames:
            if name.startswith(old):
                out[new + name[len(old) :]] = tensor
                break
    return out


def release_freed_memory() -> None:
    """Hands the heap pages freed during the load back to the OS (glibc's malloc_trim):
    the parts of each fused weight are freed after the fusing, in pages glibc otherwise
    keeps, about a third of a quantized model's size. A no-op without glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc's
    except (OSError, AttributeError):
        return
    trim(0)


# --- sources: name -> float tensor in the HF layout ---------------------------------------


def _gguf_tensors(
    reader: GGUFFile, config: ModelConfig, keep_blocks: bool, only_blocks: bool = False
) -> tuple[dict[str, Weight | QuantizedExperts], dict[str, BlockWeight]]:
    """Every tensor dequantized to float32 and, with keep_blocks, the block rows of those
    stored in a format both native few-row block kernels read
    (`kernels.cpu.matvec.INTEGER_BLOCK_TYPES`), permuted
    alike. q/k rows are un-permuted where the architecture's converter permuted them; q/k/v
    biases of an architecture without them are left out, as transformers leaves them. With
    only_blocks, a matrix in any block format (F16 and BF16 too: 16 bits a value) stays
    in its blocks alone (a `QuantizedWeight`), never dequantized here, and so do a MoE
    layer's stacked experts ([E, rows, row bytes]: a `QuantizedExperts`)."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize as gguf_dequantize

    arch = gguf_architecture(reader.fields)
    out: dict[str, Weight | QuantizedExperts] = {}
    blocks: dict[str, BlockWeight] = {}
    check_tensor_types(reader)
    for tensor in reader.tensors:
        if not arch.qkv_bias and tensor.name.endswith(_QKV_BIASES):
            log.warning("ignored %s: %s files have no q/k/v bias", tensor.name, arch.name)
            continue
        # F16 matrices come as float16 arrays: their bytes are rows of 2-byte "blocks".
        stored = tensor.data.view(np.uint8) if tensor.data.dtype == np.float16 else tensor.data
        blocked = stored.ndim == 2 and stored.dtype == np.uint8  # [rows, row bytes]
        kind = tensor.tensor_type.name.lower()
        raw = stored if blocked and keep_blocks else None
        quantized = only_blocks and raw is not None and kind in BLOCK_CODES
        # [E, rows, row bytes]: a MoE layer's stacked experts
        experts = only_blocks and stored.ndim == 3 and stored.dtype == np.uint8
        experts = experts and kind in BLOCK_CODES
        # dequantize gives the numpy (torch) order: GGUF's `ne` shape reversed.
        data = None if quantized or experts else gguf_dequantize(tensor.data, tensor.tensor_type)
        for part, heads in ((".attn_q.", config.num_heads), (".attn_k.", config.num_kv_heads)):
            if arch.permuted_qk and part in tensor.name:
                data = None if data is None else _unpermute_rope_rows(data, heads)
                raw = None if raw is None else _unpermute_rope_rows(raw, heads)
        values, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        width = stored.shape[-1] // block_bytes * values  # a row's values
        if experts:
            stack = torch.from_numpy(np.array(stored, dtype=np.uint8))  # a copy, as below
            out[tensor.name] = QuantizedExperts(((kind, stack),), width)
            continue
        # Beside a float32 copy (keep_blocks without only_blocks), only the formats both
        # few-row block kernels read, float32 and integer: the float32 weights' own
        # kernels serve the rest.
        if raw is not None and (quantized or kind in INTEGER_BLOCK_TYPES):
            rows = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a copy: the file is mapped
            blocks[tensor.name] = BlockWeight(rows, kind, width)
        if quantized:
            out[tensor.name] = QuantizedWeight((blocks.pop(tensor.name),))
        else:
            assert data is not None
            out[tensor.name] = torch.from_numpy(np.array(data, dtype=np.float32))
    return out, blocks


_QKV_BIASES = (".attn_q.bias", ".attn_k.bias", ".attn_v.bias")


# The tensor types llama.cpp users download that we read exactly (gguf-py dequantizes
# them to the numbers transformers loads); a file holding any other is refused at start-up.
GGUF_TENSOR_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
)


def check_tensor_types(reader: GGUFFile) -> None:
    """Raises ValueError naming the first tensor whose type is not in GGUF_TENSOR_TYPES."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in GGUF_TENSOR_TYPES:
            raise ValueError(
                f"{reader.path}: tensor {tensor.name!r} has type {tensor.tensor_type.name},"
                f" which spillway does not load (supported: {', '.join(sorted(GGUF_TENSOR_TYPES))})"
            )


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved RoPE pairs) back to the HF
    rotate-half order, as transformers' GGUF loader does.

    Per head, GGUF rows are (pair i, element j) for i < D/2, j < 2; HF rows are (j, i).
    """
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


# --- assembling ---------------------------------------------------------------------------

LayerName = Callable[[int, str], str]


@dataclass(frozen=True)
class TensorNames:
    embed: str
    norm: str
    lm_head: str
    layer: LayerName  # (layer index, role) -> name; roles are the keys of _HF_ROLES


_HF_ROLES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    # Sandwich norms (Gemma): there post_attention_layernorm is the attention's output norm.
    "post_attn_norm": "post_attention_layernorm.weight",
    "pre_ffn_norm": "pre_feedforward_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}
_GGUF_ROLES = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "o": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "down": "ffn_down.weight",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "pre_ffn_norm": "ffn_norm.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
}

HF_NAMES = TensorNames(
    embed="model.embed_tokens.weight",
    norm="model.norm.weight",
    lm_head="lm_head.weight",
    layer=lambda i, role: f"model.layers.{i}.{_HF_ROLES[role]}",
)
GGUF_NAMES = TensorNames(
    embed="token_embd.weight",
    norm="output_norm.weight",
    lm_head="output.weight",
    layer=lambda i, role: f"blk.{i}.{_GGUF_ROLES[role]}",
)


def _assemble(
    tensors: dict[str, Weight | QuantizedExperts],
    names: TensorNames,
    config: ModelConfig,
    family: Family,
    device: torch.device,
    dtype: torch.dtype,
    raw_blocks: dict[str, BlockWeight] | None = None,
    mtp: bool = False,
) -> ModelWeights:
    """The model's weights; with `mtp`, its first multi-token-prediction layer too (left
    out otherwise: DeepSeek-V3's is a whole MoE layer). Weights kept in blocks
    (`QuantizedWeight`) stay so where they are projections or the embedding, fused as
    the float32 ones would be, and stacked experts (`QuantizedExperts`) where they are a
    MoE layer's; anywhere else they are dequantized."""
    raw_blocks = raw_blocks or {}
    blocks: list[tuple[torch.Tensor, BlockWeight | QuantizedWeight]] = []

    def keep_blocks(weight: torch.Tensor, parts: tuple[str, ...]) -> None:
        """Pairs weight with its parts' blocks, fused alike (row segments where their kinds
        differ: a Q4_K_M file's v beside q and k), when all have them."""
        found = [raw_blocks.get(p) for p in parts]
        if found and all(b is not None for b in found):
            fused = QuantizedWeight.cat([QuantizedWeight((b,)) for b in found if b is not None])
            blocks.append((weight, fused.single or fused))

    def pop(name: str) -> Weight | QuantizedExperts:
        if name not in tensors:
            raise KeyError(f"weight {name!r} missing from the model files")
        return tensors.pop(name)

    def take_blocks(name: str, alone: bool = True) -> Weight | QuantizedExperts:
        """The weight as the source holds it: blocks kept as they are."""
        found = pop(name)
        if isinstance(found, QuantizedWeight | QuantizedExperts):
            return found
        weight = found.to(device=device, dtype=dtype)
        if alone:
            keep_blocks(weight, (name,))
        return weight

    def take_weight(name: str, alone: bool = True) -> Weight:
        weight = take_blocks(name, alone)
        return _as_tensor(weight).to(dtype) if isinstance(weight, QuantizedExperts) else weight

    def take(name: str) -> torch.Tensor:
        weight = take_weight(name)
        return weight if isinstance(weight, torch.Tensor) else _as_tensor(weight).to(dtype)

    def take_norm(name: str) -> torch.Tensor:
        """A norm's weight; for a family whose norms scale by (1 + w), 1 + w in float32
        (from a GGUF file, which holds llama.cpp's 1 + w, read back as transformers reads
        it: w = stored - 1), then in `dtype`."""
        if not family.one_plus_norm:
            return take(name)
        w = _as_tensor(pop(name)).float()
        if names is GGUF_NAMES:
            w = w - 1.0
        return (1.0 + w).to(device=device, dtype=dtype)

    def fuse(*parts: str) -> Weight:
        found = [take_weight(p, alone=False) for p in parts]
        if all(isinstance(w, QuantizedWeight) for w in found):
            return QuantizedWeight.cat([w for w in found if isinstance(w, QuantizedWeight)])
        plain = [_as_tensor(w).to(device=device, dtype=dtype) for w in found]
        fused = torch.cat(plain, dim=0).contiguous()
        keep_blocks(fused, parts)
        return fused

    # GGUF names its stacked experts alike in every family; a folder as its family does.
    experts = None if names is GGUF_NAMES else family.experts

    def layer_weights(i: int) -> LayerWeights:
        n = lambda role: names.layer(i, role)  # noqa: E731
        has_bias = n("q_bias") in tensors
        # An MTP layer lies past the decoder layers: its router's presence says MoE.
        sparse = config.moe is not None and (
            config.moe.sparse_layers[i]
            if i < config.num_layers
            else f"model.layers.{i}.mlp.gate.weight" in tensors
        )
        latent = family.latent_attention_weights
        mla = latent(tensors, config, i, take) if latent is not None else None
        sandwich = config.sandwich_norms
        return LayerWeights(
            attn_norm=take_norm(n("attn_norm")),
            qkv=mla[0] if mla else fuse(n("q"), n("k"), n("v")),
            qkv_bias=torch.cat([take(n(b)) for b in ("q_bias", "k_bias", "v_bias")])
            if has_bias
            else None,
            o=take_weight(n("o")),
            ffn_norm=take_norm(n("pre_ffn_norm" if sandwich else "ffn_norm")),
            gate_up=None if sparse else fuse(n("gate"), n("up")),
            down=None if sparse else take_weight(n("down")),
            q_norm=take_norm(n("q_norm")) if config.qk_norm else None,
            k_norm=take_norm(n("k_norm")) if config.qk_norm else None,
            post_attn_norm=take_norm(n("post_attn_norm")) if sandwich else None,
            post_ffn_norm=take_norm(n("post_ffn_norm")) if sandwich else None,
            moe=read_moe_weights(tensors, config, i, take, experts, take_blocks)
            if sparse
            else None,
            mla=mla[1] if mla else None,
        )

    layers = [layer_weights(i) for i in range(config.num_layers)]
    embed = take_weight(names.embed)
    # A tied model may still ship lm_head (HF save_pretrained can); the config decides.
    tied = names.lm_head not in tensors or (names is HF_NAMES and config.tie_word_embeddings)
    lm_head = embed if tied else take_weight(names.lm_head)
    tensors.pop(names.lm_head, None)
    weights = ModelWeights(embed=embed, layers=layers, norm=take_norm(names.norm), lm_head=lm_head)
    if mtp:
        if family.mtp_weights is None or not config.num_mtp_layers:
            raise ValueError(
                f"model_type {config.architecture!r} has no multi-token-prediction layer"
            )
        weights.mtp = family.mtp_weights(tensors, config, layer_weights, take, weights)
    projected = [lm_head] + [
        t for x in layers for t in (x.qkv, x.o, x.gate_up, x.down) if t is not None
    ]
    ids = {id(t) for t in projected}
    weights.blocks = [(w, b) for w, b in blocks if id(w) in ids]  # not the norms' or biases'
    _check_shapes(weights, config)
    leftover = [k for k in tensors if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        log.warning("ignored %d unused tensors, e.g. %s", len(leftover), leftover[:3])
    return weights


def _as_tensor(weight: Weight | QuantizedExperts) -> torch.Tensor:
    """A weight as a float32 tensor (dequantized where it is kept in blocks)."""
    return weight if isinstance(weight, torch.Tensor) else dequantize(weight)


def _check_shapes(w: ModelWeights, c: ModelConfig) -> None:
    expected = {
        "embed": (w.embed.shape, (c.vocab_size, c.hidden_size)),
        "lm_head": (w.lm_head.shape, (c.vocab_size, c.hidden_size)),
    }
    if c.mla is None:  # (the latent attention's projections are checked as they load)
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        expected["qkv"] = (w.layers[0].qkv.shape, (qkv_rows, c.hidden_size))
        expected["o"] = (w.layers[0].o.shape, (c.hidden_size, c.num_heads * c.head_dim))
    else:
        expected["o"] = (w.layers[0].o.shape, (c.hidden_size, c.num_heads * c.mla.v_head_dim))
    dense = next((x for x in w.layers if x.gate_up is not None and x.down is not None), None)
    if dense is not None:
        assert dense.gate_up is not None and dense.down is not None
        expected["gate_up"] = (dense.gate_up.shape, (2 * c.intermediate_size, c.hidden_size))
        expected["down"] = (dense.down.shape, (c.hidden_size, c.intermediate_size))
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{name} weight has shape {tuple(got)}, the config says {want}")

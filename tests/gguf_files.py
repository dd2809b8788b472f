"""Tiny GGUF files for tests: random llama models with one tensor type for every
projection (`write_tiny_llama`; `write_tiny_qwen3moe` the same with stacked experts in
place of each layer's MLP), and tiny random transformers models of each architecture we
load, written as llama.cpp's converter writes them (`write_tiny_gguf`).

The llama files' projection weights are stored in `tensor_type`: through gguf-py's
quantizers where it has one, else (the K-quants, which gguf-py only dequantizes) as random
blocks whose f16 scales are set to small finite values, so every block is one a file
could hold and `gguf.quants.dequantize` gives its exact values. Norms stay F32 as
llama.cpp keeps them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, RopeScalingType
from gguf.quants import quantize

# Offsets of each K-quant block's f16 scales (d, and dmin where it has one).
_K_SCALE_OFFSETS = {
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
    GGMLQuantizationType.Q2_K: (80, 82),  # a type spillway refuses: for that test
}
TINY = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512, "vocab": 512}
# A Qwen3-MoE's: `experts` stacked experts of width `ffn` a layer, `used` of them a token.
TINY_MOE = {**TINY, "experts": 8, "used": 2}


def random_blocks(
    rng: np.random.Generator, rows: int, cols: int, kind: GGMLQuantizationType
) -> np.ndarray:
    """[rows, row bytes] uint8 of `kind` holding random weights of a [rows, cols] matrix."""
    if kind in _K_SCALE_OFFSETS:
        block, size = GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        for offset in _K_SCALE_OFFSETS[kind]:
            scales = rng.uniform(0.0001, 0.0003, (rows, cols // block)).astype(np.float16)
            data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
        return data.reshape(rows, -1)
    weights = rng.normal(0.0, 0.05, (rows, cols)).astype(np.float32)
    if kind == GGMLQuantizationType.F32:
        return weights
    if kind == GGMLQuantizationType.F16:
        return weights.astype(np.float16)
    return quantize(weights, kind)


def _add_tokenizer(writer: GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary (the loaders want one): the 256 byte characters of
    GPT-2's table, then pairs of them, each with its merge; BOS 0, EOS the last token."""
    chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)]
    chars += [chr(c) for c in range(174, 256)]
    chars += [chr(256 + i) for i in range(256 - len(chars))]
    pairs = [(chars[i % 256], chars[i // 256]) for i in range(vocab - 256)]
    tokens = chars + [a + b for a, b in pairs]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(vocab - 1)


# llama.cpp's Q4_K_M mix: Q4_K, with attn_v, ffn_down and output in Q6_K (it keeps Q6_K
# for half of the layers' attn_v and ffn_down; here all of them).
Q4_K_M = {
    "": GGMLQuantizationType.Q4_K,
    "attn_v": GGMLQuantizationType.Q6_K,
    "ffn_down": GGMLQuantizationType.Q6_K,
    "output": GGMLQuantizationType.Q6_K,
}

# The same of a model whose width is no multiple of 256 (the default model's): Q5_0 for
# most, Q8_0 for the embeddings and some attn_v, Q4_K or Q6_K for ffn_down (the only
# tensors of rows 256 values wide), as `llama_model_quantize` writes them (the lm_head:
# Q5_0 here, the default model's being its embedding).
Q4_K_M_NARROW = {
    "": GGMLQuantizationType.Q5_0,
    "token_embd": GGMLQuantizationType.Q8_0,
    "blk.0.attn_v": GGMLQuantizationType.Q8_0,
    "blk.0.ffn_down": GGMLQuantizationType.Q4_K,
    "blk.1.ffn_down": GGMLQuantizationType.Q6_K,
}

Mix = GGMLQuantizationType | dict[str, GGMLQuantizationType]


def type_of(mix: Mix, name: str) -> GGMLQuantizationType:
    """The type a mix (one type, or name part -> type as Q4_K_M above) gives a tensor."""
    if not isinstance(mix, dict):
        return mix
    found = [k for part, k in mix.items() if part and f"{part}." in name]
    return found[0] if found else mix[""]


def write_tiny_llama(path: Path, kind: Mix, seed: int = 0, shape: dict[str, int] = TINY) -> Path:
    """A llama GGUF (TINY's shapes unless `shape` says) with every projection in `kind`,
    or per tensor as a mix like Q4_K_M says (name part -> type, "" for the rest)."""
    return _write_random(path, "llama", kind, seed, shape)


def write_tiny_qwen3moe(
    path: Path, kind: Mix, seed: int = 0, shape: dict[str, int] = TINY_MOE
) -> Path:
    """A qwen3moe GGUF as `write_tiny_llama` writes a llama (q/k norms; every layer's MLP
    `experts` stacked experts, gate/up/down each [E, rows, cols], the router F32)."""
    return _write_random(path, "qwen3moe", kind, seed, shape)


def add_shapes(
    writer: GGUFWriter, layers: int, context: int, hidden: int, ffn: int, heads: int, kv_heads: int
) -> None:
    """The keys every architecture's file has: its layers, context, widths and heads."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)


def add_config_shapes(writer: GGUFWriter, c: Any, kv_heads: int) -> None:
    """`add_shapes` from a transformers config (`kv_heads`: as the file names them)."""
    add_shapes(
        writer, c.num_hidden_layers, c.max_position_embeddings, c.hidden_size,
        c.intermediate_size, c.num_attention_heads, kv_heads,
    )  # fmt: skip


def finish(writer: GGUFWriter) -> None:
    """The header, the keys and the tensors to the file; the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_random(path: Path, arch: str, kind: Mix, seed: int, t: dict[str, int]) -> Path:
    rng = np.random.default_rng(seed)
    moe = arch == "qwen3moe"
    head_dim = t["hidden"] // t["heads"]
    writer = GGUFWriter(str(path), arch)
    add_shapes(writer, t["layers"], 256, t["hidden"], t["ffn"], t["heads"], t["kv_heads"])
    if moe:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(t["experts"])
        writer.add_expert_used_count(t["used"])
        writer.add_expert_feed_forward_length(t["ffn"])
    else:
        writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(t["vocab"])
    _add_tokenizer(writer, t["vocab"])

    def matrix(name: str, rows: int, cols: int, experts: int = 0) -> None:
        this = type_of(kind, name)
        data = random_blocks(rng, max(experts, 1) * rows, cols, this)
        raw = None if data.dtype != np.uint8 else this
        writer.add_tensor(name, data.reshape(experts, rows, -1) if experts else data, raw_dtype=raw)

    def norm(name: str, size: int = t["hidden"]) -> None:
        writer.add_tensor(name, rng.uniform(0.8, 1.2, size).astype(np.float32))

    matrix("token_embd.weight", t["vocab"], t["hidden"])
    for i in range(t["layers"]):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", t["heads"] * head_dim, t["hidden"])
        matrix(f"blk.{i}.attn_k.weight", t["kv_heads"] * head_dim, t["hidden"])
        matrix(f"blk.{i}.attn_v.weight", t["kv_heads"] * head_dim, t["hidden"])
        matrix(f"blk.{i}.attn_output.weight", t["hidden"], t["heads"] * head_dim)
        norm(f"blk.{i}.ffn_norm.weight")
        if moe:
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
            router = rng.normal(0.0, 0.5, (t["experts"], t["hidden"])).astype(np.float32)
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
            for part, rows, cols in (("gate", t["ffn"], t["hidden"]), ("up", t["ffn"], t["hidden"]),
                                     ("down", t["hidden"], t["ffn"])):  # fmt: skip
                matrix(f"blk.{i}.ffn_{part}_exps.weight", rows, cols, t["experts"])
            continue
        matrix(f"blk.{i}.ffn_gate.weight", t["ffn"], t["hidden"])
        matrix(f"blk.{i}.ffn_up.weight", t["ffn"], t["hidden"])
        matrix(f"blk.{i}.ffn_down.weight", t["hidden"], t["ffn"])
    norm("output_norm.weight")
    matrix("output.weight", t["vocab"], t["hidden"])
    finish(writer)
    return path


# --- tiny random transformers models, written as llama.cpp's converter writes them -------

# Per test family: the GGUF architecture it is written as, its transformers model_type and
# what its config sets beyond TINY's shapes. Mistral is written as `llama`, as llama.cpp
# writes it (its sliding window dropped); Qwen3's head width is 128 and Qwen3-MoE's expert
# width 768 because transformers' GGUF loader reads neither from the file (it takes its
# config defaults, which the real checkpoints share). Gemma's head width is 256, its
# query_pre_attn_scalar (transformers' default, llama.cpp's head width); windows of 4,
# shorter than the prompts; Gemma 3 has 6 layers so that its every-6th full-attention
# layer is there, and its real rope base (1e6; the sliding layers' 10000).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "llama", {}),
    "mistral": ("llama", "mistral", {"sliding_window": 4}),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {"head_dim": 128, "tie_word_embeddings": True}),
    "qwen3moe": ("qwen3moe", "qwen3_moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 768,
        "norm_topk_prob": True,
    }),
    "gemma2": ("gemma2", "gemma2", {
        "head_dim": 256, "sliding_window": 4, "tie_word_embeddings": True,
    }),
    "gemma3": ("gemma3", "gemma3_text", {
        "head_dim": 256, "sliding_window": 4, "num_hidden_layers": 6, "rope_theta": 1e6,
    }),
}  # fmt: skip
# Architectures whose norms scale by (1 + w): llama.cpp writes 1 + w.
ONE_PLUS_NORMS = {"gemma2", "gemma3"}


def random_tiny_model(model_type: str, config: dict[str, Any], seed: int, norm_centre: float = 1.0):
    """(model, generator): a random transformers model of `model_type` (config keywords
    `config`), its norms scaling by about `norm_centre` (0.2 either side) and its biases
    random too, so that every tensor a file holds changes the output; with the generator
    that drew them, for the caller's own changes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **config), dtype=torch.float32
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.4 + (norm_centre - 0.2))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model, g


def tiny_transformers_model(family: str, seed: int = 0, hidden: int = 128, **changes: Any) -> Any:
    """A 2-layer random transformers model of `family` (FAMILIES): weights drawn with
    initializer_range 0.2, norms scaling by about 1 (Gemma's 1 + w: w about 0) and q/k/v
    biases (Qwen2) random too, so that every tensor the file holds changes the output."""
    model_type, options = FAMILIES[family][1], FAMILIES[family][2]
    shapes = dict(
        vocab_size=TINY["vocab"], hidden_size=hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=TINY["vocab"] - 1,
    )  # fmt: skip
    one_plus = FAMILIES[family][0] in ONE_PLUS_NORMS
    model, _ = random_tiny_model(
        model_type, {**shapes, **options, **changes}, seed, 0.0 if one_plus else 1.0
    )
    if one_plus and model.config.tie_word_embeddings:
        # Gemma's tied head would otherwise pick the last token again and again: its
        # embedding, times sqrt(hidden), outweighs what the layers add.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.1)
    return model.eval()


def _permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation (HF rotate-half rows to interleaved pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(
    path: Path,
    family: str,
    kind: Mix,
    seed: int = 0,
    arch: str | None = None,
    **changes: Any,
) -> Path:
    """`tiny_transformers_model(family, seed, **changes)` as a GGUF file: names, metadata
    and q/k rows as llama.cpp's converter writes them, every 2-D weight (and the stacked
    experts) but
    the router in `kind` (or per tensor as a mix says: `type_of`), norms, biases and the
    router in F32. `kind` is quantized with gguf-py's quantizers; a K-quant, which it has
    none for, is random blocks as `random_blocks` draws them (the model 256 wide: a K-quant
    block spans 256 values).
    Gemma's norms are written as 1 + w, its window and (Gemma 2) soft-caps as llama.cpp's
    converter writes them."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = arch or FAMILIES[family][0]
    layout = "llama" if arch == "mistral" else arch  # a `mistral` file: Llama's tensors
    kinds = set(kind.values()) if isinstance(kind, dict) else {kind}
    k_quant = any(k in _K_SCALE_OFFSETS for k in kinds)
    model = tiny_transformers_model(family, seed, hidden=256 if k_quant else 128, **changes)
    rng = np.random.default_rng(seed)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{family}")
    add_config_shapes(writer, c, c.num_key_value_heads)
    if layout == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention") or c.rope_parameters  # Gemma 3: per type
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if arch in ("mistral", "gemma2", "gemma3"):
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "qwen3moe":
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    _add_tokenizer(writer, c.vocab_size)
    model_arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == layout)
    names = get_tensor_name_map(model_arch, c.num_hidden_layers)

    def add(name: str, data: np.ndarray, stored: Mix) -> None:
        stored = type_of(stored, name)
        if stored == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        elif stored == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        elif stored in _K_SCALE_OFFSETS:
            rows = int(np.prod(data.shape[:-1]))
            blocks = random_blocks(rng, rows, data.shape[-1], stored)
            writer.add_tensor(name, blocks.reshape(*data.shape[:-1], -1), raw_dtype=stored)
        else:
            writer.add_tensor(name, quantize(data, stored), raw_dtype=stored)

    for hf_name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        layer = hf_name.split(".")[2] if ".layers." in hf_name else ""
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2 I, H]: gate rows, then up
            gate, up = np.split(data, 2, axis=1)
            add(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate), kind)
            add(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up), kind)
            continue
        if hf_name.endswith("experts.down_proj"):
            add(f"blk.{layer}.ffn_down_exps.weight", data, kind)
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if base == "lm_head" and c.tie_word_embeddings:
            continue  # the embedding serves (llama.cpp writes no output.weight)
        name = f"{names.get_name(base)}.{suffix}"
        if layout == "llama" and ".attn_q." in name:
            data = _permute_rope_rows(data, c.num_attention_heads)
        if layout == "llama" and ".attn_k." in name:
            data = _permute_rope_rows(data, c.num_key_value_heads)
        if arch in ONE_PLUS_NORMS and name.endswith("norm.weight"):
            data = data + 1.0
        quantized = data.ndim == 2 and "ffn_gate_inp" not in name
        add(name, data, kind if quantized else GGMLQuantizationType.F32)
    finish(writer)
    return path


def write_header_only(path: Path, arch: str, **keys: int) -> Path:
    """A GGUF file of architecture `arch` holding only a few hyperparameters (`keys`, under
    the architecture's prefix): enough to be refused as its metadata is read."""
    writer = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    finish(writer)
    return path

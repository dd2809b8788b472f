"""Tiny random llama models written as GGUF files, one tensor type for every projection.

Projection weights are stored in `tensor_type`: through gguf-py's quantizers where it has
one, else (the K-quants, which gguf-py only dequantizes) as random blocks whose f16
scales are set to small finite values, so every block is one a file could hold and
`gguf.quants.dequantize` gives its exact values. Norms stay F32 as llama.cpp keeps them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

# Offsets of each K-quant block's f16 scales (d, and dmin where it has one).
_K_SCALE_OFFSETS = {
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
    GGMLQuantizationType.Q2_K: (80, 82),  # a type spillway refuses: for that test
}
TINY = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512, "vocab": 512}


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


def write_tiny_llama(
    path: Path,
    kind: GGMLQuantizationType | dict[str, GGMLQuantizationType],
    seed: int = 0,
    shape: dict[str, int] = TINY,
) -> Path:
    """A llama GGUF (TINY's shapes unless `shape` says) with every projection in `kind`,
    or per tensor as a mix like Q4_K_M says (name part -> type, "" for the rest)."""
    rng = np.random.default_rng(seed)
    t = shape
    mix = kind if isinstance(kind, dict) else {"": kind}
    head_dim = t["hidden"] // t["heads"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(t["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(t["hidden"])
    writer.add_feed_forward_length(t["ffn"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(t["vocab"])
    _add_tokenizer(writer, t["vocab"])

    def matrix(name: str, rows: int, cols: int) -> None:
        found = [k for part, k in mix.items() if part and f"{part}." in name]
        this = found[0] if found else mix[""]
        data = random_blocks(rng, rows, cols, this)
        raw = None if data.dtype != np.uint8 else this
        writer.add_tensor(name, data, raw_dtype=raw)

    def norm(name: str) -> None:
        writer.add_tensor(name, rng.uniform(0.8, 1.2, t["hidden"]).astype(np.float32))

    matrix("token_embd.weight", t["vocab"], t["hidden"])
    for i in range(t["layers"]):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", t["heads"] * head_dim, t["hidden"])
        matrix(f"blk.{i}.attn_k.weight", t["kv_heads"] * head_dim, t["hidden"])
        matrix(f"blk.{i}.attn_v.weight", t["kv_heads"] * head_dim, t["hidden"])
        matrix(f"blk.{i}.attn_output.weight", t["hidden"], t["heads"] * head_dim)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", t["ffn"], t["hidden"])
        matrix(f"blk.{i}.ffn_up.weight", t["ffn"], t["hidden"])
        matrix(f"blk.{i}.ffn_down.weight", t["hidden"], t["ffn"])
    norm("output_norm.weight")
    matrix("output.weight", t["vocab"], t["hidden"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""What each GGUF architecture we load means: one row per `general.architecture`.

A GGUF file names its architecture and keeps its hyperparameters under that name as a
key prefix (`qwen3.block_count`, ...). Each row says which Hugging Face family the file
runs as and how llama.cpp's converter wrote that family's tensors, as transformers
(`integrations/ggml.py`, `modeling_gguf_pytorch_utils.py`) reads them back: the
reference a GGUF file is served exactly against is transformers loading the same file
with `gguf_file=`.

llama.cpp's converter writes Mistral models as `llama` and drops their sliding window (as
transformers reads such a file back). A file that names itself `mistral` is read as
Llama's layout with `mistral.attention.sliding_window` honoured; transformers cannot load
such a file, so it is held against transformers' Mistral on the same weights.

A family whose file holds options beyond a row's reads them itself: Gemma 2 and 3 files
are read as llama.cpp reads them (`read_gguf` in services/worker/models/gemma.py, over
`ModelConfig.extra["gguf_keys"]`): transformers' GGUF loader reads fewer of their keys and
takes its config defaults for the rest, which agree with every real checkpoint's values
but in the places it names. transformers loads no `deepseek2` file at all: those are read
as llama.cpp's converter writes DeepSeek-V3 (services/worker/models/deepseek_gguf.py) and
held against transformers' DeepseekV3 on the weights the file dequantizes to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GGUFArch:
    name: str  # `general.architecture`, also the prefix of the file's hyperparameter keys
    model_type: str  # the Hugging Face family it runs as (ModelConfig.architecture)
    # llama.cpp's converter permutes the q/k rows of Llama-style models into interleaved
    # RoPE pairs (transformers' LlamaTensorProcessor undoes it); Qwen's rows are as HF's.
    permuted_qk: bool
    qk_norm: bool  # attn_q_norm / attn_k_norm: an RMSNorm over each head (Qwen3)
    qkv_bias: bool  # attn_q/k/v.bias (Qwen2), found in the weights
    # The feed-forward is experts (ffn_*_exps, GGUF_EXPERT_TENSORS) on the layers the
    # family's read_gguf names (services/worker/models/qwen3_moe.py: every layer;
    # deepseek_gguf.py: those after the leading dense ones).
    moe: bool
    head_dim_key: str  # the key holding the head width (default: hidden / heads)
    # The key of a sliding attention window transformers applies, None where it reads
    # none (llama.cpp writes none for these families): full attention on every layer.
    sliding_window_key: str | None = None
    # Whether transformers' GGUF loader reads the architecture at all: where it does not
    # (deepseek2), its tokenizer is built by transformers' generic fast tokenizer from the
    # file's tokenizer keys (shared/tokenizer_files.py), the model held against
    # transformers' model of its family on the weights the file dequantizes to.
    transformers_loads: bool = True


GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    a.name: a
    for a in (
        GGUFArch("llama", "llama", permuted_qk=True, qk_norm=False, qkv_bias=False,
                 moe=False, head_dim_key="rope.dimension_count"),
        # A file that names itself Mistral keeps Llama's tensor layout and its window.
        GGUFArch("mistral", "mistral", permuted_qk=True, qk_norm=False, qkv_bias=False,
                 moe=False, head_dim_key="rope.dimension_count",
                 sliding_window_key="attention.sliding_window"),
        GGUFArch("qwen2", "qwen2", permuted_qk=False, qk_norm=False, qkv_bias=True,
                 moe=False, head_dim_key="attention.key_length"),
        GGUFArch("qwen3", "qwen3", permuted_qk=False, qk_norm=True, qkv_bias=False,
                 moe=False, head_dim_key="attention.key_length"),
        GGUFArch("qwen3moe", "qwen3_moe", permuted_qk=False, qk_norm=True, qkv_bias=False,
                 moe=True, head_dim_key="attention.key_length"),
        # Gemma's decoder (the worker's models/gemma.py reads the rest of its keys);
        # llama.cpp stores its norms as 1 + w.
        GGUFArch("gemma2", "gemma2", permuted_qk=False, qk_norm=False, qkv_bias=False,
                 moe=False, head_dim_key="attention.key_length"),
        GGUFArch("gemma3", "gemma3_text", permuted_qk=False, qk_norm=True, qkv_bias=False,
                 moe=False, head_dim_key="attention.key_length"),
        # DeepSeek-V2/V3's latent attention and MoE (the worker's models/deepseek_gguf.py
        # reads its keys and tensors): q/kv rows as Hugging Face's, whose rotary pairs
        # are adjacent (rope_interleave), as llama.cpp rotates them.
        GGUFArch("deepseek2", "deepseek_v3", permuted_qk=False, qk_norm=False,
                 qkv_bias=False, moe=True, head_dim_key="attention.key_length",
                 transformers_loads=False),
    )
}  # fmt: skip

# The per-layer names (after `blk.{i}.`) of a MoE layer's router and stacked experts:
# gate and up are [experts, expert width, hidden], down [experts, hidden, expert width].
GGUF_EXPERT_TENSORS = {
    "router": "ffn_gate_inp.weight",
    "gate": "ffn_gate_exps.weight",
    "up": "ffn_up_exps.weight",
    "down": "ffn_down_exps.weight",
}
# DeepSeek's (deepseek2): the expert-choosing bias (e_score_correction_bias, [experts]) and
# the shared experts, one dense MLP (gate and up [width, hidden], down [hidden, width]).
GGUF_EXPERT_BIAS = "exp_probs_b.bias"
GGUF_SHARED_EXPERT_TENSORS = {
    "gate": "ffn_gate_shexp.weight",
    "up": "ffn_up_shexp.weight",
    "down": "ffn_down_shexp.weight",
}
# The expert counts and width (each under the architecture's prefix; the family reads them).
EXPERT_COUNT, EXPERT_USED_COUNT, EXPERT_WIDTH = (
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
)


def gguf_architecture(fields: dict[str, Any]) -> GGUFArch:
    """The row of the file's `general.architecture`; ValueError naming it and the
    supported ones when there is none, or when a Llama file holds experts (Mixtral's
    layout, which transformers does not load from GGUF)."""
    name = fields.get("general.architecture")
    arch = GGUF_ARCHITECTURES.get(str(name))
    if arch is None:
        raise ValueError(
            f"unsupported GGUF architecture {name!r} (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    if not arch.moe and int(fields.get(f"{arch.name}.{EXPERT_COUNT}") or 0) > 0:
        raise ValueError(
            f"unsupported GGUF architecture {name!r} with experts ({EXPERT_COUNT}"
            f" {fields[f'{arch.name}.{EXPERT_COUNT}']}): only dense {name} files are loaded"
        )
    return arch

"""Tiny random models of each supported family, saved as Hugging Face folders by
transformers itself, and what transformers makes of them (greedy tokens, logits): the
reference the worker is compared with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from spillway.services.worker.forward_batch import ForwardBatch

TINY_VOCAB = 256

_COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    # A wide spread of random weights: greedy choices are clear-cut, not near ties.
    initializer_range=0.2,
)

FAMILIES: dict[str, dict[str, Any]] = {
    # q/k/v biases; a window on layer 1 only (from max_window_layers on)
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3": dict(),
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        # layer 0 dense, layer 1 MoE: both feed-forwards in one model
        mlp_only_layers=[0],
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # A window shorter than the prompts, so it changes the outputs.
    "mistral": dict(sliding_window=5),
    "deepseek_v3": dict(
        moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, head_dim=8, num_key_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # Windows of 4 on layer 0 (so they change the outputs), soft-caps that bite, a softmax
    # scale apart from head_dim's.
    "gemma2": dict(
        sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
        query_pre_attn_scalar=24,
    ),
    # sliding, full, sliding; the sliding layers at base 100, the full one scaled (linear).
    "gemma3_text": dict(
        num_hidden_layers=3, sliding_window=4, sliding_window_pattern=2,
        rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        query_pre_attn_scalar=24,
    ),
}  # fmt: skip
# Families whose norms scale by (1 + w), zero at init: moved like the hybrids' norms.
ONE_PLUS_NORMS = {"gemma2", "gemma3_text"}

# Hybrid families: recurrent layers (a state per sequence) among attention layers. Kept
# apart from FAMILIES: the model code runs them, serving refuses them.
HYBRID_FAMILIES: dict[str, dict[str, Any]] = {
    # mamba, attention, mamba; rope on, every multiplier away from 1
    "granitemoehybrid": dict(
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        position_embedding_type="rope", num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, shared_intermediate_size=48, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
        mamba_chunk_size=4, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=2.0,
    ),
    # linear, linear, full attention
    "qwen3_next": dict(
        num_hidden_layers=3, layer_types=["linear_attention", "linear_attention",
        "full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
    ),
}  # fmt: skip


def family_config(family: str, **changes: Any):
    from transformers import AutoConfig

    options = FAMILIES[family] if family in FAMILIES else HYBRID_FAMILIES[family]
    return AutoConfig.for_model(family, **{**_COMMON, **options, **changes})


def save_tiny_family(folder: Path, family: str, seed: int = 0, **changes: Any) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **changes)).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it choose
                buffer.normal_(0.0, 0.5)
        if family in HYBRID_FAMILIES or family in ONE_PLUS_NORMS:  # norms at one (or zero)
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    return folder


def load_reference(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def reference_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """transformers' greedy tokens and the smallest top-1/top-2 logit gap along the way.

    With a sliding window, each token comes from a whole forward of the sequence so far:
    `generate` (its sliding-window cache) drifts from the model's own uncached forward
    once a prompt is longer than the window; the uncached forward is the definition.
    """
    if getattr(model.config, "sliding_window", None):
        return _uncached_greedy(model, prompt, new_tokens)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # EOS is just another token for this comparison
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), min(gaps)


def _uncached_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    ids, gaps = list(prompt), []
    with torch.inference_mode():
        for _ in range(new_tokens):
            last = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            top = last.topk(2).values
            gaps.append(float(top[0] - top[1]))
            ids.append(int(last.argmax()))
    return ids[len(prompt) :], min(gaps)


def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] float32: every position's logits in one forward."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()


def packed_batch(prompts: list[list[int]], block_size: int) -> ForwardBatch:
    """Every prompt's tokens in one prefill forward (logits at every position), each row's
    blocks numbered on from the last row's."""
    from spillway.services.worker.forward_batch import ForwardBatch
    from spillway.services.worker.kv_cache import block_table_tensor, slot_mapping_tensor

    tables, block = [], 0
    for p in prompts:
        n = (len(p) + block_size - 1) // block_size
        tables.append(list(range(block, block + n)))
        block += n
    lens = torch.tensor([len(p) for p in prompts])
    rows = torch.repeat_interleave(torch.arange(len(prompts)), lens)
    query_start = torch.zeros(len(prompts) + 1, dtype=torch.int64)
    query_start[1:] = lens.cumsum(0)
    positions = torch.arange(int(lens.sum())) - query_start[rows]
    block_tables = block_table_tensor(tables, torch.device("cpu"))
    return ForwardBatch(
        token_ids=torch.tensor([t for p in prompts for t in p]),
        positions=positions,
        slot_mapping=slot_mapping_tensor(block_tables, rows, positions, block_size),
        block_tables=block_tables,
        context_lens=lens.to(torch.int32),
        query_start=query_start.to(torch.int32),
        logits_indices=None,
        max_query_len=int(lens.max()),
        max_context_len=int(lens.max()),
    )


def packed_prefill_logits(runner, prompts: list[list[int]]) -> torch.Tensor:
    """Every position's logits [T, V] of the prompts prefilled together in one step."""
    with torch.inference_mode():
        return runner.model.forward(packed_batch(prompts, runner.block_size), runner.kv_cache)


KEEP = slice(5, 17)  # the only tokens the model ever picks
QUIET = 0.04  # how much of their output the layers add to the residual stream


def save_repetitive_family(folder: Path, family: str, seed: int = 0, quiet: float = QUIET) -> Path:
    """The tiny random model of the family, made to repeat itself: its output layer picks
    among a dozen tokens only (the other rows scaled down), and its layers' output
    projections are scaled down so that the last token weighs most. Its outputs fall into
    loops that lookups find (drafts stand), while the layers still steer them (drafts
    fall; for a hybrid, a row that went on from the state after a rejected draft would
    come out different)."""
    from safetensors.torch import load_file, save_file

    save_tiny_family(folder, family, seed=seed)
    (path,) = folder.glob("model*.safetensors")
    weights = load_file(str(path))
    head = weights["lm_head.weight"]
    keep = head[KEEP].clone() * 3.0
    head.mul_(0.01)
    head[KEEP] = keep
    for name, t in weights.items():
        if any(s in name for s in ("out_proj", "o_proj", "down_proj", "output_linear")):
            t.mul_(quiet)
    save_file(weights, str(path), metadata={"format": "pt"})
    return folder

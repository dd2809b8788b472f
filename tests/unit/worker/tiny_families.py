"""Tiny random models of each supported family, saved as Hugging Face folders by
transformers itself, and what transformers makes of them (greedy tokens, logits): the
reference the worker is compared with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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
    "qwen3": dict(),
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        # layer 0 dense, layer 1 MoE: both feed-forwards in one model
        mlp_only_layers=[0],
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # A window shorter than the prompts, so it changes the outputs.
    "mistral": dict(sliding_window=5),
}  # fmt: skip


def family_config(family: str, **changes: Any):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**_COMMON, **FAMILIES[family], **changes})


def save_tiny_family(folder: Path, family: str, seed: int = 0, **changes: Any) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **changes)).eval()
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

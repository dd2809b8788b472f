"""MoE routing functions against the reference routers' own code on random logits."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.layers.routing import grouped_sigmoid_topk, softmax_topk


def _router(module, weight: torch.Tensor, **buffers: torch.Tensor):
    with torch.no_grad():
        module.weight.copy_(weight)
        for name, value in buffers.items():
            getattr(module, name).copy_(value)
    return module


def _same_choice(ids, weights, ref_ids, ref_weights) -> None:
    """The same experts with the same weights per token (order within a row aside)."""
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    got = weights.gather(1, order.indices)
    want = ref_weights.float().gather(1, ref_order.indices)
    assert torch.allclose(got, want, atol=1e-7, rtol=0)


@pytest.mark.parametrize("normalize", [False, True])
def test_softmax_topk_equals_qwen3_moe_router(normalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(1)
    config = Qwen3MoeConfig(
        hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=normalize
    )
    weight, x = torch.randn(16, 32), torch.randn(50, 32)
    _, ref_weights, ref_ids = _router(Qwen3MoeTopKRouter(config), weight)(x)
    ids, weights = softmax_topk(x @ weight.T, 4, normalize)
    _same_choice(ids, weights, ref_ids, ref_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == normalize


def test_softmax_topk_equals_mixtral_router():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    torch.manual_seed(2)
    config = MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    weight, x = torch.randn(8, 32), torch.randn(50, 32)
    _, ref_weights, ref_ids = _router(MixtralTopKRouter(config), weight)(x)
    ids, weights = softmax_topk(x @ weight.T, 2, normalize=True)
    _same_choice(ids, weights, ref_ids, ref_weights)


@pytest.mark.parametrize("normalize", [False, True])
def test_grouped_sigmoid_topk_equals_deepseek_v3_router(normalize):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(3)
    config = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=normalize, routed_scaling_factor=2.5,
    )  # fmt: skip
    # A large bias: the choice follows it, the weights must not.
    weight, x, bias = torch.randn(16, 32), torch.randn(50, 32), torch.randn(16) * 2
    router = _router(DeepseekV3TopkRouter(config), weight, e_score_correction_bias=bias)
    _, ref_weights, ref_ids = router(x)
    ids, weights = grouped_sigmoid_topk(x @ weight.T, bias, 4, 4, 2, normalize, 2.5)
    _same_choice(ids, weights, ref_ids, ref_weights)
    unbiased, _ = grouped_sigmoid_topk(x @ weight.T, None, 4, 4, 2, normalize, 2.5)
    assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)
    # Only experts of topk_group groups (of 4 experts each) are ever chosen.
    assert all(len(set((ids[t] // 4).tolist())) <= 2 for t in range(50))

"""`--quantize int8` on MoE families: the routed experts run on int8 weights, made at
start-up by the model's warm-up, not by the first requests."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu.linear import Int8Linear
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_families import (
    FAMILIES,
    HYBRID_FAMILIES,
    packed_prefill_logits,
    save_tiny_family,
)
from tests.unit.worker.tiny_llama import tiny_runner


def _expert_stacks(family: str) -> int:
    """Expert stacks (gate_up and down) of the tiny model's MoE layers."""
    options = {**FAMILIES, **HYBRID_FAMILIES}[family]
    dense = len(options.get("mlp_only_layers", [])) + options.get("first_k_dense_replace", 0)
    return 2 * (options.get("num_hidden_layers", 2) - dense)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_int8_experts_are_made_at_start_up_and_serve(tmp_path, family):
    folder = save_tiny_family(tmp_path / family, family)
    runner = tiny_runner(folder, quantize="int8")
    experts = runner.model.ops.fused_experts
    linear = experts.linear
    assert experts.int8 and isinstance(linear, Int8Linear)
    made = experts.int8_forms()
    # every expert stack of the MoE layers in a form: whole where a native call takes it,
    # else expert by expert (a stack may be in both: a few rows whole, more one by one)
    assert made["packed"] + made["streamed"] + made["one by one"] >= _expert_stacks(family)
    prompts = [[5, 9, 14, 3, 77, 120, 8, 41, 9, 200, 31, 17, 6][: 7 + i] for i in range(6)]
    outputs = generate(runner, prompts, 6, chunk=13)
    assert [len(o) for o in outputs] == [6] * len(prompts)
    # the steps (one of 57 rows, decode steps of 6) made nothing the warm-up had not
    assert experts.int8_forms() == made


def test_int8_experts_move_the_logits_a_little(tmp_path):
    folder = save_tiny_family(tmp_path / "moe", "qwen3_moe")
    prompts = [[5, 9, 14, 3, 77, 120, 8, 41, 9, 200, 31, 17, 6, 90, 4, 66]] * 3
    exact = packed_prefill_logits(tiny_runner(folder), prompts)
    int8_runner = tiny_runner(folder, quantize="int8")
    int8 = packed_prefill_logits(int8_runner, prompts)
    assert int8.shape == exact.shape
    relative = float((int8 - exact).norm() / exact.norm())
    assert 0 < relative < 0.05, relative
    # the experts alone on int8 weights: the float32 experts on the same rows differ too
    moe = int8_runner.model.weights.layers[1].moe
    x = torch.randn(48, moe.w_gate_up.shape[2])
    ids = torch.stack([torch.randperm(moe.w_gate_up.shape[0])[:2] for _ in range(48)])
    weights = torch.full((48, 2), 0.5)
    got = int8_runner.model.ops.fused_experts(x, moe.w_gate_up, moe.w_down, ids, weights)
    want = tiny_runner(folder).model.ops.fused_experts(x, moe.w_gate_up, moe.w_down, ids, weights)
    assert 0 < float((got - want).norm() / want.norm()) < 0.05

"""Qwen3-Next's MTP module: read from a tiny random checkpoint that carries one (`mtp.*`,
which transformers leaves unread) and computed over the paged cache exactly as
transformers' own full-attention decoder layer and (1 + w) norms compute it (prefilled in
one chunk, then one position a step), beside the hybrid model's own layers."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.models.registry import load_hybrid_model, load_model_config
from spillway.shared.model_files import resolve_model
from tests.unit.worker.test_worker_mtp import PROMPT, assert_mtp_matches, reference_mtp
from tests.unit.worker.tiny_families import load_reference
from tests.unit.worker.tiny_mtp import save_tiny_qwen3_next_mtp


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return save_tiny_qwen3_next_mtp(tmp_path_factory.mktemp("qwen3-next-mtp"))


def _reference(folder, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final hidden states and, from its Qwen3NextDecoderLayer and
    Qwen3NextRMSNorm over the checkpoint's mtp.* tensors, the MTP module's logits at every
    position but the last (position p reads token p + 1; no position is zeroed)."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextDecoderLayer,
        Qwen3NextRMSNorm,
    )

    tensors = load_file(str(folder / "mtp.safetensors"))
    model = load_reference(folder)
    config = model.config
    config._attn_implementation = "eager"
    layer = Qwen3NextDecoderLayer(config, config.layer_types.index("full_attention")).eval()
    own = {k.removeprefix("mtp.layers.0."): t for k, t in tensors.items() if ".layers.0." in k}
    layer.load_state_dict(own)

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        n = Qwen3NextRMSNorm(x.shape[-1], config.rms_norm_eps)
        n.weight.data.copy_(tensors[name])
        return n(x)

    def fuse(embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = torch.cat(
            [
                norm("mtp.pre_fc_norm_embedding.weight", embeds),
                norm("mtp.pre_fc_norm_hidden.weight", hidden),
            ],
            -1,
        )
        return x @ tensors["mtp.fc.weight"].T

    return reference_mtp(
        model, layer, prompt, fuse, lambda out: model.lm_head(norm("mtp.norm.weight", out))
    )


def test_the_mtp_module_loads_only_when_asked(mtp_dir, caplog):
    config = load_model_config(resolve_model(str(mtp_dir)))
    assert config.num_mtp_layers == 1
    ops = CpuOps(native=None)
    with caplog.at_level("WARNING", logger="spillway.services.worker.models.hybrid"):
        assert load_hybrid_model(mtp_dir, config, ops).mtp is None
    assert "ignored 19 unused tensors, e.g. ['mtp." in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="spillway.services.worker.models.hybrid"):
        model = load_hybrid_model(mtp_dir, config, ops, mtp=True)
    assert "ignored" not in caplog.text
    assert model.mtp is not None
    layer = model.mtp.layer
    assert layer.attention is not None and layer.moe.router.shape[0] == 4  # MoE, attention
    assert model.mtp.embed is model.embed and model.mtp.head is model.lm_head


def test_the_mtp_module_over_the_paged_cache_equals_transformers(mtp_dir):
    hidden, expected = _reference(mtp_dir, PROMPT)
    config = load_model_config(resolve_model(str(mtp_dir)))
    model = load_hybrid_model(mtp_dir, config, CpuOps(native=None), mtp=True)
    assert model.mtp is not None
    assert_mtp_matches(model, model.mtp, config, hidden, expected)

"""DeepSeek-V3's MTP layer: loaded from a tiny random checkpoint that carries one, and
computed over the paged cache exactly as transformers' own decoder layer computes it
(prefilled in one chunk, then one position a step)."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import KVCache, block_table_tensor, slot_mapping_tensor
from spillway.services.worker.loader import load_model
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.mtp import MtpCache, mtp_forward
from spillway.shared.model_files import resolve_model
from tests.unit.worker.tiny_families import load_reference, save_tiny_family
from tests.unit.worker.tiny_mtp import save_mtp_layer

PROMPT = [1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5, 64, 65, 9]
BLOCK = 4


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    folder = save_tiny_family(
        tmp_path_factory.mktemp("deepseek-mtp"), "deepseek_v3", num_nextn_predict_layers=1
    )
    return folder, save_mtp_layer(folder)


def _reference(folder, tensors: dict[str, torch.Tensor], prompt: list[int]):
    """transformers' final hidden states and, from its DeepseekV3DecoderLayer, the MTP
    layer's logits at every position but the last (position p reads token p + 1)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    model = load_reference(folder)
    config = model.config
    config._attn_implementation = "eager"
    layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers).eval()
    layer.load_state_dict({k: t for k, t in tensors.items() if "." in k and not _mtp_own(k)})
    eps = config.rms_norm_eps

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        n = DeepseekV3RMSNorm(x.shape[-1], eps)
        n.weight.data.copy_(tensors[name])
        return n(x)

    def fuse(embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        embeds[0] = 0.0  # position 0
        x = torch.cat([norm("enorm.weight", embeds), norm("hnorm.weight", hidden)], -1)
        return x @ tensors["eh_proj.weight"].T

    def head(out: torch.Tensor) -> torch.Tensor:
        return norm("shared_head.norm.weight", out) @ tensors["shared_head.head.weight"].T

    return reference_mtp(model, layer, prompt, fuse, head)


def reference_mtp(model, layer, prompt: list[int], fuse, head) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final hidden states over `prompt` and the MTP layer's logits at every
    position but the last (also the Qwen3-Next MTP test's reference): `fuse` gives the
    layer's input from the next tokens' embeddings and the hidden states before them,
    `layer` is transformers' decoder layer, `head` the logits from its output."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hidden = model.model(ids).last_hidden_state[0]  # after the final norm
        t = len(prompt) - 1
        x = fuse(model.model.embed_tokens(ids[0, 1:]), hidden[:t])[None]
        positions = torch.arange(t)[None]
        rotary = model.model.rotary_emb(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return hidden, head(out)


def _mtp_own(name: str) -> bool:
    return name.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head")


def _batch(start: int, end: int, num_blocks: int) -> ForwardBatch:
    """One row computing positions start..end-1 of a sequence in blocks 0..num_blocks-1."""
    positions = torch.arange(start, end)
    tables = block_table_tensor([list(range(num_blocks))], torch.device("cpu"))
    rows = torch.zeros(end - start, dtype=torch.int64)
    return ForwardBatch(
        token_ids=torch.zeros(end - start, dtype=torch.int64),  # unused: MTP reads next_tokens
        positions=positions,
        slot_mapping=slot_mapping_tensor(tables, rows, positions, BLOCK),
        block_tables=tables,
        context_lens=torch.tensor([end], dtype=torch.int32),
        query_start=torch.tensor([0, end - start], dtype=torch.int32),
        logits_indices=None,
        max_query_len=end - start,
        max_context_len=end,
        decode_only=end - start == 1,
    )


def test_mtp_layer_loads_only_when_asked(mtp_dir):
    folder, _ = mtp_dir
    source = resolve_model(str(folder))
    config, plain = load_model(source, torch.device("cpu"), torch.float32)
    assert config.num_mtp_layers == 1
    assert plain.mtp is None
    _, weights = load_model(source, torch.device("cpu"), torch.float32, mtp=True)
    assert weights.mtp is not None
    assert weights.mtp.layer.moe is not None and weights.mtp.layer.mla is not None
    assert weights.mtp.embed is weights.embed  # the checkpoint leaves its copy out


def test_mtp_layer_over_the_paged_cache_equals_transformers(mtp_dir):
    folder, tensors = mtp_dir
    hidden, expected = _reference(folder, tensors, PROMPT)
    config, weights = load_model(
        resolve_model(str(folder)), torch.device("cpu"), torch.float32, mtp=True
    )
    assert weights.mtp is not None
    model = LlamaModel(config, weights, CpuOps(native=None))
    assert_mtp_matches(model, weights.mtp, config, hidden, expected)


def assert_mtp_matches(model, mtp, config, hidden: torch.Tensor, expected: torch.Tensor) -> None:
    """The MTP layer over the paged cache, a chunk of the prompt and then one position a
    step, gives transformers' logits (`expected`) at every position (also the Qwen3-Next
    MTP test's check)."""
    num_blocks = (len(PROMPT) + BLOCK - 1) // BLOCK
    cache = MtpCache(KVCache(config, num_blocks, BLOCK, torch.float32, torch.device("cpu")))
    next_tokens = torch.tensor(PROMPT[1:])
    t, chunk = len(PROMPT) - 1, 9
    got = []
    with torch.inference_mode():
        logits, out = mtp_forward(
            model, mtp, hidden[:chunk], next_tokens[:chunk], _batch(0, chunk, num_blocks),
            cache,
        )  # fmt: skip
        assert out.shape == (chunk, config.hidden_size)
        got.append(logits)
        for p in range(chunk, t):  # then one position a step, reading the cached ones
            logits, _ = mtp_forward(
                model, mtp, hidden[p : p + 1], next_tokens[p : p + 1],
                _batch(p, p + 1, num_blocks), cache,
            )  # fmt: skip
            got.append(logits)
    got_all = torch.cat(got)
    assert got_all.shape == expected.shape
    torch.testing.assert_close(got_all, expected, atol=2e-4, rtol=1e-4)
    # The predictions are clear-cut and differ from position to position: not a trivial match.
    top2 = expected.topk(2).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3
    assert len(set(expected.argmax(-1).tolist())) > 3

"""`--kv-cache-dtype bfloat16` on the CPU: a worker with a bfloat16 KV cache serves greedy
rows (chunked prefill, staggered starts, decode) whose tokens equal the float32 worker's
(itself equal to transformers') wherever the float32 choice is not a near tie, for a plain Llama
(the one-call decode loop), a sliding window and latent attention (MLA); its layout names
the cache dtype, so no worker of another cache dtype restores its blocks; CUDA refuses a
cache dtype other than the model's at start-up."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.kv_cache import block_bytes, resolve_kv_dtype
from spillway.services.worker.quality import perplexity
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_families import packed_prefill_logits, save_tiny_family
from tests.unit.worker.tiny_llama import tiny_runner

PROMPTS = [[1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5], [1, 200], [1, 64, 65, 66, 67, 68, 9]]
NEW_TOKENS = 10
# A float32 top-1/top-2 logit gap under this is a near tie a bfloat16 cache may flip
# (its keys and values carry 8 significant bits: logits moved by up to ~1e-2 here).
NEAR_TIE = 0.05


@pytest.fixture(scope="module", params=["llama", "qwen2", "deepseek_v3"])
def family_dir(request, tmp_path_factory, tiny_llama_dir):
    if request.param == "llama":
        return tiny_llama_dir
    return save_tiny_family(tmp_path_factory.mktemp(request.param), request.param)


def test_greedy_rows_equal_float32s_but_at_near_ties(family_dir):
    # The float32 worker is the yardstick: its greedy rows equal transformers' on these
    # weights (test_worker_families, test_worker_model).
    exact = tiny_runner(family_dir)
    runner = tiny_runner(family_dir, kv_cache_dtype="bfloat16")
    assert all(k.dtype == torch.bfloat16 for k in runner.kv_cache.k)
    want = generate(exact, PROMPTS, NEW_TOKENS, chunk=4, start_steps=[0, 1, 3])
    got = generate(runner, PROMPTS, NEW_TOKENS, chunk=4, start_steps=[0, 1, 3])
    same = 0
    for prompt, tokens, expected in zip(PROMPTS, got, want, strict=True):
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), None
        )
        if first is None:
            same += 1
        else:  # they part only where float32's own choice was a near tie
            top = packed_prefill_logits(exact, [prompt + expected[:first]])[-1].topk(2).values
            assert float(top[0] - top[1]) < NEAR_TIE, (prompt, first)
    assert same >= 2, "too many near ties for the comparison to mean anything"


def test_layout_and_block_bytes_follow_the_cache_dtype(tiny_llama_dir):
    exact = tiny_runner(tiny_llama_dir)
    halved = tiny_runner(tiny_llama_dir, kv_cache_dtype="bfloat16")
    same = tiny_runner(tiny_llama_dir, kv_cache_dtype="float32")
    assert exact.kv_cache.dtype == same.kv_cache.dtype == torch.float32
    assert same.kv_layout == exact.kv_layout  # float32 named or auto: one layout
    assert "+kv-bfloat16" in halved.kv_layout and halved.kv_layout != exact.kv_layout
    config = exact.model.config
    assert 2 * block_bytes(config, 16, torch.bfloat16) == block_bytes(config, 16, torch.float32)
    assert halved.kv_cache.read_blocks([0]).dtype == torch.bfloat16


def test_perplexity_with_a_bf16_cache_is_close_to_float32s(tiny_llama_dir):
    text = [(37 * i + 11) % 256 for i in range(80)]
    exact = perplexity(tiny_runner(tiny_llama_dir).model, text)
    model = tiny_runner(tiny_llama_dir).model
    halved = perplexity(model, text, kv_dtype=torch.bfloat16)
    assert halved != exact and abs(halved / exact - 1) < 0.02, (exact, halved)


def test_the_cache_dtype_resolves_and_cuda_refuses_another_than_the_models():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.bfloat16, cpu) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="on cuda the KV cache is the model's dtype"):
        resolve_kv_dtype("float32", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="--kv-cache-dtype int4"):
        resolve_kv_dtype("int4", torch.float32, cpu)

"""A tiny Qwen3-MoE Hugging Face folder served through the whole system (`spillway up
--model DIR`): concurrent greedy requests give transformers' tokens, and /v1/models
names the folder."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from spillway.services.cli.launcher import System
from tests.e2e.greedy_http import complete_greedy, tokens_of
from tests.unit.worker.tiny_families import load_reference, reference_greedy, save_tiny_family

pytestmark = pytest.mark.slow

PROMPTS = [[1, 504, 3781, 282, 4649, 314], [1, 9906, 11, 2088, 31, 77, 4000, 12, 5, 6, 7, 8]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, reference_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    # seed 3: no near ties over this vocabulary (the test asserts the gaps)
    save_tiny_family(folder, "qwen3_moe", seed=3, vocab_size=len(reference_tokenizer))
    reference_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_system(nats_url, redis_url, moe_dir):
    s = System(
        "--model", str(moe_dir),
        "--namespace", "moe",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "64",
        "--block-size", "16",
        "--dtype", "float32",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.tail()


def _complete(url: str, prompt: list[int]) -> list[int]:
    return tokens_of(complete_greedy(url, prompt, NEW_TOKENS, timeout=60))


def test_concurrent_requests_equal_transformers(moe_system, moe_dir):
    reference = load_reference(moe_dir)
    want = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3
        want.append(tokens)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _complete(moe_system.url, p), PROMPTS))
    assert got == want
    with httpx.Client(base_url=moe_system.url, timeout=30) as c:
        models = c.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [moe_dir.name]

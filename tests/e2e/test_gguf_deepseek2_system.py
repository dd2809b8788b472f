"""A tiny deepseek2 GGUF file (DeepSeek-V3's latent attention and MoE, Q4_0, written as
llama.cpp's converter writes one) served through the whole system (`spillway up --model
FILE.gguf`): concurrent greedy requests give transformers' DeepseekV3 tokens on the
weights the file dequantizes to (transformers loads no deepseek2 file), and a text prompt
goes through the tokenizer converted from the file's keys."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from gguf.constants import GGMLQuantizationType

from spillway.services.cli.launcher import System
from tests.e2e.greedy_http import complete_greedy, tokens_of
from tests.gguf_deepseek2 import dequantized_reference, write_deepseek2_gguf
from tests.unit.worker.tiny_families import reference_greedy

PROMPTS = [[5, 17, 300, 42, 9, 77, 120, 33, 8], [1, 200], [250, 3, 3]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def ds2_file(tmp_path_factory):
    """(the file, transformers' greedy tokens for each prompt on its weights)."""
    folder = tmp_path_factory.mktemp("tiny-deepseek2-gguf")
    path, model = write_deepseek2_gguf(
        folder / "tiny-deepseek2.gguf", GGMLQuantizationType.Q4_0, split_kv_b=True
    )
    reference = dequantized_reference(path, model)
    want = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-4, gap
        want.append(tokens)
    return path, want


@pytest.fixture(scope="module")
def ds2_system(nats_url, redis_url, ds2_file):
    s = System(
        "--model", str(ds2_file[0]),
        "--namespace", "gguf-ds2",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "32",
        "--block-size", "16",
        "--dtype", "float32",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.tail()


def test_concurrent_requests_equal_transformers_on_the_file_s_weights(ds2_system, ds2_file):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        bodies = pool.map(lambda p: complete_greedy(ds2_system.url, p, NEW_TOKENS), PROMPTS)
        got = [tokens_of(b) for b in bodies]
    assert got == ds2_file[1]


def test_a_text_prompt_goes_through_the_file_s_tokenizer(ds2_system, ds2_file):
    from transformers import PreTrainedTokenizerFast

    path = ds2_file[0]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    body = complete_greedy(ds2_system.url, "hello world", NEW_TOKENS)
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("hello world"))
    assert body["usage"]["completion_tokens"] == NEW_TOKENS
    assert len(tokens_of(body)) == NEW_TOKENS

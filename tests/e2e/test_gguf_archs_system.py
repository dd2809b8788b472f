"""A tiny Qwen3-MoE GGUF file (Q4_0 projections, written as llama.cpp writes one) served
through the whole system (`spillway up --model FILE.gguf`): concurrent greedy requests give
the tokens transformers gives loading the same file, and a text prompt goes through the
tokenizer converted from the file's metadata."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from gguf.constants import GGMLQuantizationType

from spillway.services.cli.launcher import System
from tests.e2e.greedy_http import complete_greedy, tokens_of
from tests.gguf_files import write_tiny_gguf

PROMPTS = [[5, 17, 300, 42, 9, 77, 120, 33, 8], [1, 200], [250, 3, 3]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3moe-gguf")
    return write_tiny_gguf(folder / "tiny-qwen3moe.gguf", "qwen3moe", GGMLQuantizationType.Q4_0)


@pytest.fixture(scope="module")
def moe_system(nats_url, redis_url, moe_file):
    s = System(
        "--model", str(moe_file),
        "--namespace", "gguf-moe",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "32",
        "--block-size", "16",
        "--dtype", "float32",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.tail()


def _transformers_greedy(path) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            r = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
            gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in r.scores]
            assert min(gaps) > 1e-4, gaps
            out.append(r.sequences[0, len(prompt) :].tolist())
    return out


def test_concurrent_requests_equal_transformers_on_the_same_file(moe_system, moe_file):
    want = _transformers_greedy(moe_file)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        bodies = pool.map(lambda p: complete_greedy(moe_system.url, p, NEW_TOKENS), PROMPTS)
        got = [tokens_of(b) for b in bodies]
    assert got == want


def test_a_text_prompt_goes_through_the_file_s_tokenizer(moe_system, moe_file):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_file.parent, gguf_file=moe_file.name)
    body = complete_greedy(moe_system.url, "hello world", NEW_TOKENS)
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("hello world"))
    assert body["usage"]["completion_tokens"] == NEW_TOKENS
    assert len(tokens_of(body)) == NEW_TOKENS

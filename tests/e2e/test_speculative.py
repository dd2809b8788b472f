"""`spillway up --speculative ngram` end to end: concurrent greedy requests (some with
something to copy, some with a stop string or a max_tokens that lands inside a row's
drafts) come out exactly as transformers' greedy decoding of the same weights, and the
speculative decoding metrics show drafts accepted."""

from __future__ import annotations

import pytest
import torch

from spillway.services.cli.launcher import System
from tests.e2e import speculative_http as spec_http
from tests.e2e.greedy_http import greedy_body

pytestmark = pytest.mark.slow

REPEATS = "one two three four five six seven eight nine ten. " * 3
KEEP = slice(1000, 1024)


def _save_sharp_tiny_model(folder, tokenizer):
    """The tiny random Llama with SmolLM2's tokenizer, its weights spread wide so greedy
    choices are clear-cut (no near ties between a batched verify and a decode step), and
    only the ordinary tokens of KEEP ever chosen (the other rows of its output layer are
    zero): outputs repeat themselves, so lookups find drafts that stand."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(77)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        keep = model.lm_head.weight[KEEP].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[KEEP] = keep
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, reference_tokenizer):
    return _save_sharp_tiny_model(tmp_path_factory.mktemp("tiny-sharp"), reference_tokenizer)


@pytest.fixture(scope="module")
def spec_system(nats_url, redis_url, model_dir):
    s = System(
        "--model", str(model_dir),
        "--namespace", "spec",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "96",
        "--block-size", "16",
        "--dtype", "float32",
        "--speculative", "ngram",
        "--num-speculative-tokens", "4",
        # Drafts that do not depend on how busy the machine is (the cost is not measured).
        env={"SPILLWAY_SPEC_DRAFT_COST": "0.1"},
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.tail()


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """transformers' greedy tokens and the smallest gap between the top two logits."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    gaps = [float(torch.topk(step[0], 2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), min(gaps)


def test_concurrent_greedy_requests_equal_transformers(spec_system, model_dir, reference_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = reference_tokenizer
    texts = [REPEATS, "def add(a, b):\n    return a + b\n" * 2, "Hello there", REPEATS[:60]]
    prompts = [tok(t).input_ids for t in texts]
    lengths = [64, 37, 23, 50]  # max_tokens: some land inside a row's drafts
    wants = spec_http.clear_greedy(_greedy, model, prompts, lengths)
    # A stop string taken from the middle of the first output: the text ends before it.
    first_text = tok.decode(wants[0], skip_special_tokens=True)
    stop = first_text[len(first_text) // 2 : len(first_text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    bodies = [greedy_body(p, n) for p, n in zip(prompts, lengths, strict=True)]
    bodies.append(spec_http.stop_body(prompts[0], 64, stop))
    replies, metrics = spec_http.post_checked(spec_system.url, bodies, wants, first_text, stop)
    for r, want in zip(replies, wants, strict=False):
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == len(want)

    drafted, accepted = spec_http.drafted_and_accepted(metrics)
    per_position = 'spillway_spec_decode_accepted_tokens_per_position_total{position="0",'
    first = spec_http.metric_total(metrics, per_position)
    assert drafted > 0 and 0 < accepted <= drafted
    assert first > 0

"""`spillway up --speculative mtp` end to end: a tiny DeepSeek-V3 with SmolLM2's tokenizer
and an MTP layer that predicts it; concurrent greedy requests come out exactly as
transformers' greedy decoding of the same weights (one cut by a stop string), and the
metrics show drafts accepted."""

from __future__ import annotations

import pytest

from spillway.services.cli.launcher import System
from tests.e2e import speculative_http as spec_http
from tests.e2e.greedy_http import greedy_body
from tests.unit.worker.tiny_families import load_reference, reference_greedy
from tests.unit.worker.tiny_mtp import save_tiny_deepseek_mtp

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, reference_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-mtp")
    save_tiny_deepseek_mtp(folder, predictive=True, vocab_size=len(reference_tokenizer))
    reference_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mtp_system(nats_url, redis_url, model_dir):
    s = System(
        "--model", str(model_dir),
        "--namespace", "mtp",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "64",
        "--block-size", "16",
        "--dtype", "float32",
        "--speculative", "mtp",
        "--num-speculative-tokens", "2",
        env={"SPILLWAY_SPEC_DRAFT_COST": "0.1"},
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.tail()


def test_greedy_requests_equal_transformers_with_mtp_drafts(
    mtp_system, model_dir, reference_tokenizer
):
    model = load_reference(model_dir)
    prompts = [reference_tokenizer(t).input_ids for t in ("Hello there", "one two three four")]
    lengths = [24, 31]
    wants = spec_http.clear_greedy(reference_greedy, model, prompts, lengths)
    bodies = [greedy_body(p, n) for p, n in zip(prompts, lengths, strict=True)]
    # A stop string from the middle of the second output: the text ends before it, though
    # the row that produced it may have verified drafts past it.
    text = reference_tokenizer.decode(wants[1], skip_special_tokens=True)
    stop = next(
        text[i : i + 3] for i in range(len(text) // 2, len(text)) if text[i : i + 3].strip()
    )
    bodies.append(spec_http.stop_body(prompts[1], lengths[1], stop))
    _, metrics = spec_http.post_checked(mtp_system.url, bodies, wants, text, stop)
    drafted, accepted = spec_http.drafted_and_accepted(metrics)
    assert drafted > 0 and 0 < accepted <= drafted

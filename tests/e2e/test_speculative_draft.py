"""`spillway up --speculative draft --draft-model MODEL` end to end, the model as its own
draft: concurrent greedy requests come out exactly as transformers' greedy decoding of
the same weights (one cut by a stop string), and every draft stands."""

from __future__ import annotations

import pytest

from spillway.services.cli.launcher import System
from tests.e2e import speculative_http as spec_http
from tests.e2e.greedy_http import greedy_body
from tests.e2e.test_speculative import REPEATS, _greedy, _save_sharp_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, reference_tokenizer):
    return _save_sharp_tiny_model(tmp_path_factory.mktemp("tiny-draft"), reference_tokenizer)


@pytest.fixture(scope="module")
def draft_system(nats_url, redis_url, model_dir):
    s = System(
        "--model", str(model_dir),
        "--namespace", "draft",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "64",
        "--block-size", "16",
        "--dtype", "float32",
        "--speculative", "draft",
        "--draft-model", str(model_dir),
        "--num-speculative-tokens", "3",
        env={"SPILLWAY_SPEC_DRAFT_COST": "0.1"},
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.tail()


def test_the_model_as_its_own_draft_end_to_end(draft_system, model_dir, reference_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [reference_tokenizer(t).input_ids for t in (REPEATS, "Hello there")]
    lengths = [40, 27]
    wants = spec_http.clear_greedy(_greedy, model, prompts, lengths)
    bodies = [greedy_body(p, n) for p, n in zip(prompts, lengths, strict=True)]
    # A stop string from the middle of the first output: the text ends before it, though
    # the row that produced it may have verified drafts past it.
    first_text = reference_tokenizer.decode(wants[0], skip_special_tokens=True)
    stop = first_text[len(first_text) // 2 : len(first_text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    bodies.append(spec_http.stop_body(prompts[0], 40, stop))
    _, metrics = spec_http.post_checked(draft_system.url, bodies, wants, first_text, stop)
    drafted, accepted = spec_http.drafted_and_accepted(metrics)
    assert drafted > 0 and accepted == drafted

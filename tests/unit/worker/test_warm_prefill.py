"""The start-up's dummy prefill (services/worker/warm_prefill.py): it runs through the whole
runner and leaves nothing behind: no sequence, no step counted, and the KV blocks it wrote
change no later generation."""

from __future__ import annotations

import random

import pytest

from spillway.services.worker import loading
from spillway.services.worker.warm_prefill import PROMPT_TOKENS, warm_prefill
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_llama import TINY_VOCAB, tiny_runner

PROMPTS = [[random.Random(s).randrange(3, TINY_VOCAB) for _ in range(9 + 13 * s)] for s in range(4)]


@pytest.fixture(scope="module")
def cold(tiny_llama_dir):
    """A runner loaded without the dummy prefill."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "warm_prefill", lambda *args: False)
        return tiny_runner(tiny_llama_dir, kv_blocks=16)


def test_the_dummy_prefill_runs_and_leaves_no_sequence_or_step(cold):
    before = generate(cold, PROMPTS, 12)
    assert warm_prefill(cold, TINY_VOCAB, PROMPT_TOKENS)
    assert cold.sequences == {} and cold.last_token == {} and cold.num_steps == 0
    # Its KV blocks (0..7 of 16) are among those the generation below takes, in another order.
    assert generate(cold, PROMPTS, 12, shuffle_seed=3) == before


def test_the_worker_start_runs_it_and_generates_as_without(tiny_llama_dir, cold, caplog):
    with caplog.at_level("INFO", logger="spillway.services.worker.warm_prefill"):
        warmed = tiny_runner(tiny_llama_dir, kv_blocks=16)
    assert any("dummy" in r.getMessage() for r in caplog.records)
    assert warmed.sequences == {} and warmed.num_steps == 0
    assert generate(warmed, PROMPTS, 12) == generate(cold, PROMPTS, 12)


def test_it_is_left_out_where_the_cache_cannot_hold_it(tiny_llama_dir):
    small = tiny_runner(tiny_llama_dir, kv_blocks=4)  # 4 blocks of 16 < 128 tokens
    assert not warm_prefill(small, TINY_VOCAB, PROMPT_TOKENS)
    assert not warm_prefill(small, TINY_VOCAB, 0)

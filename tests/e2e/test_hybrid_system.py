"""Tiny hybrid models (Granite 4.0-H: Mamba2 + attention + MoE; Qwen3-Next: gated DeltaNet +
gated attention + MoE) served through the whole system: concurrent greedy requests of
mixed lengths, their prompts in several chunks, with fewer state slots and KV blocks than
they want at once, give transformers' tokens; a prompt sharing another's first blocks
resumes from its state snapshot (cached_tokens says so) with the same tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from spillway.services.cli.launcher import System
from tests.e2e.pressure import generate
from tests.unit.worker.tiny_families import load_reference, reference_greedy, save_tiny_family

pytestmark = pytest.mark.slow

PROMPTS = [
    [1, 504, 3781, 282, 4649, 314],
    [1, 9906, 11, 2088, 31, 77, 4000, 12, 5, 6, 7, 8, 901, 17, 3300, 45, 6, 71, 19, 28, 9],
    [1, 77, 88, 99, 1200, 1300, 1400, 15, 16, 17, 18, 19, 20, 21],
    [1, 42],
]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["granitemoehybrid", "qwen3_next"])
def hybrid_dir(request, tmp_path_factory, reference_tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_family(folder, request.param, seed=1, vocab_size=len(reference_tokenizer))
    reference_tokenizer.save_pretrained(folder)
    return folder


def test_concurrent_chunked_requests_equal_transformers(hybrid_dir, nats_url, redis_url):
    reference = load_reference(hybrid_dir)
    follower = [*PROMPTS[1][:13], 4000, 17]  # PROMPTS[1]'s first three blocks, then its own
    want = []
    for prompt in [*PROMPTS, follower]:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3
        want.append(tokens)
    s = System(
        "--model", str(hybrid_dir),
        "--namespace", f"hy-{hybrid_dir.name}",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "10",
        "--block-size", "4",
        "--state-slots", "3",
        "--state-snapshots", "16",
        "--dtype", "float32",
        env={"SPILLWAY_MAX_NUM_BATCHED_TOKENS": "16"},  # prompts in chunks
    )  # fmt: skip
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: generate(s.url, p, NEW_TOKENS), PROMPTS))
        generate(s.url, PROMPTS[1], NEW_TOKENS)  # its blocks cached last
        hit = generate(s.url, follower, NEW_TOKENS)
    finally:
        assert s.stop() == 0, s.tail()
    assert [g.tokens for g in got] == want[:-1]
    assert hit.tokens == want[-1] and hit.cached_tokens == 12

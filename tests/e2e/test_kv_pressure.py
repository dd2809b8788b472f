"""KV pressure end to end, on a worker with 40 blocks of 16 tokens: every preemption mode,
run-ahead on and off, the prefix cache and its shared tier, and Redis going away in the
middle of a spill-mode run. Generations are held token by token against the same requests
on a worker with ample blocks (the session's `system`)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from spillway.services.cli.launcher import ServiceGroup, wait_until
from spillway.services.cli.servers import start_redis
from tests.e2e.pressure import (
    assert_same_greedy,
    generate,
    generate_all,
    health,
    metrics,
    scheduler,
    settled,
    wait_for_metric,
)

pytestmark = pytest.mark.slow

NEW_TOKENS = 128
KV_BLOCKS = "40"
# Each mode runs this many of the prompts: about 9 blocks each at the end, nearly twice
# what the 40 blocks hold (the Redis outage below runs all of them, to outlast the outage).
MODE_REQUESTS = 8
SUBJECTS = [
    "a lighthouse keeper", "a robot chef", "two rival bakers", "a lost kitten",
    "a sailor in a storm", "a village under snow", "a clockmaker", "a dragon who counts",
    "a desert caravan", "a librarian at night", "a moon base", "a stubborn mule",
]  # fmt: skip
# Each test runs its own schedulers in turn against the one worker, which joins the next
# once the last one's lease has lapsed: after 2 s of silence rather than the default 5.
WORKER_ENV = {"SPILLWAY_SCHEDULER_TIMEOUT_S": "2"}


@pytest.fixture(scope="module")
def prompts(reference_tokenizer) -> list[list[int]]:
    return [reference_tokenizer(f"Tell a long story about {s}.").input_ids for s in SUBJECTS]


@pytest.fixture(scope="module")
def ample(system, prompts):
    """The same requests on a worker whose cache holds them all (no preemption)."""
    return generate_all(system.url, prompts, NEW_TOKENS)


def _group(nats_url: str, redis_url: str, namespace: str) -> ServiceGroup:
    group = ServiceGroup("--nats-url", nats_url, "--redis-url", redis_url, "--namespace", namespace)
    group.launch("spillstore")
    group.launch("worker", "--kv-blocks", KV_BLOCKS, "--block-size", "16", env=WORKER_ENV)
    group.launch("gateway", "--port", "0")
    group.wait_ready()
    return group


@pytest.fixture(scope="module")
def store():
    """The group's own Redis (the last test stops it mid-run and starts it again on its
    port): a one-item list holding the server running now."""
    servers = [start_redis()]
    yield servers
    servers[0].stop()


@pytest.fixture(scope="module")
def pressure(nats_url, store):
    group = _group(nats_url, store[0].url, "kvp")
    yield group
    group.stop_all()


@pytest.mark.parametrize(
    ("mode", "options"),
    # Run-ahead on (the default) and off: outputs must not change either way.
    [
        ("spill", []),
        ("recompute", ["--no-run-ahead"]),
        ("auto", []),
    ],
    ids=["spill", "recompute-lockstep", "auto"],
)
def test_every_request_completes_exactly_under_kv_pressure(pressure, ample, prompts, mode, options):
    # A fresh scheduler per mode: its counters start at zero.
    with scheduler(pressure, "--preemption-mode", mode, *options):
        runs = generate_all(pressure.url, prompts[:MODE_REQUESTS], NEW_TOKENS)
        after = settled(pressure.url)
    ties = 0
    for i, (got, want) in enumerate(zip(runs, ample[:MODE_REQUESTS], strict=True)):
        assert got.finish_reason == "length"
        ties += assert_same_greedy(got, want, f"{mode} prompt {i}")
    assert ties <= 2, "more near ties than chance allows"
    preempted = {
        m: after[f'spillway_preemptions_total{{mode="{m}"}}'] for m in ("spill", "recompute")
    }
    if mode == "spill":
        assert preempted["spill"] > 0 and preempted["recompute"] == 0
    elif mode == "recompute":
        assert preempted["recompute"] > 0 and preempted["spill"] == 0
    else:
        assert preempted["spill"] + preempted["recompute"] > 0
    # No block leaked, nothing left in the spill store (settled() waited for both).
    assert after["spillway_kv_cache_usage_ratio"] == 0
    assert after["spillway_spill_store_used_bytes"] == 0
    assert after["spillway_spill_store_sequences"] == 0


def _shared_prefix_prompts(tokenizer) -> tuple[list[int], list[list[int]]]:
    text = "the river runs past old mills and quiet farms toward a wide grey sea. " * 40
    shared = tokenizer(text).input_ids[:300]
    tails = [tokenizer(f" Question {i}: what comes next?").input_ids for i in range(8)]
    return shared, [shared + t for t in tails]


def test_prefix_cache_skips_the_shared_prefill_and_the_shared_tier_serves_a_new_worker(
    pressure, reference_tokenizer
):
    shared, prompts = _shared_prefix_prompts(reference_tokenizer)
    with scheduler(pressure, "--no-prefix-cache"):
        uncached = [generate(pressure.url, p, 16) for p in prompts]
    assert all(g.cached_tokens == 0 for g in uncached)
    with scheduler(pressure):  # fresh: its counters start at zero
        first = generate(pressure.url, prompts[0], 16)
        rest = generate_all(pressure.url, prompts[1:], 16)
        after = settled(pressure.url)
    assert first.cached_tokens == 0
    for g in rest:
        assert g.cached_tokens >= 0.8 * len(shared)
    for i, (got, want) in enumerate(zip([first, *rest], uncached, strict=True)):
        assert_same_greedy(got, want, f"prefix prompt {i}")
    assert after["spillway_prefix_cache_hits_total"] == sum(g.cached_tokens for g in rest)
    assert after["spillway_prefix_cache_queries_total"] == sum(len(p) for p in prompts)
    assert after["spillway_prefix_tier_blocks"] >= len(shared) // 16

    # A freshly started worker has an empty cache: the shared tier fills the prefix.
    pressure.stop("worker")
    pressure.start("worker", "--kv-blocks", KV_BLOCKS, "--block-size", "16", env=WORKER_ENV)
    with scheduler(pressure):
        again = generate(pressure.url, prompts[3], 16)
    assert again.cached_tokens >= 0.8 * len(shared)
    assert_same_greedy(again, uncached[3], "tier prompt 3")


def test_redis_stopping_mid_spill_loses_no_request_and_spilling_resumes(
    pressure, store, prompts, ample
):
    """Last in this file: it stops the group's Redis (the other tests' spill store)."""
    port = int(store[0].url.rsplit(":", 1)[1].split("/")[0])
    with scheduler(pressure, "--preemption-mode", "spill"):
        url = pressure.url
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(generate, url, p, NEW_TOKENS) for p in prompts]
            wait_for_metric(url, 'spillway_preemptions_total{mode="spill"}', 1)
            wait_for_metric(url, "spillway_spill_store_sequences", 1)
            store[0].stop()  # the spilled sequences' data is gone with it
            assert wait_until(lambda: health(url)["spill"]["status"] == "degraded", 30)
            assert health(url)["status"] == "ok"
            recomputed = wait_for_metric(url, 'spillway_preemptions_total{mode="recompute"}', 1)
            spilled_while_down = metrics(url)['spillway_preemptions_total{mode="spill"}']
            store[0] = start_redis(port=port)
            runs = [f.result(timeout=900) for f in futures]
        for i, (got, want) in enumerate(zip(runs, ample, strict=True)):
            assert got.finish_reason == "length"
            assert_same_greedy(got, want, f"redis-outage prompt {i}")
        assert recomputed >= 1
        # Redis is back: new victims are spilled again.
        assert wait_until(lambda: health(url)["spill"]["status"] == "ok", 30)
        generate_all(url, prompts[:8], 96)
        assert metrics(url)['spillway_preemptions_total{mode="spill"}'] > spilled_while_down
        settled(url)

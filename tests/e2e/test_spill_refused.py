"""A Redis that answers and refuses every write (at its maxmemory, noeviction), under KV
pressure in spill mode: /health says spilling is degraded and why, every request still
completes (recomputed), the metrics count each refused spill as a failure and its
preemption as a recompute, and no log line holds the KV bytes of a refused write."""

from __future__ import annotations

import concurrent.futures as cf
import re

import httpx
import pytest
import redis

from spillway.services.cli.launcher import ServiceGroup, wait_until
from spillway.services.cli.servers import start_redis
from tests.e2e.pressure import health, metrics

pytestmark = pytest.mark.slow

NUM_REQUESTS = 8
NEW_TOKENS = 120  # 8 of these outgrow 24 blocks of 16 tokens: victims every few steps
DEGRADED_WITHIN_S = 5.0
# Bytes in a log line: a control character, or repr's escapes several in a row.
BINARY = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufffd]|(?:\\x[0-9a-fA-F]{2}){8,}")


@pytest.fixture(scope="module")
def full_redis():
    server = start_redis()
    client = redis.Redis.from_url(server.url)
    # Above its maxmemory from the start: PING answers, every write is refused.
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    client.close()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def refused(tiny_model_dir, nats_url, full_redis):
    group = ServiceGroup(
        "--model", str(tiny_model_dir),
        "--namespace", "refused",
        "--nats-url", nats_url,
        "--redis-url", full_redis.url,
        "--dtype", "float32",
        "--threads", "1",
        "--block-size", "16",
    )  # fmt: skip
    try:
        group.start("spillstore")
        group.start("worker", "--kv-blocks", "24")
        group.start("scheduler", "--preemption-mode", "spill")
        group.start("gateway", "--port", "0")
        yield group
    finally:
        group.stop_all()


def _complete(url: str, i: int) -> str:
    body = {"prompt": f"story {i} of many", "max_tokens": NEW_TOKENS, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["finish_reason"]


def test_refused_writes_degrade_health_count_as_failed_spills_and_log_no_bytes(refused):
    url = refused.url
    assert wait_until(lambda: health(url)["spill"]["status"] == "degraded", DEGRADED_WITHIN_S)
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"  # it still serves
    assert "maxmemory" in r.json()["spill"]["reason"], r.json()

    with cf.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        finishes = list(pool.map(lambda i: _complete(url, i), range(NUM_REQUESTS)))
    assert finishes == ["length"] * NUM_REQUESTS

    m = metrics(url)
    failed = m["spillway_spill_failures_total"]
    assert failed >= 1, m  # Redis answers PING: the policy tried, and each try failed
    assert m['spillway_preemptions_total{mode="spill"}'] == 0
    assert m['spillway_preemptions_total{mode="recompute"}'] >= failed
    assert m["spillway_swap_ins_total"] == 0 and m["spillway_requests_swapped"] == 0
    assert m["spillway_spill_store_up"] == 1 and m["spillway_spill_store_writable"] == 0
    assert health(url)["spill"]["status"] == "degraded"

    text = refused.tail(100_000)
    refusals = [line for line in text.splitlines() if "spilling" in line and "failed" in line]
    assert any("maxmemory" in line for line in refusals), text[-3000:]
    assert not [line for line in text.splitlines() if BINARY.search(line)]

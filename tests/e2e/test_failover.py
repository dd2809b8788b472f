"""A standby worker takes over: two workers registered with one scheduler (it drives one,
the other waits), the driven one killed mid-run. Every request in flight completes on the
other worker, recomputed from its prompt and the tokens it had, with the tokens of an
undisturbed run (near ties aside), and /metrics counts the migrations."""

from __future__ import annotations

import concurrent.futures as cf
import signal

import pytest

from services.cli.launcher import ServiceGroup, wait_until
from tests.e2e.pressure import assert_same_greedy, generate, generate_all, health, metrics

pytestmark = pytest.mark.slow

NEW_TOKENS = 1200  # long enough to be in flight when the worker dies
PROMPTS = [[(11 * i + 7 * j) % 900 + 20 for j in range(8 + 5 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def standby(long_tiny_model_dir, nats_url, redis_url):
    group = ServiceGroup(
        "--model", str(long_tiny_model_dir),
        "--namespace", "failover",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "600",
        "--block-size", "32",
        "--max-batch", "8",
        "--dtype", "float32",
    )  # fmt: skip
    try:
        group.start("spillstore")
        group.start("scheduler")
        group.start("worker", name="worker-a")
        group.start("worker", name="worker-b")
        group.start("gateway", "--port", "0")
        assert wait_until(lambda: health(group.url).get("status") == "ok", 60), group.tail()
        yield group
    finally:
        group.stop_all()


def test_the_driven_worker_killed_its_requests_finish_on_the_standby(standby):
    url = standby.url
    want = generate_all(url, PROMPTS, NEW_TOKENS)
    driven = health(url)["schedulers"][0]["worker"]
    victim = next(
        name for name, child in standby.children.items() if f"id={driven} " in child.ready_detail
    )
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(generate, url, p, NEW_TOKENS) for p in PROMPTS]
        assert wait_until(lambda: health(url)["running"] == len(PROMPTS), 30)
        standby.children[victim].proc.send_signal(signal.SIGKILL)
        got = [f.result(timeout=300) for f in futures]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.finish_reason == "length"
        assert_same_greedy(g, w, f"prompt {i} after the takeover")
    assert not any(f.done() and f.exception() for f in futures)
    now = health(url)
    assert now["status"] == "ok" and now["schedulers"][0]["worker"] != driven
    assert metrics(url)["spillway_migrations_total"] >= len(PROMPTS)
    assert f"worker {driven} missed its heartbeats: dropped" in standby.tail(10_000)

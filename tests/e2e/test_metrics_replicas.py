"""/metrics of a deployment with two schedulers (each with a worker) behind one gateway:
every scheduler-side series carries a `scheduler` label, both schedulers are there, the
sums over the label are what the requests sent, and a scheduler that stops drops out."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from spillway.services.cli.launcher import ServiceGroup, wait_until

pytestmark = pytest.mark.slow

MAX_REQUESTS = 40  # routing among equals is random: both get some long before this
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def two_schedulers(tiny_model_dir, nats_url, redis_url):
    group = ServiceGroup(
        "--model", str(tiny_model_dir),
        "--namespace", "metricsrep",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "64",
        "--block-size", "32",
        "--dtype", "float32",
        "--threads", "1",
    )  # fmt: skip
    try:
        # The stopped scheduler's series leave once the gateway gives its lease up: after
        # 2 s of silence rather than the default 5.
        group.launch("gateway", "--port", "0", env={"SPILLWAY_SCHEDULER_TIMEOUT_S": "2"})
        # One at a time: a worker joins the scheduler that drives none yet.
        for n, side in enumerate("ab", start=1):
            group.start("scheduler", name=f"scheduler-{side}")
            group.start("worker", name=f"worker-{side}")
            assert wait_until(lambda n=n: _serving(group.url) == n, 60), group.tail()
        yield group
    finally:
        group.stop_all()


def _serving(url: str) -> int:
    try:
        body = httpx.get(f"{url}/health", timeout=10).json()
    except httpx.HTTPError:
        return 0
    return sum(1 for s in body.get("schedulers", []) if s["workers"])


def _by_scheduler(url: str, name: str) -> dict[str, float]:
    """One series' samples by their `scheduler` label (other labels summed over)."""
    out: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                sid = sample.labels["scheduler"]
                out[sid] = out.get(sid, 0.0) + sample.value
    return out


def _gateway_value(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def test_metrics_cover_both_schedulers_and_sum_to_what_was_sent(two_schedulers):
    url = two_schedulers.url
    queries = "spillway_prefix_cache_queries_total"
    prompt_tokens, sent = 0, 0
    with httpx.Client(base_url=url, timeout=60) as client:
        # Short distinct prompts (no remembered prefix): each goes to the least busy, a
        # random one of the two while both are idle.
        while sent < MAX_REQUESTS:
            body = {"prompt": f"count {sent} sheep", "max_tokens": NEW_TOKENS, "ignore_eos": True}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
            sent += 1
            if sent >= 4 and len([v for v in _by_scheduler(url, queries).values() if v]) == 2:
                break
    seen = _by_scheduler(url, queries)
    assert len(seen) == 2 and all(seen.values()), seen
    # The scheduler-side counters, summed over the label, are the deployment's figures.
    assert sum(seen.values()) == prompt_tokens
    steps = _by_scheduler(url, "spillway_worker_steps_total")
    assert steps.keys() == seen.keys() and all(steps.values()), steps
    assert sum(_by_scheduler(url, "spillway_requests_running").values()) == 0
    assert set(_by_scheduler(url, "spillway_scheduler_up").values()) == {1.0}
    # Gateway-side series stay unlabelled: one gateway measured every request.
    assert _gateway_value(url, "spillway_prompt_tokens_total") == prompt_tokens
    assert _gateway_value(url, "spillway_generation_tokens_total") == sent * NEW_TOKENS
    assert _gateway_value(url, "spillway_requests_finished_total") == sent

    # A scheduler that stops drops out of /metrics; the other stays.
    gone = next(iter(sorted(seen)))
    for name, child in list(two_schedulers.children.items()):
        if name.startswith("scheduler") and child.ready_detail.split()[0] == f"id={gone}":
            assert two_schedulers.stop(name) == 0, two_schedulers.tail()
    assert wait_until(lambda: gone not in _by_scheduler(url, queries), 30)
    assert set(_by_scheduler(url, queries)) == set(seen) - {gone}

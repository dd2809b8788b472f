"""The HTTP side of the speculative decoding system tests: concurrent completions, the
token ids they streamed, and the speculation counters of /metrics."""

from __future__ import annotations

import concurrent.futures as cf

import httpx

from tests.e2e.greedy_http import tokens_of


def post_all(url: str, bodies: list[dict]) -> tuple[list[httpx.Response], str]:
    """Every body sent at once to /v1/completions; the replies, then /metrics after them."""
    with httpx.Client(base_url=url, timeout=120) as c:
        with cf.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: c.post("/v1/completions", json=b), bodies))
        return replies, c.get("/metrics").text


def token_ids(reply: httpx.Response) -> list[int]:
    return tokens_of(reply.json())


def metric_total(metrics: str, prefix: str) -> float:
    """The sum of every series whose line starts with `prefix` (all schedulers)."""
    lines = metrics.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(prefix))

"""The HTTP side of the speculative decoding system tests: concurrent completions, the
token ids they streamed, and the speculation counters of /metrics."""

from __future__ import annotations

import concurrent.futures as cf

import httpx


def greedy_body(prompt: list[int], max_tokens: int) -> dict:
    """A greedy completion that returns its tokens as ids (in its logprobs)."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip


def post_all(url: str, bodies: list[dict]) -> tuple[list[httpx.Response], str]:
    """Every body sent at once to /v1/completions; the replies, then /metrics after them."""
    with httpx.Client(base_url=url, timeout=120) as c:
        with cf.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: c.post("/v1/completions", json=b), bodies))
        return replies, c.get("/metrics").text


def token_ids(reply: httpx.Response) -> list[int]:
    choice = reply.json()["choices"][0]
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def metric_total(metrics: str, prefix: str) -> float:
    """The sum of every series whose line starts with `prefix` (all schedulers)."""
    lines = metrics.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(prefix))

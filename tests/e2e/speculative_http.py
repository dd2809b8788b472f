"""The HTTP side of the speculative decoding system tests: what transformers' greedy
decoding wants, concurrent completions (one cut by a stop string), the token ids they
streamed, and the speculation counters of /metrics."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

import httpx

from tests.e2e.greedy_http import tokens_of


def clear_greedy(
    greedy: Callable[[object, list[int], int], tuple[list[int], float]],
    model: object,
    prompts: list[list[int]],
    lengths: list[int],
) -> list[list[int]]:
    """`greedy(model, prompt, n)`'s tokens for each prompt and length: every choice clear
    of a near tie, so that the system's output must equal them token for token."""
    wants = []
    for prompt, n in zip(prompts, lengths, strict=True):
        want, gap = greedy(model, prompt, n)
        assert gap > 1e-3, "the tiny model's greedy choice is a near tie"
        wants.append(want)
    return wants


def stop_body(prompt: list[int], max_tokens: int, stop: str) -> dict:
    """A greedy completion that `stop` ends."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stop": [stop]}  # fmt: skip


def post_checked(
    url: str, bodies: list[dict], wants: list[list[int]], text: str, stop: str
) -> tuple[list[httpx.Response], str]:
    """`post_all`, every reply a success: the greedy ones their `wants` token for token,
    the last (a `stop_body`) ended at `stop`, its text `text` up to it."""
    replies, metrics = post_all(url, bodies)
    for r in replies:
        assert r.status_code == 200, r.text
    for r, want in zip(replies, wants, strict=False):
        assert token_ids(r) == want
    stopped = replies[-1].json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == text[: text.index(stop)]
    return replies, metrics


def post_all(url: str, bodies: list[dict]) -> tuple[list[httpx.Response], str]:
    """Every body sent at once to /v1/completions; the replies, then /metrics after them."""
    with httpx.Client(base_url=url, timeout=120) as c:
        with cf.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: c.post("/v1/completions", json=b), bodies))
        return replies, c.get("/metrics").text


def token_ids(reply: httpx.Response) -> list[int]:
    return tokens_of(reply.json())


def drafted_and_accepted(metrics: str) -> tuple[float, float]:
    """The draft tokens verified and accepted, over every scheduler."""
    drafted = metric_total(metrics, "spillway_spec_decode_draft_tokens_total{")
    return drafted, metric_total(metrics, "spillway_spec_decode_accepted_tokens_total{")


def metric_total(metrics: str, prefix: str) -> float:
    """The sum of every series whose line starts with `prefix` (all schedulers)."""
    lines = metrics.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(prefix))

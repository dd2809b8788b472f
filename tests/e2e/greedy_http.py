"""Greedy completions over HTTP that return their tokens as ids (in their logprobs), so
that a system's output can be held token for token against another run's."""

from __future__ import annotations

import httpx


def greedy_body(prompt: list[int] | str, max_tokens: int) -> dict:
    """A greedy completion that returns its tokens as ids (in its logprobs)."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip


def tokens_of(body: dict) -> list[int]:
    """The token ids of a completion made with `greedy_body` (its first choice)."""
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def complete_greedy(
    url: str, prompt: list[int] | str, max_tokens: int, timeout: float = 120
) -> dict:
    """The body of one `greedy_body` completion at `url`, which must succeed."""
    with httpx.Client(base_url=url, timeout=timeout) as c:
        r = c.post("/v1/completions", json=greedy_body(prompt, max_tokens))
    assert r.status_code == 200, r.text
    return r.json()

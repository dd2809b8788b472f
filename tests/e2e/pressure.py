"""Helpers for the KV-pressure tests: a system started service by service (so the
scheduler can be restarted with other options against the same worker), concurrent greedy
generations with their top-2 logprob gaps, and comparison that tolerates only near ties."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from spillway.services.cli.launcher import ServiceGroup, System, wait_until

TIE_MARGIN = 1e-3
# Every scheduler in these tests checks its block manager's invariants after every tick.
DEBUG_ENV = {"SPILLWAY_DEBUG_INVARIANTS": "1"}


@dataclass
class Generation:
    tokens: list[int]
    gaps: list[float]  # per position: the gap between the two most likely tokens' logprobs
    finish_reason: str
    cached_tokens: int


def _greedy(prompt: list[int], max_tokens: int) -> dict:
    """A greedy completion with its top-2 logprobs (to tell near ties)."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
    }


def generate(url: str, prompt: list[int], max_tokens: int, timeout: float = 600) -> Generation:
    r = httpx.post(f"{url}/v1/completions", json=_greedy(prompt, max_tokens), timeout=timeout)
    assert r.status_code == 200, r.text
    body = r.json()
    logprobs = body["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    gaps = [_gap(top) for top in logprobs["top_logprobs"]]
    return Generation(
        tokens,
        gaps,
        body["choices"][0]["finish_reason"],
        body["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def stream_generate(
    url: str, prompt: list[int], max_tokens: int, timeout: float = 600
) -> Generation:
    """The same request streamed: tokens as the chunks bring them (a gap or a repeat
    shows as a different sequence)."""
    body = {
        **_greedy(prompt, max_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens: list[int] = []
    gaps: list[float] = []
    finish, cached = "", 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk["choices"]:
                logprobs = choice.get("logprobs") or {}
                tokens += [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens", [])]
                gaps += [_gap(top) for top in logprobs.get("top_logprobs", [])]
                finish = choice.get("finish_reason") or finish
    return Generation(tokens, gaps, finish, cached)


def _gap(top: dict[str, float]) -> float:
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def generate_all(url: str, prompts: list[list[int]], max_tokens: int) -> list[Generation]:
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate(url, p, max_tokens), prompts))


def assert_same_greedy(got: Generation, want: Generation, label: str) -> int:
    """Token by token; a difference is accepted only where either run's top two tokens
    were a near tie (then the continuations legitimately part). Returns 1 for a tie."""
    assert len(got.tokens) == len(want.tokens), label
    for i, (g, w) in enumerate(zip(got.tokens, want.tokens, strict=True)):
        if g == w:
            continue
        gap = min(got.gaps[i], want.gaps[i])
        assert gap < TIE_MARGIN, f"{label}: differs at {i}: {g} != {w} (top-2 gap {gap:.2e})"
        print(f"\nnear tie accepted: {label} at step {i}, top-2 gap {gap:.2e}")
        return 1
    return 0


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name with its labels: `name{a="b"}` -> value, summed
    over the `scheduler` label (the deployment's figure, as sum() gives it)."""
    out: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "scheduler"
            )
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            out[key] = out.get(key, 0.0) + sample.value
    return out


def settled_metrics(
    url: str, prefix: str, quiet_s: float = 0.5, within_s: float = 30
) -> dict[str, float]:
    """/metrics once the samples whose names start with `prefix` stopped moving for
    `quiet_s`: a reply can reach the client before the step that produced it is counted
    (the worker's report and the scheduler's stats are separate messages), so a count read
    right after a request may still grow."""
    last = metrics(url)
    deadline = time.monotonic() + within_s
    while True:
        time.sleep(quiet_s)
        now = metrics(url)
        same = {k: v for k, v in now.items() if k.startswith(prefix)} == {
            k: v for k, v in last.items() if k.startswith(prefix)
        }
        if same or time.monotonic() > deadline:
            return now
        last = now


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


@contextlib.contextmanager
def with_workers(system: System, n: int) -> Iterator[System]:
    """`system` once its `n` workers have registered; stopped with SIGTERM on leaving."""
    try:
        assert wait_until(lambda: health(system.url)["workers"] == n, 120), system.tail()
        yield system
    finally:
        system.stop(signal.SIGTERM)


@contextlib.contextmanager
def scheduler(group: ServiceGroup, *args: str) -> Iterator[None]:
    """A scheduler with these options against the group's worker, until the block ends;
    it must find no broken invariant and exit cleanly."""
    group.start("scheduler", *args, env=DEBUG_ENV)
    try:
        assert wait_until(lambda: _healthy(group.url), 60), group.tail()
        yield
    finally:
        code = group.stop("scheduler")
        assert code == 0, group.tail()
        assert "scheduler tick failed" not in group.tail(10_000), group.tail()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def settled(url: str, timeout: float = 30) -> dict[str, float]:
    """/metrics once nothing runs and the spill store has caught up with the drops."""

    def quiet() -> dict[str, float] | None:
        m = metrics(url)
        busy = m["spillway_requests_running"] or m["spillway_requests_swapped"]
        held = m.get("spillway_spill_store_sequences", 0) or m.get(
            "spillway_spill_store_used_bytes", 0
        )
        return None if busy or held or m["spillway_kv_cache_usage_ratio"] else m

    found = wait_until(quiet, timeout, interval=0.2)
    assert found, metrics(url)
    return found


def wait_for_metric(url: str, name: str, minimum: float, timeout: float = 300) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        value = metrics(url).get(name, 0.0)
        if value >= minimum:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{name} stayed below {minimum}: {metrics(url)}")

"""What a client sees when a replica dies, in one run:

    python -m bench.failover [--streams 4] [--model DIR] [--new-tokens 1500]

Starts replicas the way the e2e replica test does (`spillway serve` one service at a time,
private NATS and Redis): a spill store, two gateways, two schedulers each with a worker,
on a tiny random Llama with an 8k context unless --model is given. Then:

1. Scheduler killed: N greedy streams through both gateways, started one at a time so
   that twins (streams 2k and 2k+1, same prompt) run on different schedulers; SIGKILL
   the scheduler holding half of them. Each stream's chunks are timestamped at the
   client. For the stream of each twin pair with the longer gap across the kill (the
   resumed one) and for its undisturbed twin: the largest inter-chunk gap from the kill
   on (the pause) and the median gap otherwise, and whether the twins' texts are equal.
2. Gateway killed: streams through one gateway, SIGKILL it, and time (polling the other
   gateway's /health) until the schedulers hold none of its requests (target: under 2 s).

Figures only; nothing here asserts a time (tests/bench/test_failover.py checks the pure
parts).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

COMP = "/v1/completions"
RECOVERY_S = 180.0


@dataclass
class Stream:
    """One stream as its client saw it: the monotonic time of each chunk and the text."""

    stamps: list[float] = field(default_factory=list)
    text: str = ""
    finish: str | None = None


def gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(stamps)]


def pause_around(stamps: list[float], kill_at: float) -> tuple[float, float]:
    """(the largest gap between chunks that ends after `kill_at`, the median of the other
    gaps); 0.0 for either when there is none."""
    pairs = list(itertools.pairwise(stamps))
    after = [b - a for a, b in pairs if b > kill_at]
    pause = max(after, default=0.0)
    rest = gaps(stamps)
    if pause in rest and after:
        rest.remove(pause)
    return pause, (statistics.median(rest) if rest else 0.0)


def pause_end(stamps: list[float], kill_at: float) -> float:
    """When the chunk that ended the pause came (0.0 when none came after `kill_at`)."""
    after = [(b - a, b) for a, b in itertools.pairwise(stamps) if b > kill_at]
    return max(after, default=(0.0, 0.0))[1]


def resumed_of_pair(a: Stream, b: Stream, kill_at: float) -> tuple[Stream, Stream]:
    """(the twin that paused longer across the kill, the other): the killed scheduler's
    stream and its undisturbed twin."""
    if pause_around(a.stamps, kill_at)[0] >= pause_around(b.stamps, kill_at)[0]:
        return a, b
    return b, a


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


def chunk_text(data: str) -> tuple[str, str | None]:
    """The text and finish reason of one `data:` payload of a completions stream."""
    choices = json.loads(data).get("choices") or [{}]
    return choices[0].get("text") or "", choices[0].get("finish_reason")


def logged_at(log: str, marker: str) -> float | None:
    """The wall time (seconds since the epoch, local time as the services log it) of the
    first log line containing `marker`."""
    for line in log.splitlines():
        if marker in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


# --- the system -------------------------------------------------------------------------


def tiny_model(folder: Path) -> Path:
    """The e2e tests' tiny Llama (8k context) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    from spillway.shared.model_files import resolve_model
    from tests.e2e.conftest import save_tiny_model

    src = resolve_model("SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    return save_tiny_model(folder, tokenizer, 8192)


def url_of(group, name: str) -> str:
    return group.children[name].ready_detail.split()[0]


def health(url: str) -> dict:
    try:
        return httpx.get(f"{url}/health", timeout=10).json()
    except httpx.HTTPError:
        return {}


def held(url: str) -> int:
    """Requests the schedulers hold, as the leases heard by the gateway at `url` say."""
    return sum(s["running"] + s["waiting"] for s in health(url).get("schedulers", []))


def driving(url: str) -> list[dict]:
    """The schedulers that drive a worker, as the gateway at `url` hears them."""
    return [s for s in health(url).get("schedulers", []) if s["workers"]]


def start(model: Path, nats_url: str, redis_url: str):
    from spillway.services.cli.launcher import ServiceGroup, wait_until

    group = ServiceGroup(
        "--model", str(model), "--namespace", "failover-bench",
        "--nats-url", nats_url, "--redis-url", redis_url,
        "--kv-blocks", "400", "--block-size", "32", "--max-batch", "2",
        "--dtype", "float32", "--threads", "1",
    )  # fmt: skip
    group.start("spillstore")
    group.start("gateway", "--port", "0", name="gateway")
    group.start("gateway", "--port", "0", name="gateway-b")
    for n, side in enumerate("ab", start=1):
        group.start("scheduler", name=f"scheduler-{side}")
        group.start("worker", name=f"worker-{side}")
        url = url_of(group, "gateway")
        ok = wait_until(
            lambda n=n, url=url: len(driving(url)) == n,
            60,
        )
        assert ok, group.tail()
    return group


async def stream(client: httpx.AsyncClient, body: dict, out: Stream) -> None:
    async with client.stream("POST", COMP, json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            out.stamps.append(time.monotonic())
            text, finish = chunk_text(line.removeprefix("data: "))
            out.text += text
            out.finish = finish or out.finish


async def until(predicate, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(predicate)):
        if time.monotonic() > deadline:
            raise TimeoutError("the system did not get there in time")
        await asyncio.sleep(interval)
    return value


async def scheduler_killed(group, n: int, new_tokens: int) -> tuple[list[list[str]], int]:
    urls = [url_of(group, "gateway"), url_of(group, "gateway-b")]
    body = {"max_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    clients = [httpx.AsyncClient(base_url=u, timeout=RECOVERY_S) for u in urls]
    streams = [Stream() for _ in range(n)]
    tasks = []
    try:
        for i in range(n):
            prompt = f"Stream {i // 2} counts:"
            tasks.append(asyncio.ensure_future(stream(clients[i % 2], {**body, "prompt": prompt},
                                                      streams[i])))  # fmt: skip
            await until(lambda i=i: held(urls[0]) >= i + 1, 30)
        await until(lambda: all(s.stamps for s in streams), 60)
        schedulers = health(urls[0])["schedulers"]
        victim = max(schedulers, key=lambda s: s["running"] + s["waiting"])["id"]
        name = next(
            k for k in ("scheduler-a", "scheduler-b")
            if group.children[k].ready_detail.startswith(f"id={victim} ")
        )  # fmt: skip
        kill_at = time.monotonic()
        os.kill(group.children[name].proc.pid, signal.SIGKILL)
        group.children[name].proc.wait()
        await asyncio.wait_for(asyncio.gather(*tasks), RECOVERY_S)
    finally:
        for client in clients:
            await client.aclose()
    rows, equal = [], 0
    for k in range(0, n - 1, 2):
        resumed, twin = resumed_of_pair(streams[k], streams[k + 1], kill_at)
        same = resumed.text == twin.text and resumed.finish == twin.finish == "length"
        equal += same
        for role, s in (("resumed", resumed), ("twin", twin)):
            pause, median = pause_around(s.stamps, kill_at)
            back, end = pause_end(s.stamps, kill_at) - kill_at, s.stamps[-1] - kill_at
            rows.append([f"{k // 2}", role, f"{len(s.stamps)}", f"{pause * 1000:.0f}",
                         f"{median * 1000:.1f}", f"{back:.2f}", f"{end:.2f}",
                         "yes" if same else "NO"])  # fmt: skip
    return rows, equal


async def gateway_killed(group, n: int, new_tokens: int) -> tuple[float, float | None, int]:
    """Seconds from SIGKILL of gateway-b until the other gateway's view of the schedulers
    holds none of its `n` streams, until a scheduler logged aborting them (None: it did
    not), and how many were held at the kill."""
    other, doomed = url_of(group, "gateway"), url_of(group, "gateway-b")
    body = {"max_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    client = httpx.AsyncClient(base_url=doomed, timeout=RECOVERY_S)
    tasks = [
        asyncio.ensure_future(stream(client, {**body, "prompt": f"Doomed {i}:"}, Stream()))
        for i in range(n)
    ]
    try:
        before = await until(lambda: (h := held(other)) >= n and h, 60)
        killed_at, killed_wall = time.monotonic(), time.time()
        os.kill(group.children["gateway-b"].proc.pid, signal.SIGKILL)
        await until(lambda: held(other) == 0, 60, interval=0.01)
        seen = time.monotonic() - killed_at
        # The only gateway that dies in the run: the first such line is its.
        aborted = logged_at(group.tail(10_000), "stopped beating: aborting")
        return seen, (aborted - killed_wall if aborted else None), before
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4, help="even; twins share a prompt")
    parser.add_argument("--new-tokens", type=int, default=1500)
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: tiny)")
    args = parser.parse_args()
    from spillway.services.cli.servers import start_nats, start_redis

    nats, redis = start_nats(), start_redis()
    group = None
    try:
        with tempfile.TemporaryDirectory(prefix="failover-bench-") as tmp:
            model = args.model or tiny_model(Path(tmp))
            group = start(model, nats.url, redis.url)
            rows, equal = asyncio.run(scheduler_killed(group, args.streams, args.new_tokens))
            print("scheduler SIGKILLed: pause of each resumed stream and of its twin")
            header = ["pair", "stream", "chunks", "pause ms", "median gap ms",
                      "pause ends s", "last chunk s", "same text"]  # fmt: skip
            print(table(header, rows))
            print("(pause ends, last chunk: seconds after the kill)")
            print(f"texts equal to their twin's: {equal}/{args.streams // 2}")
            took, aborted, held_n = asyncio.run(gateway_killed(group, 2, args.new_tokens))
            print(
                f"\ngateway SIGKILLed with {held_n} streams held: schedulers held none of "
                f"them after {took:.2f} s by the other gateway's /health (target < 2 s)"
            )
            if aborted is not None:
                print(f"  (the scheduler logged aborting them {aborted:.2f} s after the kill; "
                      "the rest is its next lease reaching the other gateway)")  # fmt: skip
    finally:
        if group is not None:
            group.stop_all()
        nats.stop()
        redis.stop()


if __name__ == "__main__":
    main()

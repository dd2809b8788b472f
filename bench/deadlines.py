"""How late a request with a deadline ends, as its client measures it, under load:

    python -m bench.deadlines --model PATH [--load 8] [--timed 40] [--deadline-ms 300]
    python -m bench.deadlines --url http://127.0.0.1:8000 ...

Starts one system (`spillway up --model PATH`, private NATS and Redis) unless --url
names a running gateway. Keeps `--load` long streams running (the batch busy), then sends
`--timed` requests with `deadline_ms`, a few at a time, each long enough never to finish
before it; prints the overshoot (client-measured time to the whole response, minus the
deadline) as median, p90 and max, and how many ended "timeout". The gateway ends a
request at its deadline itself, so the overshoot is its own timer's and the HTTP path's
lateness, not the scheduler's tick.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from spillway.services.cli.launcher import System

COMP = "/v1/completions"
MAX_TOKENS = 4000  # never reached within a deadline; fits any served context of 4k+


async def _load(client: httpx.AsyncClient, stop: asyncio.Event, i: int) -> None:
    body = {"prompt": f"Load {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        try:
            async with client.stream("POST", COMP, json=body) as r:
                async for _ in r.aiter_lines():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            await asyncio.sleep(0.1)


async def _timed(client: httpx.AsyncClient, i: int, deadline_ms: int) -> tuple[float, str]:
    body = {
        "prompt": f"Timed {i}:",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "deadline_ms": deadline_ms,
    }
    start = time.perf_counter()
    r = await client.post(COMP, json=body)
    elapsed = time.perf_counter() - start
    reason = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else str(r)
    return elapsed * 1000 - deadline_ms, reason


async def run(url: str, load: int, timed: int, deadline_ms: int, at_once: int) -> None:
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        loaders = [asyncio.ensure_future(_load(client, stop, i)) for i in range(load)]
        await asyncio.sleep(2.0)  # the load is running
        results: list[tuple[float, str]] = []
        for first in range(0, timed, at_once):
            batch = range(first, min(first + at_once, timed))
            results += await asyncio.gather(*(_timed(client, i, deadline_ms) for i in batch))
        stop.set()
        for task in loaders:
            task.cancel()
        await asyncio.gather(*loaders, return_exceptions=True)
    overshoot = sorted(o for o, _ in results)
    p90 = overshoot[min(len(overshoot) - 1, int(0.9 * len(overshoot)))]
    timeouts = sum(reason == "timeout" for _, reason in results)
    others = sorted({reason for _, reason in results if reason != "timeout"})
    print(
        f"deadline {deadline_ms} ms, {load} streams of load, {timed} timed requests "
        f"({at_once} at a time): overshoot median {statistics.median(overshoot):.1f} ms, "
        f"p90 {p90:.1f} ms, max {overshoot[-1]:.1f} ms; {timeouts}/{timed} ended 'timeout'"
        + (f" (others: {', '.join(others)})" if others else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--url")
    parser.add_argument("--load", type=int, default=8)
    parser.add_argument("--timed", type=int, default=40)
    parser.add_argument("--at-once", type=int, default=4)
    parser.add_argument("--deadline-ms", type=int, default=300)
    args = parser.parse_args()
    if not args.url and not args.model:
        parser.error("give --model (a system is started) or --url (a running gateway)")
    system = None
    if not args.url:
        system = System("--model", args.model, "--max-batch", "16", "--dtype", "float32")
    try:
        url = args.url or system.url  # type: ignore[union-attr]
        asyncio.run(run(url, args.load, args.timed, args.deadline_ms, args.at_once))
    finally:
        if system is not None:
            system.stop()


if __name__ == "__main__":
    main()

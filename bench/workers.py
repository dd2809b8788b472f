"""Several workers under one scheduler: throughput, the step's split, and what moving a
lost worker's requests costs.

    python -m bench.workers [--model MODEL] [--requests 64] [--skip-throughput]

1. `spillway bench --launch` on P1 (64 x 128 + 128) with --workers 1 and --workers 2,
   alternating A B B A: generated tok/s, the scheduler's median step split (forward,
   bookkeeping, bus) and the spill store's share of the steps' time; the same under KV
   pressure in spill mode (a small --kv-blocks), where the store works every few steps.
2. Migration per sequence, by way: what the adopting worker pays to swap a moved sequence
   in from its spill (read back from Redis) against recomputing it (a prefill of its
   tokens), for 128 to 2,000 tokens (bench.spill.per_sequence: the same operations).
3. Migration end to end: two workers, 8 streams; one worker killed with SIGKILL; each
   moved stream's longest pause between two tokens (the heartbeat timeout that detects
   the death, then the move and the recompute) against the streams that did not move.

Prints the figures and writes bench-results/workers.json. The machines are shared and
noisy: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.spill import per_sequence
from spillway.services.cli.launcher import System, wait_until
from spillway.services.cli.servers import start_nats, start_redis

OUT = Path("bench-results/workers.json")
WORKER_TIMEOUT_S = 2.0  # the default: how long a dead worker goes unnoticed


# --- 1. throughput and the step split -------------------------------------------------


def launched_run(model: str, requests: int, launch_args: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [
            sys.executable, "-P", "-m", "spillway.services.cli.main", "bench", "--launch",
            "--model", model, "--requests", str(requests), "--json", f.name,
            "--launch-args", f"--model {model} {launch_args}",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        report = json.loads(Path(f.name).read_text())
    split = report.get("step_split_s") or {}
    return {
        "tok_s": report["summary"]["output_throughput"],
        "forward_ms": 1e3 * (split.get("forward") or 0.0),
        "bus_ms": 1e3 * (split.get("bus") or 0.0),
        "bookkeeping_ms": 1e3 * (split.get("scheduler_bookkeeping") or 0.0),
        "store_share": split.get("spill_store_share") or 0.0,
    }


def throughput(model: str, requests: int, extra: str, label: str) -> dict:
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for n in (1, 2, 2, 1):
        run = launched_run(model, requests, f"--workers {n} {extra}")
        runs[n].append(run)
        print(
            f"  {label}, {n} worker(s): {run['tok_s']:6.1f} tok/s; step: forward "
            f"{run['forward_ms']:.1f} ms, bus {run['bus_ms']:.2f} ms, bookkeeping "
            f"{run['bookkeeping_ms']:.2f} ms, spill store {run['store_share']:.1%}",
            flush=True,
        )
    out = {}
    for n, rs in runs.items():
        out[n] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    out["ratio_2_over_1"] = out[2]["tok_s"] / out[1]["tok_s"]
    return out


# --- 3. migration end to end ----------------------------------------------------------


def _stream(url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the stream's chunks that carried text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times


def migration(model: str, streams: int, new_tokens: int) -> dict:
    servers = [start_nats(), start_redis()]
    system = None
    try:
        system = System(
            "--model", model, "--namespace", "bench", "--nats-url", servers[0].url,
            "--redis-url", servers[1].url, "--workers", "2",
            env={"SPILLWAY_RESTART_BACKOFF_S": "60"},
        )  # fmt: skip
        url = system.url
        assert wait_until(lambda: httpx.get(f"{url}/health").json()["workers"] == 2, 120)
        prompts = [[100 + (7 * i + 3 * j) % 4000 for j in range(128)] for i in range(streams)]
        with cf.ThreadPoolExecutor(streams) as pool:
            futures = [pool.submit(_stream, url, p, new_tokens) for p in prompts]
            time.sleep(1.0)
            wait_until(lambda: httpx.get(f"{url}/health").json()["running"] == streams, 120)
            time.sleep(2.0)  # every stream is decoding
            os.kill(system.worker_pids()[0], signal.SIGKILL)
            arrivals = [f.result() for f in futures]
        pauses = [max(b - a for a, b in itertools.pairwise(t)) for t in arrivals]
        # A moved stream waits at least the heartbeat timeout that detects the death; the
        # others pause too, while the moved ones' recompute takes their steps.
        moved = [p for p in pauses if p > WORKER_TIMEOUT_S]
        stayed = [p for p in pauses if p <= WORKER_TIMEOUT_S]
        metrics = httpx.get(f"{url}/metrics").text
        counted = sum(  # over the `scheduler` label: the deployment's figure
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("spillway_migrations_total")
        )
        return {
            "streams": streams,
            "moved": len(moved),
            "migrations_counted": counted,
            "moved_pause_s_median": statistics.median(moved) if moved else None,
            "stayed_pause_s_median": statistics.median(stayed) if stayed else None,
            "worker_timeout_s": WORKER_TIMEOUT_S,
            "pauses_s": sorted(pauses),
        }
    finally:
        if system is not None:
            system.stop(signal.SIGTERM)
        for s in servers:
            s.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-per-sequence", action="store_true")
    args = parser.parse_args()
    report: dict = {"cpu": os.cpu_count()}
    if not args.skip_throughput:
        print("1. throughput, 1 and 2 workers (A B B A):", flush=True)
        report["throughput"] = throughput(args.model, args.requests, "", "P1")
        print(f"  2 workers / 1 worker: {report['throughput']['ratio_2_over_1']:.2f}x")
        pressure = "--kv-blocks 160 --preemption-mode spill"
        report["throughput_spill"] = throughput(
            args.model, args.requests, pressure, "P1 under KV pressure, spill"
        )
        print(f"  2 workers / 1 worker: {report['throughput_spill']['ratio_2_over_1']:.2f}x")
    if not args.skip_per_sequence:
        print("2. migration per sequence, swap-in against recompute:", flush=True)
        redis = start_redis()
        try:
            report["per_sequence"] = per_sequence(args.model, redis.url, [128, 512, 2000], 3)
        finally:
            redis.stop()
    print("3. migration end to end (one of two workers killed):", flush=True)
    report["migration"] = migration(args.model, 8, 256)
    m = report["migration"]
    print(
        f"  {m['moved']} of {m['streams']} streams moved ({m['migrations_counted']:.0f} "
        f"counted); longest pause: moved {m['moved_pause_s_median']} s (heartbeat timeout "
        f"{m['worker_timeout_s']} s), stayed {m['stayed_pause_s_median']} s; all: "
        + ", ".join(f"{p:.2f}" for p in m["pauses_s"]),
        flush=True,
    )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2))
    print(f"figures written to {OUT}")


if __name__ == "__main__":
    main()

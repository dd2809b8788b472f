"""How the worker holds its speed when it shares the machine, in one run:

    python -m bench.contention [--streams 16] [--output-len 128] [--launch-args '...']

Starts one system (`spillway up`, private NATS and Redis), then runs the same streaming
workload (N concurrent requests) three times: undisturbed, beside one busy process that
spins on a core for the length of the run (as a load generator or a busy neighbour
would), and undisturbed again. Prints TTFT, inter-token latency and throughput of each,
and the disturbed throughput as a share of the undisturbed mean (the target: at least
40%). Compare wait policies with --launch-args '--threads 2' and SPILLWAY_CPU_WAIT_POLICY.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
from pathlib import Path

from spillway.services.cli.bench.client import run_requests, served_model
from spillway.services.cli.bench.command import Launched, build_requests
from spillway.services.cli.bench.metrics import Summary, summarise
from spillway.services.cli.bench.workload import BenchRequest, Workload
from spillway.shared.model_files import resolve_model

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


def run_once(url: str, model: str, requests: list[BenchRequest]) -> Summary:
    return summarise(asyncio.run(run_requests(url, model, requests)))


def row(name: str, s: Summary) -> str:
    ttft = s.ttft_ms.median if s.ttft_ms else float("nan")
    itl = s.itl_ms.median if s.itl_ms else float("nan")
    return f"{name:<28} {s.output_throughput:8.1f} {ttft:10.0f} {itl:9.1f} {s.failed:7d}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--launch-args", default="")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    workload = Workload(
        num_requests=args.streams, input_len=args.input_len, output_len=args.output_len
    )
    requests = build_requests(resolve_model(args.model), workload)
    system = Launched.start(shlex.split(args.launch_args))
    results: dict[str, Summary] = {}
    try:
        model = asyncio.run(served_model(system.url))
        asyncio.run(run_requests(system.url, model, [BenchRequest(0, (1, 2, 3), 2, 0.0)]))
        results["undisturbed"] = run_once(system.url, model, requests)
        # The busy process outlives the run a little; it ends by itself.
        budget = 3 * max(results["undisturbed"].duration_s, 5.0) + 30
        spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=budget)])
        try:
            results["one busy process beside"] = run_once(system.url, model, requests)
        finally:
            spinner.kill()
            spinner.wait()
        results["undisturbed again"] = run_once(system.url, model, requests)
    finally:
        system.stop()
    print(f"\n{args.streams} streams x {args.output_len} new tokens, {args.launch_args or ''}")
    print(f"{'':<28} {'tok/s':>8} {'TTFT ms':>10} {'ITL ms':>9} {'failed':>7}")
    for name, s in results.items():
        print(row(name, s))
    quiet = (results["undisturbed"].output_throughput
             + results["undisturbed again"].output_throughput) / 2  # fmt: skip
    share = results["one busy process beside"].output_throughput / quiet
    print(f"disturbed / undisturbed throughput: {share:.2f} (target >= 0.40)")
    if args.json:
        from spillway.services.cli.bench.report import write_json

        write_json(args.json, {"results": results, "share": share, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The few-row decode step's two ways of using its threads, quiet and beside a neighbour
that wakes often, in one process:

    python -m bench.decode_threads [--model FILE.gguf] [--int8] [--threads 2] [--rounds 3]
                                   [--steps 60] [--loads 0:0,1000:300,3000:1500]
                                   [--source OTHER/decode_layers.c ...]

"one region": the whole step in one parallel region (`kernels/cpu/csrc/decode_layers.c`),
whose threads take each projection's rows in chunks and compute a chunk another thread has
not finished in time; "per projection": each projection in its own region. Each load
PERIOD:BUSY runs a second process beside the steps that sleeps PERIOD us and then holds a
core for BUSY us, over and over (as the gateway, scheduler and client do when they wake on
every token); 0:0 is none. Each `--source` adds a way: the one region as another version
of `decode_layers.c` builds it (e.g. `git show REV:kernels/cpu/csrc/decode_layers.c`), to
compare versions in the same run. One sequence at a 64-token prompt, `--steps` decode steps
per way and round, the ways interleaved; prints each way's median and 90th-percentile step
and how many chunks a thread computed for another.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from bench.gguf_blocks_speed import runner_for
from spillway.kernels.cpu.native import build, compile_flags
from spillway.services.worker.runner import ModelRunner
from spillway.shared.model_files import DEFAULT_MODEL
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

PROMPT = 64


def neighbour(period_us: int, busy_us: int, stop) -> None:
    while not stop.is_set():
        time.sleep(period_us / 1e6)
        until = time.perf_counter() + busy_us / 1e6
        while time.perf_counter() < until:
            pass


def decode_steps(runner: ModelRunner, n: int) -> list[float]:
    """Seconds of each of n decode steps after a fresh prompt."""
    runner.forget_all()
    greedy = SamplingParams(temperature=0.0)
    blocks = list(range((PROMPT + n) // 16 + 2))
    new = NewSequence(seq_id="a", sampling=greedy, block_ids=blocks)
    prompt = StepRow(seq_id="a", token_ids=list(range(100, 100 + PROMPT)), start_pos=0, sample=True)
    runner.execute(StepPlan(step_id=0, new_seqs=[new], rows=[prompt]))
    times = []
    for i in range(n):
        row = StepRow(seq_id="a", token_ids=[], start_pos=PROMPT + i, feed_last=True, sample=True)
        start = time.perf_counter()
        runner.execute(StepPlan(step_id=i + 1, rows=[row]))
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--int8", action="store_true", help="as --quantize int8 runs it")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--loads", default="0:0,1000:300,3000:1500")
    parser.add_argument("--source", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quantize = "int8" if args.int8 else "none"
    runner = runner_for(args.model, True, PROMPT + args.steps + 32, quantize=quantize)
    layers = runner.model.ops._decode_layers
    if layers is None:
        raise SystemExit("the native decode loop is not built here")
    ours = layers._run
    ways = {"one region": (ours, True), "per projection": (ours, False)}
    for source in args.source:
        other = build(source, compile_flags(), Path("~/.cache/spillway").expanduser())
        if other is None:
            raise SystemExit(f"could not build {source}")
        theirs = other.decode_layers
        theirs.restype, theirs.argtypes = ours.restype, ours.argtypes
        ways[f"one region, {source.name}"] = (theirs, True)
    print(f"{quantize} decode, {args.threads} threads, {args.steps} steps x {args.rounds} rounds")
    for load in args.loads.split(","):
        period, busy = (int(v) for v in load.split(":"))
        stop = mp.Event()
        beside = mp.Process(target=neighbour, args=(period, busy, stop)) if busy else None
        if beside is not None:
            beside.start()
        times: dict[str, list[float]] = {name: [] for name in ways}
        stolen = layers.stolen()
        try:
            for _ in range(args.rounds):
                for name, (fn, together) in ways.items():
                    layers._run, layers.together = fn, together
                    times[name] += decode_steps(runner, args.steps)[5:]  # past the warm-up
        finally:
            layers._run, layers.together = ours, None
            stop.set()
            if beside is not None:
                beside.join()
        what = f"a neighbour busy {busy} us every {period} us" if busy else "quiet"
        print(f"\n{what} (chunks computed for another thread: {layers.stolen() - stolen})")
        for name, ts in times.items():
            ts.sort()
            print(f"  {name:<40} median {statistics.median(ts) * 1e3:6.2f} ms"
                  f"   p90 {ts[int(0.9 * len(ts))] * 1e3:6.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

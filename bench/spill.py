"""KV pressure figures: spill against recompute, the auto crossover, run-ahead, prefix hits.

    python -m bench.spill [--model MODEL] [--quick]

1. Per sequence, in one process with a real Redis: the time to spill a sequence's KV and
   read it back (what a swap-in costs) against the time to prefill it again (what a
   recompute costs), for lengths from 16 to 2,000 tokens; the crossover this machine
   shows, and the one auto mode computes from its cost model with the measured rates.
2. Whole system under KV pressure, spill mode against recompute mode, for sequences of
   about 200 and about 2,000 tokens: generated tokens per second.
3. Run-ahead on and off on the same decode workload: the scheduler's median time per step
   during which the worker did not compute (bus, codec, bookkeeping), and throughput.
4. Time to first token for a long prompt, without and with a prefix-cache hit.

Prints a table and writes bench-results/spill.json. The machines are shared and noisy:
read ratios, run it when the machine is quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import json
import statistics
import time
from pathlib import Path

import httpx

from spillway.services.cli.launcher import ServiceGroup, wait_until
from spillway.services.cli.servers import start_nats, start_redis
from spillway.services.cli.worker_env import apply_openmp_environment
from spillway.services.scheduler.preemption import PreemptionPolicy
from spillway.shared.bus import Bus
from spillway.shared.config import load_settings
from spillway.shared.protocol import SchedulerStats, StatsRequest
from spillway.shared.subjects import SCHED_STATS

BLOCK = 16


# --- 1. per sequence: swap-in against recompute ----------------------------------------


def per_sequence(model: str, redis_url: str, lengths: list[int], repeats: int) -> dict:
    import torch

    from spillway.services.worker.kv_transfer import KVTransfer, connect_kv_store
    from spillway.services.worker.loading import load_runner
    from spillway.shared.config import load_settings
    from spillway.shared.protocol import (
        KVRestore,
        KVSpill,
        NewSequence,
        SamplingParams,
        StepPlan,
        StepRow,
    )
    from spillway.shared.spill_keys import SpillKeys

    longest = max(lengths)
    blocks = 2 * (longest // BLOCK + 2)
    settings = load_settings(model=model, kv_blocks=blocks, device="cpu", spill_store=False)
    runner, _ = load_runner(settings)
    runner.kv_transfer = KVTransfer(
        connect_kv_store(redis_url, 5.0), SpillKeys("bench"), runner.kv_cache
    )
    greedy = SamplingParams(temperature=0.0)
    rows = []
    step = 0
    for length in lengths:
        n = length // BLOCK + 1
        tokens = [100 + (i * 7) % 5000 for i in range(length)]
        ids = list(range(n))
        recompute, swap = [], []
        for _ in range(repeats + 1):  # the first round warms up and is not counted
            step += 1
            new = NewSequence(seq_id="s", sampling=greedy, block_ids=ids)
            plan = StepPlan(step_id=step, finished_seq_ids=["s"], new_seqs=[new],
                            rows=[StepRow(seq_id="s", token_ids=tokens, start_pos=0,
                                          sample=True)])  # fmt: skip
            t = time.perf_counter()
            result = runner.execute(plan)
            recompute.append(time.perf_counter() - t)
            assert result.error is None, result.error
            step += 1
            t = time.perf_counter()
            out = runner.execute(StepPlan(step_id=step, spills=[
                KVSpill(seq_id="s", spill_id=step, block_ids=ids)]))  # fmt: skip
            elsewhere = [blocks - 1 - i for i in ids]
            back = runner.execute(StepPlan(step_id=step + 1, restores=[
                KVRestore(seq_id="s", spill_id=step, block_ids=elsewhere)]))  # fmt: skip
            swap.append(time.perf_counter() - t)
            assert out.spills[0].ok and not back.lost_seq_ids
            step += 1
        recompute, swap = recompute[1:], swap[1:]
        kv_bytes = n * runner.kv_transfer.block_bytes
        rows.append(
            {
                "tokens": length,
                "kv_bytes": kv_bytes,
                "recompute_s": statistics.median(recompute),
                "spill_and_restore_s": statistics.median(swap),
            }
        )
        print(
            f"  {length:5d} tokens, {kv_bytes / 2**20:7.1f} MiB: recompute "
            f"{rows[-1]['recompute_s'] * 1e3:8.1f} ms, spill + restore "
            f"{rows[-1]['spill_and_restore_s'] * 1e3:8.1f} ms",
            flush=True,
        )
    # The cost model's rates, fitted to what was measured.
    big = rows[-1]
    policy = PreemptionPolicy("auto", True)
    policy.kv_bandwidth_bps = 2 * big["kv_bytes"] / max(big["spill_and_restore_s"], 1e-9)
    policy.prefill_tokens_per_s = big["tokens"] / big["recompute_s"]
    bytes_per_token = big["kv_bytes"] / big["tokens"]
    measured = next((r["tokens"] for r in rows if r["spill_and_restore_s"] < r["recompute_s"]),
                    None)  # fmt: skip
    del torch
    return {
        "rows": rows,
        "kv_bandwidth_bps": policy.kv_bandwidth_bps,
        "prefill_tokens_per_s": policy.prefill_tokens_per_s,
        "model_crossover_tokens": policy.crossover_tokens(bytes_per_token),
        "first_length_where_spill_wins": measured,
    }


# --- 2-4. the whole system ----------------------------------------------------------


def _completion(url: str, prompt, max_tokens: int, stream: bool = False) -> tuple[int, float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], time.perf_counter() - start
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=3600) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return 1, time.perf_counter() - start
    raise RuntimeError("no token came")


def _throughput(url: str, prompts: list, max_tokens: int) -> float:
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: _completion(url, p, max_tokens)[0], prompts))
    return sum(done) / (time.perf_counter() - start)


async def _stats(nats_url: str, namespace: str) -> SchedulerStats:
    bus = await Bus.connect(nats_url, namespace, "bench")
    try:
        return await bus.request(SCHED_STATS, StatsRequest(), SchedulerStats, 5)
    finally:
        await bus.close()


def _with_scheduler(group: ServiceGroup, *args: str):
    group.start("scheduler", *args)
    assert wait_until(lambda: httpx.get(f"{group.url}/health").status_code == 200, 120)


# Runs alternate (A B B A ...) and the medians are compared: the first run of a fresh
# system pays for warm-up, and the machine's load drifts.
ROUNDS = 2


def _alternating(labels: tuple[str, str], rounds: int):
    for r in range(rounds):
        yield from (labels if r % 2 == 0 else labels[::-1])


def _medians(runs: dict[str, list[dict]]) -> dict[str, dict]:
    return {
        label: {key: statistics.median(run[key] or 0 for run in got) for key in got[0]}
        for label, got in runs.items()
    }


def system_figures(model: str, nats_url: str, redis_url: str, quick: bool) -> dict:
    out: dict = {}
    words = "the quick brown fox jumps over a lazy dog near the river bank at dawn "
    for label, prompt_len, new, n, kv_blocks in (
        ("~200 tokens", 40, 160, 12, 40),
        ("~2000 tokens", 1800, 200 if not quick else 40, 4, 260),
    ):
        group = ServiceGroup("--nats-url", nats_url, "--redis-url", redis_url,
                             "--namespace", f"b{kv_blocks}", "--model", model)  # fmt: skip
        try:
            group.start("spillstore")
            group.start("worker", "--kv-blocks", str(kv_blocks), "--block-size", str(BLOCK))
            group.start("gateway", "--port", "0")
            runs: dict[str, list[dict]] = {"spill": [], "recompute": []}
            for i, mode in enumerate(_alternating(("spill", "recompute"), ROUNDS)):
                # Prompts of its own per run: the shared prefix tier keeps what an earlier
                # run finished, and no run may prefill less for it.
                prompts = [(f"{i} {j} " + words * 200)[: prompt_len * 5] for j in range(n)]
                _with_scheduler(group, "--preemption-mode", mode)
                tok_s = _throughput(group.url, prompts, new)
                stats = asyncio.run(_stats(nats_url, f"b{kv_blocks}"))
                runs[mode].append({"tok_s": tok_s, "preemptions": stats.preemptions[mode]})
                group.stop("scheduler")
                print(f"  {label}, {mode}: {tok_s:.1f} tok/s, "
                      f"{stats.preemptions[mode]} preemptions", flush=True)  # fmt: skip
            figures = _medians(runs)
            figures["spill_over_recompute"] = (
                figures["spill"]["tok_s"] / figures["recompute"]["tok_s"]
            )
            print(f"  {label}: spill / recompute (medians) "
                  f"{figures['spill_over_recompute']:.2f}", flush=True)  # fmt: skip
            out[label] = figures
        finally:
            group.stop_all()

    group = ServiceGroup("--nats-url", nats_url, "--redis-url", redis_url,
                         "--namespace", "ra", "--model", model)  # fmt: skip
    try:
        group.start("spillstore")
        group.start("worker", "--kv-blocks", "1024", "--block-size", str(BLOCK))
        group.start("gateway", "--port", "0")
        prompts = [f"Story {i}: once upon a time" for i in range(16)]
        args = {"on": [], "off": ["--no-run-ahead"]}
        runs = {"on": [], "off": []}
        for label in _alternating(("off", "on"), 2 * ROUNDS):
            _with_scheduler(group, *args[label])
            tok_s = _throughput(group.url, prompts, 48 if quick else 96)
            stats = asyncio.run(_stats(nats_url, "ra"))
            runs[label].append({"tok_s": tok_s, "step_overhead_s": stats.step_overhead_s,
                                "step_forward_s": stats.step_forward_s})  # fmt: skip
            group.stop("scheduler")
            print(f"  run-ahead {label}: {tok_s:.1f} tok/s, not computing "
                  f"{(stats.step_overhead_s or 0) * 1e3:.2f} ms per step "
                  f"(forward {(stats.step_forward_s or 0) * 1e3:.1f} ms)", flush=True)  # fmt: skip
        ahead = _medians(runs)
        ahead["saved_per_step_s"] = ahead["off"]["step_overhead_s"] - ahead["on"]["step_overhead_s"]
        ahead["on_over_off"] = ahead["on"]["tok_s"] / ahead["off"]["tok_s"]
        print(f"  run-ahead (medians): {ahead['saved_per_step_s'] * 1e3:.2f} ms per step "
              f"saved, throughput on / off {ahead['on_over_off']:.3f}", flush=True)  # fmt: skip
        out["run_ahead"] = ahead

        _with_scheduler(group)
        long_prompt = "Chapter one. " + words * 70
        miss = _completion(group.url, long_prompt, 1, stream=True)[1]
        hit = _completion(group.url, long_prompt, 1, stream=True)[1]
        out["ttft"] = {"miss_s": miss, "hit_s": hit, "ratio": miss / hit}
        print(f"  TTFT of a ~1,000-token prompt: {miss * 1e3:.0f} ms cold, "
              f"{hit * 1e3:.0f} ms with a prefix hit ({miss / hit:.1f}x)", flush=True)  # fmt: skip
        group.stop("scheduler")
    finally:
        group.stop_all()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--skip-system", action="store_true", help="per-sequence figures only")
    args = parser.parse_args()
    # The worker's OpenMP settings, before torch loads here (the in-process runner of 1.).
    apply_openmp_environment(load_settings())
    nats, redis = start_nats(), start_redis()
    try:
        print("1. swap-in (spill + restore) against recompute, per sequence:", flush=True)
        lengths = [16, 64, 200, 500, 1000, 2000]
        results = {"per_sequence": per_sequence(args.model, redis.url, lengths, 3)}
        ps = results["per_sequence"]
        print(f"  fitted: KV bandwidth {ps['kv_bandwidth_bps'] / 1e9:.2f} GB/s, prefill "
              f"{ps['prefill_tokens_per_s']:.0f} tok/s -> auto spills above "
              f"{ps['model_crossover_tokens']:.0f} tokens; measured: spill wins from "
              f"{ps['first_length_where_spill_wins']} tokens", flush=True)  # fmt: skip
        if not args.skip_system:
            print("2-4. whole system:", flush=True)
            results["system"] = system_figures(args.model, nats.url, redis.url, args.quick)
    finally:
        nats.stop()
        redis.stop()
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/spill.json").write_text(json.dumps(results, indent=2))
    print("wrote bench-results/spill.json")


if __name__ == "__main__":
    main()

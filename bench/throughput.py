"""Throughput of the whole system beside transformers, in the same run.

    python -m bench.throughput [--concurrency 32] [--max-tokens 64] [--url URL]

Starts `spillway up` on private NATS/Redis (unless --url names a running system), sends
N concurrent completions of M new tokens (greedy, ignore_eos) through the HTTP API and
reports output tokens per second; then runs transformers' static batched `generate` on
the same prompts and weights and prints the ratio. Also prints the scheduler's median
decode step split into forward, scheduler bookkeeping and bus. Writes
bench-results/throughput.json. The machines are shared and noisy: read ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from services.cli.launcher import System
from services.cli.servers import start_nats, start_redis
from shared.bus import Bus
from shared.protocol import SchedulerStats, StatsRequest
from shared.subjects import SCHED_STATS

TOPICS = [
    "the ocean", "a city at night", "mountains", "a library", "the first computer",
    "bread baking", "a chess game", "rainy weather", "a train journey", "the moon",
    "gardening", "a lighthouse", "coffee", "volcanoes", "a violin", "winter",
]  # fmt: skip


def prompts(n: int) -> list[str]:
    return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]} (#{i}):" for i in range(n)]


async def run_spillway(url: str, texts: list[str], max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(prompt: str) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = await client.post(
                "/v1/completions",
                json={
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"], time.perf_counter() - t0

        await one("warm up")
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in texts))
        wall = time.perf_counter() - start
    tokens = sum(n for n, _ in results)
    return {
        "requests": len(texts),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "median_request_s": statistics.median(t for _, t in results),
    }


async def step_split(nats_url: str, namespace: str) -> SchedulerStats:
    bus = await Bus.connect(nats_url, namespace, "bench")
    try:
        return await bus.request(SCHED_STATS, StatsRequest(), SchedulerStats, timeout=5)
    finally:
        await bus.close()


def run_transformers(texts: list[str], max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from shared.model_files import resolve_model

    src = resolve_model("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32
    ).eval()
    batch = tok(texts, return_tensors="pt", padding=True)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.inference_mode():
        model.generate(**tok(["warm up"], return_tensors="pt"), max_new_tokens=2)
        start = time.perf_counter()
        out = model.generate(**batch, generation_config=config)
        wall = time.perf_counter() - start
    tokens = (out.shape[1] - batch.input_ids.shape[1]) * len(texts)
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--url", help="a running system's HTTP URL (default: start one)")
    ap.add_argument("--nats-url", help="its NATS (for the step split), with --url")
    ap.add_argument("--namespace", default="bench")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default="bench-results/throughput.json")
    args = ap.parse_args()

    texts = prompts(args.concurrency)
    servers, system = [], None
    url, nats_url, namespace = args.url, args.nats_url, args.namespace
    if not url:
        servers = [start_nats(), start_redis()]
        nats_url = servers[0].url
        system = System(
            "--namespace", namespace, "--nats-url", nats_url, "--redis-url", servers[1].url,
            "--max-batch", str(max(args.concurrency, 1)),
        )  # fmt: skip
        url = system.url
    try:
        ours = asyncio.run(run_spillway(url, texts, args.max_tokens))
        split = asyncio.run(step_split(nats_url, namespace)) if nats_url else None
    finally:
        if system:
            system.stop()
        for s in servers:
            s.stop()
    report: dict = {"spillway": ours}
    if split:
        report["decode_step_median_s"] = {
            "forward": split.step_forward_s,
            "scheduler_bookkeeping": split.step_bookkeeping_s,
            "bus": split.step_bus_s,
        }
    if not args.skip_transformers:
        report["transformers_static_generate"] = run_transformers(texts, args.max_tokens)
        report["ratio_spillway_over_transformers"] = (
            ours["tokens_per_s"] / report["transformers_static_generate"]["tokens_per_s"]
        )
    print_table(report, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"figures written to {args.out}")


def print_table(report: dict, args: argparse.Namespace) -> None:
    print(f"\n{args.concurrency} concurrent requests x {args.max_tokens} new tokens")
    print(f"{'system':38s} {'tok/s':>9s} {'wall s':>8s}")
    ours = report["spillway"]
    print(f"{'spillway (HTTP API, whole system)':38s} {ours['tokens_per_s']:9.1f} "
          f"{ours['wall_s']:8.2f}")  # fmt: skip
    hf = report.get("transformers_static_generate")
    if hf:
        print(f"{'transformers static generate':38s} {hf['tokens_per_s']:9.1f} {hf['wall_s']:8.2f}")
        print(f"ratio spillway / transformers: {report['ratio_spillway_over_transformers']:.2f}")
    split = report.get("decode_step_median_s")
    if split:
        parts = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in split.items() if v is not None)
        print(f"median decode step: {parts}")


if __name__ == "__main__":
    main()

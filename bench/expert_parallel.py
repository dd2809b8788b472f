"""Expert parallel's exchange: bytes and share of a step at EP=1 and EP=2, all_reduce
against all_to_all, and the experts' load on a random workload.

    python -m bench.expert_parallel [--layers 4] [--hidden 256] [--experts 8] [--repeat 5]

A random Qwen3-MoE-shaped model (made with transformers) is served by one process and by
two ranks (gloo, this machine). Every rank runs the same forwards: a prefill step (8 rows
of 64 random tokens) and a decode step (16 rows at context 64). Per step kind and
exchange: the median step time, the time in the exchange's collectives and its share of
the step, and the bytes rank 0 sent. Then tokens per expert over the prefill (the router's
balance on random tokens). Last, how a swap-in's KV reaches every rank: each rank reading
it from Redis itself (what the worker does) against rank 0 reading it and broadcasting it
over the group, for a sequence of --kv-mb megabytes. Prints the figures and writes
bench-results/expert_parallel.json. Shared machines are noisy: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

OUT = Path("bench-results/expert_parallel.json")
ROWS_PREFILL, PREFILL_LEN = 8, 64
ROWS_DECODE, CONTEXT = 16, 64
EXCHANGES = ("all_reduce", "all_to_all")


def save_model(folder: Path, layers: int, hidden: int, experts: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    return folder


def batch(rows: int, length: int, context: int, block_size: int, seed: int):
    """`rows` rows of `length` new tokens each, ending at position `context`."""
    from spillway.services.worker.forward_batch import ForwardBatch
    from spillway.services.worker.kv_cache import block_table_tensor, slot_mapping_tensor

    g = torch.Generator().manual_seed(seed)
    per_row = -(-context // block_size)
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    lens = torch.full((rows,), length)
    token_rows = torch.repeat_interleave(torch.arange(rows), lens)
    query_start = torch.zeros(rows + 1, dtype=torch.int64)
    query_start[1:] = lens.cumsum(0)
    positions = (context - length) + torch.arange(rows * length) - query_start[token_rows]
    block_tables = block_table_tensor(tables, torch.device("cpu"))
    return ForwardBatch(
        token_ids=torch.randint(0, 1024, (rows * length,), generator=g),
        positions=positions,
        slot_mapping=slot_mapping_tensor(block_tables, token_rows, positions, block_size),
        block_tables=block_tables,
        context_lens=torch.full((rows,), context, dtype=torch.int32),
        query_start=query_start.to(torch.int32),
        logits_indices=query_start[1:] - 1,
        max_query_len=length,
        max_context_len=context,
        decode_only=length == 1,
    )


def rank_main(
    rank: int, size: int, url: str, folder: str, repeat: int, out: str, redis_url: str, kv_mb: int
) -> None:
    from spillway.services.worker.loading import load_runner
    from spillway.shared.config import load_settings

    torch.set_num_threads(1)
    # One math thread per rank: on a shared machine two OpenMP threads wait on each other.
    options = dict(
        model=folder, kv_blocks=64, device="cpu", dtype="float32", block_size=16, threads=1
    )
    if size > 1:
        options |= dict(expert_parallel=size, rank=rank, dist_url=url)
    runner, _ = load_runner(load_settings(**options))
    model, group = runner.model, runner.experts
    assert group is not None and model.config.moe is not None
    steps = {
        "prefill": batch(ROWS_PREFILL, PREFILL_LEN, CONTEXT, 16, 1),
        "decode": batch(ROWS_DECODE, 1, CONTEXT, 16, 2),
    }
    report: dict = {}
    for exchange in EXCHANGES if size > 1 else ("none",):
        if size > 1:
            group.exchange = exchange
        for kind, b in steps.items():
            runs = []
            for _ in range(repeat + 1):  # the first warms up
                group.start_step(model.config.moe.num_experts)
                start = time.perf_counter()
                with torch.inference_mode():
                    model.forward(b, runner.kv_cache)
                runs.append((time.perf_counter() - start, group.counters))
            step = statistics.median(t for t, _ in runs[1:])
            ex = statistics.median(c.seconds for _, c in runs[1:])
            report[f"{exchange}/{kind}"] = dict(
                step_s=step, exchange_s=ex, share=ex / step, bytes=runs[-1][1].bytes,
                tokens=int(b.token_ids.numel()), expert_tokens=runs[-1][1].expert_tokens,
            )  # fmt: skip
    if size > 1 and redis_url:
        report["restore"] = restore_paths(rank, redis_url, kv_mb, repeat)
    if rank == 0:
        Path(out).write_text(json.dumps(report))


def restore_paths(rank: int, redis_url: str, kv_mb: int, repeat: int) -> dict:
    """Median seconds for one sequence's KV to reach every rank: each from Redis, or rank
    0 from Redis then a broadcast (the bytes as one uint8 tensor)."""
    import redis
    import torch.distributed as dist

    client = redis.Redis.from_url(redis_url)
    blob = bytes(kv_mb << 20)
    if rank == 0:
        client.set("bench:ep:kv", blob)
    dist.barrier()
    each, broadcast = [], []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        got = client.get("bench:ep:kv")
        dist.barrier()  # the slowest rank decides
        each.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            got = client.get("bench:ep:kv")
            tensor = torch.frombuffer(bytearray(got), dtype=torch.uint8)
        else:
            tensor = torch.empty(kv_mb << 20, dtype=torch.uint8)
        dist.broadcast(tensor, src=0)
        dist.barrier()
        broadcast.append(time.perf_counter() - start)
    assert got is not None and len(got) == kv_mb << 20
    return dict(kv_mb=kv_mb, redis_each_s=statistics.median(each),
                redis_then_broadcast_s=statistics.median(broadcast))  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(size: int, folder: Path, repeat: int, redis_url: str, kv_mb: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        url = f"tcp://127.0.0.1:{free_port()}"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.expert_parallel",
                    "--rank",
                    str(r),
                    "--size",
                    str(size),
                    "--url",
                    url,
                    "--folder",
                    str(folder),
                    "--repeat",
                    str(repeat),
                    "--out",
                    f.name,
                    "--redis-url",
                    redis_url,
                    "--kv-mb",
                    str(kv_mb),
                ]
            )
            for r in range(size)
        ]
        codes = [p.wait() for p in procs]
        assert codes == [0] * size, codes
        return json.loads(Path(f.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--kv-mb", type=int, default=16, help="one swapped-in sequence's KV")
    p.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.size, args.url, args.folder, args.repeat, args.out,
                  args.redis_url, args.kv_mb)  # fmt: skip
        return
    from spillway.services.cli.servers import start_redis

    redis_server = start_redis()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_model(Path(tmp), args.layers, args.hidden, args.experts)
            results = {
                size: run_group(size, folder, args.repeat, redis_server.url, args.kv_mb)
                for size in (1, 2)
            }
    finally:
        redis_server.stop()
    restore = results[2].pop("restore")
    print(f"{args.layers} MoE layers, hidden {args.hidden}, {args.experts} experts, top 2")
    print(f"{'EP':>2} {'exchange':<10} {'step':<7} {'tokens':>6} {'step ms':>8} "
          f"{'exch ms':>8} {'share':>6} {'bytes':>10} {'B/token':>8}")  # fmt: skip
    for size, report in results.items():
        for key, r in report.items():
            exchange, kind = key.split("/")
            print(f"{size:>2} {exchange:<10} {kind:<7} {r['tokens']:>6} {1e3 * r['step_s']:>8.2f} "
                  f"{1e3 * r['exchange_s']:>8.2f} {r['share']:>6.1%} {r['bytes']:>10} "
                  f"{r['bytes'] / r['tokens']:>8.0f}")  # fmt: skip
    load = results[1]["none/prefill"]["expert_tokens"]
    mean = sum(load) / len(load)
    print(f"tokens per expert (prefill, all layers): {load}; max/mean {max(load) / mean:.2f}")
    print(
        f"a {restore['kv_mb']} MB swap-in on both ranks: each from Redis "
        f"{1e3 * restore['redis_each_s']:.1f} ms, rank 0 from Redis then a broadcast "
        f"{1e3 * restore['redis_then_broadcast_s']:.1f} ms"
    )
    OUT.parent.mkdir(exist_ok=True)
    out = {**{str(k): v for k, v in results.items()}, "restore": restore}
    OUT.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

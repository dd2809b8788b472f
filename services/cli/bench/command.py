"""`spillway bench`: options, then one run (load test, optional peers, report).

    spillway bench [--url URL | --launch] [--requests N] [--concurrency C] [--rate R]
                   [--input-len L] [--output-len L] [--seed S] [--json FILE] [--compare]
                   [--llama-cpp-python PYTHON] [--vllm PYTHON]

The defaults are the workload P1: 64 requests of 128 random prompt tokens and 128 new
tokens each, all sent at once, greedy, `ignore_eos`. `--launch` starts a fresh system
(`spillway up` on private NATS and Redis) for the run and stops it before the peers run,
so that each system has the machine to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from spillway.services.cli.bench import machine as machine_mod
from spillway.services.cli.bench.client import run_requests, served_model
from spillway.services.cli.bench.hf_folder import hf_folder
from spillway.services.cli.bench.metrics import summarise
from spillway.services.cli.bench.options import DEFAULT_URL
from spillway.services.cli.bench.peers import (
    PeerResult,
    agreement,
    run_llama_cpp_peer,
    run_transformers_peer,
    run_vllm_peer,
)
from spillway.services.cli.bench.progress import ProgressBar
from spillway.services.cli.bench.report import comparison_table, summary_table, write_json
from spillway.services.cli.bench.workload import TEXT, BenchRequest, Workload, make_requests
from spillway.services.cli.worker_env import apply_openmp_environment
from spillway.shared.config import load_settings
from spillway.shared.model_config import ModelConfig, load_base_config
from spillway.shared.model_files import ModelNotFound, ModelSource, resolve_model


def workload_from(args: argparse.Namespace) -> Workload:
    return Workload(
        num_requests=args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        dataset=args.dataset,
        seed=args.seed,
        rate=args.rate,
        concurrency=args.concurrency,
    )


def bench_main(args: argparse.Namespace) -> int:
    try:
        workload = workload_from(args)
    except ValueError as e:
        print(f"spillway bench: {e}", file=sys.stderr)
        return 2
    if args.launch and args.url:
        print("spillway bench: give --url or --launch, not both", file=sys.stderr)
        return 2
    # This process's OpenMP threads (the bound's measurement) wait as the worker's do
    # (before torch loads). Every peer runs in its own process with the environment as it
    # was: our wait policy is not its setting (passive waits cost llama.cpp's per-operation
    # barriers two thirds of its speed, and transformers' batched decode of a mid-size
    # hybrid about half).
    peer_env = dict(os.environ)
    apply_openmp_environment(load_settings())
    try:
        source = resolve_model(args.model)
    except ModelNotFound as e:
        print(f"spillway bench: {e}", file=sys.stderr)
        return 2
    requests = build_requests(source, workload)
    print(
        f"workload: {workload.num_requests} requests, {workload.input_len} prompt / "
        f"{workload.output_len} new tokens (range ±{workload.range_ratio:g}), {workload.dataset}"
        f" prompts, rate {workload.rate:g}/s, concurrency {workload.concurrency or 'unlimited'}",
        flush=True,
    )
    system = Launched.start(launch_args(args.launch_args, args.model)) if args.launch else None
    url = system.url if system else (args.url or DEFAULT_URL)
    nats_url = system.nats_url if system else args.nats_url
    namespace = system.namespace if system else args.namespace
    try:
        model = args.served_model_name or asyncio.run(served_model(url, args.api_key))
        records, split = asyncio.run(
            _load_test(url, model, requests, workload, args, nats_url, namespace)
        )
    except httpx.HTTPError as e:
        print(f"spillway bench: the server at {url} did not answer ({e!r}); start one or"
              " give --launch", file=sys.stderr)  # fmt: skip
        return 1
    finally:
        if system:
            system.stop()
    ours = summarise(records)
    print(summary_table(f"spillway bench: {url}", ours))
    if split:
        print("median step (scheduler's view): " + ", ".join(
            f"{k} {v * 1e3:.2f} ms" for k, v in split.items()
            if v is not None and k != "spill_store_share"))  # fmt: skip
        if split.get("spill_store_share"):
            print(f"spill store I/O: {split['spill_store_share']:.1%} of the steps' time")
    report: dict[str, Any] = {
        "workload": asdict(workload),
        "url": url,
        "model": model,
        "summary": ours,
        "step_split_s": split,
    }
    if args.compare:
        name = "spillway (HTTP, whole system)" if system else f"{model} at {url}"
        texts = [r.text for r in records]
        report.update(compare(args, source, requests, name, ours, texts, peer_env))
    if args.perplexity:
        report["perplexity"] = measure_perplexity(source)
    if args.json:
        write_json(args.json, report)
        print(f"figures written to {args.json}")
    return 0 if ours.failed == 0 else 1


def build_requests(source: ModelSource, workload: Workload) -> list[BenchRequest]:
    tokenizer = _tokenizer(source)
    special = list(tokenizer.tokenizer.get_added_tokens_decoder())
    text = workload.dataset == "text"
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False) if text else ()
    return make_requests(workload, tokenizer.vocab_size, special, text_ids)


def _tokenizer(source: ModelSource):
    from spillway.shared.tokenizer_files import load_tokenizer

    return load_tokenizer(source, load_settings().cache_dir)


async def _load_test(
    url: str,
    model: str,
    requests: list[BenchRequest],
    workload: Workload,
    args: argparse.Namespace,
    nats_url: str | None,
    namespace: str,
):
    # One short request first: connections open and the server's first-use work is done
    # before the clock starts.
    warm = [BenchRequest(0, requests[0].prompt_ids[:8], 2, 0.0)]
    await run_requests(url, model, warm, api_key=args.api_key)
    bar = ProgressBar(len(requests), enabled=not args.no_progress and sys.stderr.isatty())
    records = await run_requests(
        url,
        model,
        requests,
        concurrency=workload.concurrency,
        temperature=args.temperature,
        api_key=args.api_key,
        progress=bar,
    )
    split = await step_split(nats_url, namespace) if nats_url else None
    return records, split


async def step_split(nats_url: str, namespace: str) -> dict[str, float | None] | None:
    """The scheduler's rolling medians of a step's parts (None when it does not answer)."""
    from spillway.shared.bus import Bus, BusError
    from spillway.shared.protocol import SchedulerStats, StatsRequest
    from spillway.shared.subjects import SCHED_STATS

    try:
        bus = await Bus.connect(nats_url, namespace, "spillway-bench")
    except Exception:
        return None
    try:
        stats = await bus.request(SCHED_STATS, StatsRequest(), SchedulerStats, timeout=5)
    except BusError:
        return None
    finally:
        await bus.close()
    return {
        "forward": stats.step_forward_s,
        "scheduler_bookkeeping": stats.step_bookkeeping_s,
        "bus": stats.step_bus_s,
        # between two results of back-to-back steps, the time the worker was not computing
        "outside_forward": stats.step_overhead_s,
        # the worker's own phases: its host batch (part of outside_forward) and sampling
        # (part of forward)
        "worker_host_batch": stats.step_prepare_s,
        "of_forward_sampling": stats.step_sample_s,
        "spill_store_share": stats.step_kv_io_share,
    }


def compare(
    args: argparse.Namespace,
    source: ModelSource,
    requests: list[BenchRequest],
    ours_name: str,
    ours,
    our_texts: list[str],
    peer_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    the_machine = machine_mod.describe_machine()
    print(f"\nmachine: {the_machine.line()}", flush=True)
    gflops = machine_mod.matmul_gflops()
    gbps = machine_mod.read_gbps()
    config = load_base_config(source)
    bound = bound_tokens_per_s(config, requests, gflops, gbps)
    batch = args.peer_batch or args.concurrency
    peers: list[PeerResult] = []
    print("peer: transformers ...", flush=True)
    peers.append(run_transformers_peer(source, requests, batch, peer_env))
    llama_python = args.llama_cpp_python or _this_python_if("llama_cpp")
    if llama_python:
        gguf = args.llama_cpp_model or (str(source.path) if source.kind == "gguf" else None)
        if gguf:
            print("peer: llama.cpp ...", flush=True)
            peers.append(run_llama_cpp_peer(llama_python, gguf, requests, batch, env=peer_env))
    if args.vllm:
        print("peer: vLLM ...", flush=True)
        peers.append(vllm_peer(args.vllm, source, requests, batch, peer_env))
    tokenizer = _tokenizer(source)
    agreements = {
        p.name: agreement(our_texts, [tokenizer.decode(ids) for ids in p.output_ids])
        for p in peers
        if not p.error and args.temperature == 0.0
    }
    print()
    print(comparison_table(ours_name, ours, peers, agreements, bound))
    print(f"float32 bound: {gflops:.0f} GFLOP/s, {gbps:.1f} GB/s read on {the_machine.line()}")
    return {
        "machine": the_machine,
        "matmul_gflops": gflops,
        "read_gbps": gbps,
        "bound_tokens_per_s": bound,
        "peers": [
            {**{k: v for k, v in asdict(p).items() if k != "output_ids"},
             "output_throughput": p.output_throughput,
             "ratio_ours_over_peer": (ours.output_throughput / p.output_throughput
                                      if p.output_throughput else None),
             "agreement": agreements.get(p.name)}
            for p in peers
        ],
    }  # fmt: skip


def vllm_peer(
    python: str,
    source: ModelSource,
    requests: list[BenchRequest],
    batch: int | None,
    env: dict[str, str] | None,
) -> PeerResult:
    """vLLM on the model as a Hugging Face folder (a GGUF file converted once, here)."""
    try:
        folder = hf_folder(source, load_settings().cache_dir)
    except (ValueError, OSError) as e:
        return PeerResult(name="vLLM", error=f"no Hugging Face folder of the model: {e}")
    return run_vllm_peer(python, str(folder), requests, batch, env=env)


def measure_perplexity(source: ModelSource) -> dict[str, float]:
    from spillway.services.cli.bench.quality import perplexity_lines
    from spillway.services.worker.quality import perplexities

    ids = _tokenizer(source).encode(TEXT, add_special_tokens=False)
    results = perplexities(source, ids)
    print(perplexity_lines(results, len(ids)))
    return results


def _this_python_if(module: str) -> str | None:
    return sys.executable if importlib.util.find_spec(module) is not None else None


@dataclass(frozen=True)
class Work:
    """What one request asks of the machine: its matrix products' arithmetic, attention's
    arithmetic, and the bytes of keys and values attention reads from memory."""

    matmul_flops: float
    attention_flops: float
    attention_bytes: float

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.attention_flops


def work_of_request(config: ModelConfig, prompt_len: int, new_tokens: int) -> Work:
    """Every token through the projections and attention, the lm_head only for the tokens
    that sample (the last prompt token and each new one). Attention's reads are float32 keys
    and values: the prompt's once (its prefill attends in cache), then, for each token fed
    back, every key and value before it once for its whole query group."""
    c = config
    qkv = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_layer = (
        qkv + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * (c.intermediate_size)
    )
    tokens = prompt_len + new_tokens - 1
    projections = 2.0 * c.num_layers * per_layer * tokens
    lm_head = 2.0 * c.vocab_size * c.hidden_size * new_tokens
    # Position i attends to i + 1 keys: QK^T and PV, 2 FLOPs per multiply-add each.
    attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * (tokens * (tokens + 1) / 2)
    # Decode positions prompt_len .. tokens - 1 read positions + 1 keys each.
    decode_reads = (tokens * (tokens + 1) - prompt_len * (prompt_len + 1)) / 2
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    return Work(projections + lm_head, attention, per_token * (prompt_len + decode_reads))


def flops_per_request(config: ModelConfig, prompt_len: int, new_tokens: int) -> float:
    return work_of_request(config, prompt_len, new_tokens).flops


def bound_tokens_per_s(
    config: ModelConfig, requests: list[BenchRequest], gflops: float, gbps: float | None = None
) -> float:
    """The float32 bound: the matrix products at `gflops`, attention at the slower of its
    arithmetic and its key and value reads at `gbps` (the arithmetic alone without it).
    Pieces run one after another, as a step's kernels do, so their times add."""
    works = [work_of_request(config, len(r.prompt_ids), r.max_tokens) for r in requests]
    matmul = sum(w.matmul_flops for w in works) / (gflops * 1e9)
    attention = sum(w.attention_flops for w in works) / (gflops * 1e9)
    if gbps:
        attention = max(attention, sum(w.attention_bytes for w in works) / (gbps * 1e9))
    return sum(r.max_tokens for r in requests) / (matmul + attention)


def launch_args(given: str, model: str) -> list[str]:
    """`spillway up`'s arguments for the launched system: the bench's `--model` (what the
    prompts and the peers are made from) unless `--launch-args` names another, so that
    both sides serve the same weights."""
    extra = shlex.split(given)
    named = any(a == "--model" or a.startswith("--model=") for a in extra)
    return extra if named else ["--model", model, *extra]


class Launched:
    """A fresh system (`spillway up`) on private NATS and Redis, for one run."""

    NAMESPACE = "bench"

    def __init__(self, system, servers, nats_url: str) -> None:
        self.system = system
        self.servers = servers
        self.nats_url = nats_url
        self.namespace = self.NAMESPACE
        self.url = system.url

    @classmethod
    def start(cls, extra_args: list[str]) -> Launched:
        from spillway.services.cli.launcher import System
        from spillway.services.cli.servers import start_nats, start_redis

        servers = [start_nats(), start_redis()]
        try:
            print("starting a spillway system ...", flush=True)
            started = time.perf_counter()
            system = System(
                "--namespace", cls.NAMESPACE, "--nats-url", servers[0].url,
                "--redis-url", servers[1].url, *extra_args,
            )  # fmt: skip
        except Exception:
            for s in servers:
                s.stop()
            raise
        print(f"system ready at {system.url} in {time.perf_counter() - started:.0f} s", flush=True)
        return cls(system, servers, servers[0].url)

    def stop(self) -> None:
        try:
            self.system.stop()
        finally:
            for s in self.servers:
                s.stop()

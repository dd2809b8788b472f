"""The options of `spillway bench` (CONTRACT section 6, plus the project's own)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from spillway.services.cli.bench.workload import DATASETS
from spillway.shared.config import DEFAULT_MODEL

DEFAULT_URL = "http://127.0.0.1:8000"


def add_bench_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"the server's base URL (default: {DEFAULT_URL})")
    p.add_argument(
        "--launch",
        action="store_true",
        help="start a fresh spillway system for the run instead of using --url",
    )
    p.add_argument(
        "--launch-args",
        default="",
        help="options for the launched `spillway up`, e.g. '--dtype float32'",
    )
    p.add_argument("--requests", type=int, default=64, help="requests to send (default: 64)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: no cap)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: inf, all at once)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="new tokens (default: 128)")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn from [len*(1-r), len*(1+r)] (default: 0)",
    )
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default="random",
        help="random token ids, or windows of a fixed English text (default: random)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the served model's files: its tokenizer makes the prompts and the "
        f"peers load its weights (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` field of each request (default: the server's first model)",
    )
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--compare",
        action="store_true",
        help="run the workload through transformers (and llama.cpp when "
        "installed, vLLM with --vllm) in the same run and print the ratios",
    )
    p.add_argument(
        "--perplexity",
        action="store_true",
        help="also measure perplexity of a fixed text in float32 and in int8, each also over a "
        "bfloat16 KV cache (the worker's "
        "model code, in this process)",
    )
    p.add_argument(
        "--peer-batch",
        type=int,
        default=None,
        help="the peers' static batch size (default: the concurrency, else all)",
    )
    p.add_argument(
        "--llama-cpp-python",
        default=None,
        help="a Python with llama-cpp-python installed (default: this one, if it has)",
    )
    p.add_argument(
        "--llama-cpp-model",
        default=None,
        help="the GGUF file llama.cpp runs (default: --model when it is a GGUF)",
    )
    p.add_argument(
        "--vllm",
        default=None,
        metavar="PYTHON",
        help="a Python with vLLM's CPU build installed: vLLM joins the peers, on the "
        "model as a Hugging Face folder (a GGUF file is converted once, in float32)",
    )
    p.add_argument(
        "--nats-url",
        default=None,
        help="the system's NATS, to read the scheduler's step split (with --url)",
    )
    p.add_argument("--namespace", default="", help="the system's namespace (with --nats-url)")


# fmt: skip

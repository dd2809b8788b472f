"""The same workload through the engines users would run instead, in the same run.

- transformers: static batched `generate` (greedy, every request of a batch generating
  its batch's longest output), on the very weights the server loads, by this Python in a
  process of its own (`transformers_peer.py`: its OpenMP threads wait as a user's would).
- llama.cpp (`llama-cpp-python`) and vLLM (its CPU build): optional, each in its own
  Python environment (never a dependency of spillway); the peer's script beside this
  module runs there as a subprocess, reads the workload as JSON on stdin and answers JSON
  on stdout.

Each peer returns its generated token ids per request, so that the bench can check that
greedy outputs agree, and its wall time for the throughput.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spillway.services.cli.bench.workload import BenchRequest
from spillway.shared.model_files import ModelSource

PEER_SCRIPTS = {
    "llama.cpp": Path(__file__).with_name("llama_cpp_peer.py"),
    "vLLM": Path(__file__).with_name("vllm_peer.py"),
}
# Peers run as modules of the installed package (they import spillway), by this Python;
# -P keeps the working directory off sys.path (a checkout's kernels/ would shadow Hugging
# Face's `kernels`, which transformers imports).
PEER_MODULES = {"transformers": "spillway.services.cli.bench.transformers_peer"}


@dataclass
class PeerResult:
    name: str
    input_tokens: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    output_ids: list[list[int]] = field(default_factory=list)  # per request, in order
    note: str = ""
    error: str | None = None

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def batches(requests: Sequence[BenchRequest], size: int | None) -> list[list[BenchRequest]]:
    size = size or len(requests)
    return [list(requests[i : i + size]) for i in range(0, len(requests), size)]


def transformers_name(dtype: str) -> str:
    return f"transformers generate ({dtype})"


def run_transformers(
    source: ModelSource,
    requests: Sequence[BenchRequest],
    batch_size: int | None = None,
    dtype: str = "float32",
    threads: int | None = None,
) -> PeerResult:
    """transformers' static batched greedy `generate`, `batch_size` requests at a time
    (all at once when None), prompts left-padded. Counts only each request's own tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if threads:
        torch.set_num_threads(threads)
    result = PeerResult(name=transformers_name(dtype))
    if source.kind not in ("gguf", "hf"):
        result.error = "transformers cannot load a synthetic model"
        return result
    folder = source.path.parent if source.kind == "gguf" else source.path
    extra = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    # Its GGUF conversion draws a progress bar of its own; the bench's output stays a table.
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=getattr(torch, dtype), **extra
        )
    model = model.eval()
    outputs: dict[int, list[int]] = {}
    with torch.inference_mode():
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)  # warm up
        start = time.perf_counter()
        for group in batches(requests, batch_size):
            longest = max(len(r.prompt_ids) for r in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros(len(group), longest, dtype=torch.long)
            for i, r in enumerate(group):
                ids[i, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
                mask[i, longest - len(r.prompt_ids) :] = 1
            new = max(r.max_tokens for r in group)
            config = GenerationConfig(
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
                eos_token_id=None,
            )
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            for i, r in enumerate(group):
                outputs[r.index] = out[i, longest : longest + r.max_tokens].tolist()
        result.duration_s = time.perf_counter() - start
    result.output_ids = [outputs[r.index] for r in requests]
    result.input_tokens = sum(len(r.prompt_ids) for r in requests)
    result.output_tokens = sum(len(ids) for ids in result.output_ids)
    result.note = f"static batches of {batch_size or len(requests)}"
    return result


def run_transformers_peer(
    source: ModelSource,
    requests: Sequence[BenchRequest],
    batch_size: int | None = None,
    env: dict[str, str] | None = None,
) -> PeerResult:
    """`run_transformers` (float32) by this Python in a process of its own, under `env` (the
    environment the bench started in: transformers_peer.py says why)."""
    if source.kind not in ("gguf", "hf"):
        return run_transformers(source, requests, batch_size)  # its refusal, no process
    result = run_subprocess_peer(
        "transformers", sys.executable, str(source.path), requests, batch_size, env=env
    )
    result.name = transformers_name("float32")
    return result


def run_subprocess_peer(
    name: str,
    python: str,
    model_path: str,
    requests: Sequence[BenchRequest],
    batch_size: int | None = None,
    threads: int | None = None,
    timeout_s: float = 3600.0,
    env: dict[str, str] | None = None,
    extra: dict[str, object] | None = None,
) -> PeerResult:
    """Runs the peer script (or module: PEER_MODULES) of `name` under `python` (`env`: its
    process environment; None: this process's; `extra`: more fields of the spec)."""
    spec = {
        "model": model_path,
        "prompts": [list(r.prompt_ids) for r in requests],
        "max_tokens": [r.max_tokens for r in requests],
        "batch_size": batch_size or len(requests),
        "threads": threads,
        **(extra or {}),
    }
    result = PeerResult(name=name)
    try:
        done = subprocess.run(
            [python, "-P", "-m", PEER_MODULES[name]]
            if name in PEER_MODULES
            else [python, str(PEER_SCRIPTS[name])],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        result.error = f"exit code {done.returncode}: {' | '.join(tail)}"
        return result
    answer = json.loads(lines[-1])
    result.output_ids = answer["output_ids"]
    result.duration_s = answer["duration_s"]
    result.note = answer.get("note", "")
    result.input_tokens = sum(len(r.prompt_ids) for r in requests)
    result.output_tokens = sum(len(ids) for ids in result.output_ids)
    return result


def agreement(ours: Sequence[str], theirs: Sequence[str]) -> tuple[int, float]:
    """How many outputs are identical, and the mean fraction of characters that agree
    before the first difference (1.0 where identical)."""
    same, prefix = 0, 0.0
    for a, b in zip(ours, theirs, strict=True):
        if a == b:
            same += 1
            prefix += 1.0
            continue
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        prefix += n / max(len(a), len(b), 1)
    return same, prefix / max(len(ours), 1)


# A process killed by SIGSEGV or SIGILL (subprocess reports the signal as a negative exit
# code): llama.cpp's AMX-repacked weights have died both ways on Sapphire Rapids Xeons.
CRASHED = ("exit code -11", "exit code -4")


def run_llama_cpp_peer(
    python: str,
    model_path: str,
    requests: Sequence[BenchRequest],
    batch_size: int | None = None,
    env: dict[str, str] | None = None,
) -> PeerResult:
    """llama.cpp as it comes; where it crashes, again without its extra buffer types (the
    weights repacked for AMX or other kernels at load: llama-cpp-python 0.3.36's AMX
    buffers crashed in `llama_decode` on Sapphire Rapids Xeons, with SIGSEGV or SIGILL),
    said in its note."""
    result = run_subprocess_peer("llama.cpp", python, model_path, requests, batch_size, env=env)
    if result.error is None or not result.error.startswith(CRASHED):
        return result
    again = run_subprocess_peer(
        "llama.cpp", python, model_path, requests, batch_size, env=env,
        extra={"extra_bufts": False},
    )  # fmt: skip
    if again.error is None:
        signal = "SIGILL" if result.error.startswith("exit code -4") else "SIGSEGV"
        again.note += f"; extra buffer types (AMX repacking) off: it died of {signal} with them"
    return again


def run_vllm_peer(
    python: str,
    folder: str,
    requests: Sequence[BenchRequest],
    batch_size: int | None = None,
    env: dict[str, str] | None = None,
) -> PeerResult:
    """vLLM's offline `LLM.generate` on the Hugging Face `folder`, in float32: the math of
    our exact mode (vLLM's CPU build computes in bfloat16 or float32)."""
    return run_subprocess_peer(
        "vLLM", python, folder, requests, batch_size, env=env, extra={"dtype": "float32"}
    )

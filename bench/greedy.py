"""What the model benchmarks (`bench.moe`, `bench.hybrid`, `bench.hybrid_prefill`) share:
a random model of a family saved where the runner loads it, greedy sequences through the
runner step by step, and transformers' `generate` of the same batch."""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from spillway.services.worker.loading import load_runner
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

GREEDY = SamplingParams(temperature=0.0)


def save_model(folder: Path, family: str, config: dict):
    """A random model of `family` (transformers config keywords `config`) saved in
    `folder`; transformers' own copy, loaded back from there in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config)).eval()
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def prefill_plan(
    runner: ModelRunner, prompts: list[list[int]], tokens: int, stride: int | None
) -> StepPlan:
    """Ends the runner's sequences (step 0); then step 1's plan: each prompt a new greedy
    sequence with blocks for `tokens` tokens, prefilled in one row, row i in state slot
    i * stride (None: a model without recurrent state)."""
    bs = runner.block_size
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    per_seq = (tokens + bs - 1) // bs
    new_seqs = [
        NewSequence(seq_id=f"s{i}", sampling=GREEDY,
                    state_slot=None if stride is None else i * stride,
                    block_ids=list(range(i * per_seq, (i + 1) * per_seq)))
        for i in range(len(prompts))
    ]  # fmt: skip
    rows = [
        StepRow(seq_id=f"s{i}", token_ids=p, start_pos=0, sample=True, output_index=0)
        for i, p in enumerate(prompts)
    ]
    return StepPlan(step_id=1, new_seqs=new_seqs, rows=rows)


def runner_generate(
    runner: ModelRunner, prompts: list[list[int]], new: int, stride: int | None = None
) -> tuple[list[list[int]], float]:
    """All rows prefilled in one step, then one decode step per token (`prefill_plan`'s
    slots); the tokens and the decode steps' seconds."""
    outputs: list[list[int]] = [[] for _ in prompts]
    plan = prefill_plan(runner, prompts, len(prompts[0]) + new, stride)
    decode_start = 0.0
    for step in range(new):
        if step == 1:
            decode_start = time.perf_counter()
        result = runner.execute(plan)
        if result.error is not None:
            raise SystemExit(result.error.message)
        for i, row in enumerate(result.rows):
            outputs[i].append(row.token_id)
        plan = StepPlan(
            step_id=step + 2,
            rows=[
                StepRow(seq_id=f"s{i}", token_ids=[out[-1]], start_pos=len(p) + step,
                        sample=True, output_index=step + 1)
                for i, (p, out) in enumerate(zip(prompts, outputs, strict=True))
            ],
        )  # fmt: skip
    return outputs, time.perf_counter() - decode_start


def hf_generate(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


# size: (the shapes' config keywords, each family's own), as `model_config` joins them
Sizes = dict[str, tuple[dict, dict[str, dict]]]


def model_config(sizes: Sizes, family: str, size: str = "tiny") -> dict:
    """The transformers config keywords of `family` at `size`."""
    shapes, families = sizes[size]
    return {**shapes, **families[family]}


def parser(doc: str | None, sizes: Sizes, default: str) -> argparse.ArgumentParser:
    """The options of a generate benchmark: the model, the batch, the rounds."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--family", default=default, choices=sorted(sizes["tiny"][1]))
    p.add_argument("--size", default="tiny", choices=sorted(sizes))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, help="math threads (default: every core)")
    p.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="float32 weights, or int8 projections and experts")  # fmt: skip
    p.add_argument(
        "--vllm", metavar="PYTHON",
        help="a Python with vLLM's CPU build: its offline generate of the same batch, float32",
    )  # fmt: skip
    return p


def vllm_lines(
    python: str,
    reference,
    prompts: list[list[int]],
    new: int,
    ours: list | None,
    ours_rate: float,
    ratio_label: str,
) -> str:
    """vLLM's generate of the batch (all rows at once) on the reference's saved folder, in
    its own process: its printed line, and where it ran, the ratio of `ours_rate` to it."""
    from spillway.services.cli.bench.peers import run_vllm_peer
    from spillway.services.cli.bench.workload import BenchRequest

    requests = [BenchRequest(i, tuple(p), new, 0.0) for i, p in enumerate(prompts)]
    result = run_vllm_peer(python, reference.name_or_path, requests, len(prompts))
    if result.error is not None:
        return f"  vLLM                  failed: {result.error}"
    rate = len(prompts) * new / result.duration_s
    same = sum(a == b for a, b in zip(ours or [], result.output_ids, strict=False))
    return (
        f"  vLLM generate         {rate:8.1f} tok/s   greedy sequences equal to ours:"
        f" {same}/{len(prompts)}   ({result.note})\n  {ratio_label} {ours_rate / rate:8.2f}x"
    )  # fmt: skip


def setup(args: argparse.Namespace, sizes: Sizes, **settings):
    """The saved model of `args.family` at `args.size` as the runner loads it (float32 on
    the CPU, blocks for every row; `settings` on top) and as transformers does, and the
    batch's random prompts."""
    config = model_config(sizes, args.family, args.size)
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{args.family}-"))
    reference = save_model(folder, args.family, config)
    blocks = args.batch * ((args.prompt + args.new) // 16 + 1) + 1
    runner, _ = load_runner(
        load_settings(
            model=str(folder), kv_blocks=blocks, device="cpu", dtype="float32",
            threads=args.threads, quantize=getattr(args, "quantize", "none"), **settings,
        )
    )  # fmt: skip
    rng = random.Random(0)
    vocab = config["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]
    return runner, reference, prompts


def headline(args: argparse.Namespace) -> str:
    return (
        f"{args.family} ({args.size}): batch {args.batch}, prompt {args.prompt},"
        f" {args.new} new tokens, {torch.get_num_threads()} threads, float32 CPU"
        + (" (int8 projections and experts)" if getattr(args, "quantize", "none") == "int8" else "")
    )

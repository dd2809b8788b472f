"""Hybrid prefill: one long prompt (Granite 4.0-H or Qwen3-Next at a mid size) through the
worker's runner against transformers' forward of the same prompt on the same weights, in
the same run.

    python -m bench.hybrid_prefill [--family granitemoehybrid|qwen3_next|both]
                                   [--prompts 4096x1 128x16] [--rounds 3] [--threads N]
                                   [--torch-scans] [--profile] [--ops N]
                                   [--quantize int8]

Saves a random model of the family (hidden 512, 8 layers: three recurrent layers to one
attention layer, attention at layers 3 and 7; 32 experts, top 4; float32), then per shape
LxR (R prompts of L tokens) and round: the runner's prefill step (every row in one step,
as `bench.hybrid` builds its runner, states from zero) and transformers' forward of the
[R, L] batch with `use_cache=True` and `logits_to_keep=1`, as `generate` runs its
prefill. One untimed pass of each goes first; rounds alternate which runs first. Prints
each side's median ms, the ratio, the largest difference of the last logits, and asserts
the greedy next tokens are equal.

`--torch-scans` also times the runner with the recurrent layers' torch forms (the native
prefill kernels of `kernels.cpu.chunk_scan` off: the path before them), in the same rounds.
`--quantize int8` runs the runner in the int8 mode (projections and experts on int8
weights; the outputs move, so the greedy tokens are not compared).
`--profile` adds, from one more untimed pass of each side, the time per layer kind
(recurrent mixer, attention, MoE / MLP, the rest); `--ops` the top torch.profiler ops.
Float32 on the CPU; the machines are shared and noisy: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.greedy import prefill_plan, save_model
from spillway.services.worker.loading import load_runner
from spillway.services.worker.models import hybrid as hybrid_model
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings

SHAPES = dict(
    vocab_size=4096, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=8192, tie_word_embeddings=False,
    initializer_range=0.2, rms_norm_eps=1e-6, num_hidden_layers=8,
)  # fmt: skip
MAMBA, ATTN = "mamba", "attention"
LINEAR, FULL = "linear_attention", "full_attention"
FAMILY = {
    "granitemoehybrid": dict(
        layer_types=[MAMBA, MAMBA, MAMBA, ATTN] * 2, position_embedding_type="rope",
        num_local_experts=32, num_experts_per_tok=4, intermediate_size=256,
        shared_intermediate_size=512, mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
    ),
    "qwen3_next": dict(
        layer_types=[LINEAR, LINEAR, LINEAR, FULL] * 2, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=256, shared_expert_intermediate_size=512,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
    ),
}  # fmt: skip


def runner_prefill(runner: ModelRunner, prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Every prompt in one prefill step (rows in slots 0..R-1, fresh states): the last
    logits [R, V] and the sampled tokens."""
    plan = prefill_plan(runner, prompts, max(len(p) for p in prompts) + 1, stride=1)
    captured: list[torch.Tensor] = []
    logits = runner.logits

    def keep(batch):
        out = logits(batch)
        captured.append(out)
        return out

    runner.logits = keep  # type: ignore[method-assign]
    try:
        result = runner.execute(plan)
    finally:
        del runner.logits
    if result.error is not None:
        raise SystemExit(result.error.message)
    return captured[-1].float(), [row.token_id for row in result.rows]


def hf_prefill(model, prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """transformers' prefill as `generate` runs it: a fresh cache, the last logits only."""
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
    last = out.logits[:, -1].float()
    return last, last.argmax(-1).tolist()


class KindTimers:
    """Seconds per layer kind, summed over one pass."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, kind: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start

        return timed

    def hooks(self, kind: str, module: torch.nn.Module) -> list:
        starts: list[float] = []

        def pre(_module, _args):
            starts.append(time.perf_counter())

        def post(_module, _args, _out):
            self.seconds[kind] += time.perf_counter() - starts.pop()

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


@contextmanager
def our_timers(runner: ModelRunner) -> Iterator[KindTimers]:
    """Times the worker's mixers, attention and feed-forward by wrapping what
    `HybridModel.forward` calls."""
    timers = KindTimers()
    model = runner.model
    saved = {n: getattr(hybrid_model, n) for n in ("mamba2_mixer", "gated_delta_mixer")}
    for name, fn in saved.items():
        setattr(hybrid_model, name, timers.wrap("mixer", fn))
    model.attention.forward = timers.wrap("attention", model.attention.forward)  # type: ignore[attr-defined]
    model._feed_forward = timers.wrap("moe/mlp", model._feed_forward)  # type: ignore[attr-defined]
    try:
        yield timers
    finally:
        for name, fn in saved.items():
            setattr(hybrid_model, name, fn)
        del model.attention.forward, model._feed_forward  # type: ignore[attr-defined]


@contextmanager
def their_timers(model) -> Iterator[KindTimers]:
    timers = KindTimers()
    handles = []
    for layer in model.model.layers:
        for attr, kind in (("mamba", "mixer"), ("linear_attn", "mixer"), ("self_attn", "attention"),
                           ("block_sparse_moe", "moe/mlp"), ("shared_mlp", "moe/mlp"),
                           ("mlp", "moe/mlp")):  # fmt: skip
            module = getattr(layer, attr, None)
            if isinstance(module, torch.nn.Module):
                handles += timers.hooks(kind, module)
    try:
        yield timers
    finally:
        for handle in handles:
            handle.remove()


def breakdown(timers: KindTimers, total: float) -> str:
    parts = [f"{k} {v * 1e3:.0f}" for k, v in sorted(timers.seconds.items())]
    rest = total - sum(timers.seconds.values())
    return ", ".join([*parts, f"rest {rest * 1e3:.0f}"]) + " ms"


def profile_ops(fn: Callable[[], object], top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def bench_family(family: str, args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix=f"bench-prefill-{family}-"))
    reference = save_model(folder, family, {**SHAPES, **FAMILY[family]})
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.prompts]
    most_rows = max(r for _, r in shapes)
    blocks = sum(r * (length // 16 + 2) for length, r in shapes) + 1
    settings = load_settings(
        model=str(folder), kv_blocks=blocks, device="cpu", dtype="float32",
        state_slots=most_rows, state_snapshots=0, threads=args.threads,
        max_model_len=SHAPES["max_position_embeddings"], quantize=args.quantize,
    )  # fmt: skip
    runner, _ = load_runner(settings)
    print(f"{family}: hidden {SHAPES['hidden_size']}, {SHAPES['num_hidden_layers']} layers"
          f" ({'/'.join(t[:4] for t in FAMILY[family]['layer_types'])}), 32 experts top 4,"
          f" float32 CPU{' (int8 projections and experts)' if args.quantize == 'int8' else ''},"
          f" {torch.get_num_threads()} threads, median of {args.rounds}")  # fmt: skip
    ops = runner.model.ops
    scans = getattr(ops, "scans", None)
    if args.torch_scans and scans is None:
        raise SystemExit("--torch-scans: the native prefill kernels are not in use here")
    torch_col = " torch scans ms | ratio |" if args.torch_scans else ""
    print(f"| prompts | spillway ms | transformers ms | ratio |{torch_col}"
          " max abs diff (last logits) |")  # fmt: skip
    print("| --- " * (6 if args.torch_scans else 4) + "| --- |")
    rng = random.Random(0)
    for length, rows in shapes:
        prompts = [[rng.randrange(3, SHAPES["vocab_size"]) for _ in range(length)]
                   for _ in range(rows)]  # fmt: skip
        sides = ["ours", "theirs", *(["torch"] if args.torch_scans else [])]
        times: dict[str, list[float]] = {side: [] for side in sides}
        outs: dict[str, tuple[torch.Tensor, list[int]]] = {}
        # One untimed pass each first: one-time costs (packing weights for many-row
        # products, allocator growth) are not what a served prefill pays.
        runner_prefill(runner, prompts)
        hf_prefill(reference, prompts)
        for r in range(args.rounds):
            for which in sides if r % 2 == 0 else sides[::-1]:
                ops.scans = None if which == "torch" else scans  # type: ignore[attr-defined]
                start = time.perf_counter()
                if which == "theirs":
                    outs[which] = hf_prefill(reference, prompts)
                else:
                    outs[which] = runner_prefill(runner, prompts)
                times[which].append(time.perf_counter() - start)
                ops.scans = scans  # type: ignore[attr-defined]
        ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
        diff = (outs["ours"][0] - outs["theirs"][0]).abs().max().item()
        torch_cells = (
            f" {ms['torch']:.0f} | {ms['theirs'] / ms['torch']:.2f}x |" if args.torch_scans else ""
        )
        print(f"| {rows} x {length} | {ms['ours']:.0f} | {ms['theirs']:.0f} |"
              f" {ms['theirs'] / ms['ours']:.2f}x |{torch_cells} {diff:.1e} |")  # fmt: skip
        if args.verbose:
            for side, t in times.items():
                print(f"  {side} rounds: {' '.join(f'{x * 1e3:.0f}' for x in t)} ms")
        for side in sides[2:]:
            assert outs[side][1] == outs["theirs"][1], (side, outs[side][1], outs["theirs"][1])
        if args.quantize == "none":
            assert outs["ours"][1] == outs["theirs"][1], (outs["ours"][1], outs["theirs"][1])
        if args.profile:
            with our_timers(runner) as timers:
                start = time.perf_counter()
                runner_prefill(runner, prompts)
                print(f"  spillway     {breakdown(timers, time.perf_counter() - start)}")
            with their_timers(reference) as timers:
                start = time.perf_counter()
                hf_prefill(reference, prompts)
                print(f"  transformers {breakdown(timers, time.perf_counter() - start)}")
        if args.ops:
            print(profile_ops(lambda p=prompts: runner_prefill(runner, p), args.ops))
            print(profile_ops(lambda p=prompts: hf_prefill(reference, p), args.ops))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="both", choices=[*sorted(FAMILY), "both"])
    parser.add_argument("--prompts", nargs="+", default=["4096x1"], help="LxR: R prompts of L")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="math threads (default: every core)")
    parser.add_argument(
        "--torch-scans",
        action="store_true",
        help="also time the runner with the recurrent layers' torch forms",
    )
    parser.add_argument("--quantize", default="none", choices=["none", "int8"])
    parser.add_argument("--profile", action="store_true", help="time per layer kind")
    parser.add_argument("--verbose", action="store_true", help="every round's time")
    parser.add_argument("--ops", type=int, default=0, help="top N torch.profiler ops")
    args = parser.parse_args()
    for family in sorted(FAMILY) if args.family == "both" else [args.family]:
        bench_family(family, args)


if __name__ == "__main__":
    main()

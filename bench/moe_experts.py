"""The CPU MoE experts against the reference and transformers' experts module, same weights:

    python -m bench.moe_experts [--threads 2] [--repeats 20] [--dtype float32] [--stat min]
                                [--int8] [--mid]

For T in {1, 4, 64, 512} tokens and two layer shapes (E=8 experts / top-2 and E=64 / top-8,
at small widths), prints the median milliseconds of `CpuOps.fused_experts` (ours),
`kernels.moe.fused_experts_ref`, and transformers' `Qwen3MoeExperts` run by its eager loop
and by its `grouped_mm` implementation, then the ratios of each to ours (> 1: ours is
faster). Routing is random top-k over softmaxed scores, fresh per shape. The candidates
take turns within each round; on a machine others share, `--stat min` (the best round of
each) is steadier than the median.

`--int8` adds the int8 mode's experts (`CpuOps(quantize="int8")`: int8 weights, each layer
projection's groups in one native call) and their ratio to ours; their relative error is
the quantization's. `--mid` times the mid-size MoE of `bench.moe --size mid` instead (E=32
top-4, hidden 512, expert intermediate 256) at 16, 64, 512 and 2,048 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.moe import fused_experts_ref

TOKENS = (1, 4, 64, 512)
# (experts, top-k, hidden, expert intermediate)
SHAPES = ((8, 2, 256, 512), (64, 8, 256, 128))
MID_TOKENS, MID_SHAPES = (16, 64, 512, 2048), ((32, 4, 512, 256),)


def time_ms(
    candidates: dict[str, Callable[[], object]], repeats: int, stat: str = "median"
) -> dict[str, float]:
    """Milliseconds of each candidate over `repeats` rounds (their median, or their min),
    one call of each per round, so that a busy neighbour slows them all alike."""
    for fn in candidates.values():
        fn()  # warm-up: native builds, allocator
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    pick = statistics.median if stat == "median" else min
    return {name: pick(t) * 1e3 for name, t in times.items()}


def transformers_experts(
    w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, implementation: str
) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, two_i, h = w_gate_up.shape
    config = Qwen3MoeConfig(
        hidden_size=h,
        moe_intermediate_size=two_i // 2,
        num_experts=e,
        num_experts_per_tok=top_k,
        hidden_act="silu",
    )
    config._experts_implementation = implementation
    module = Qwen3MoeExperts(config).to(w_gate_up.dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(w_gate_up)
        module.down_proj.copy_(w_down)
    return module.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--stat", default="median", choices=["median", "min"])
    parser.add_argument("--int8", action="store_true", help="the int8 mode's experts too")
    parser.add_argument("--mid", action="store_true", help="the mid-size MoE's layer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ops = CpuOps()
    int8 = CpuOps(quantize="int8") if args.int8 else None
    shapes, tokens = (MID_SHAPES, MID_TOKENS) if args.mid else (SHAPES, TOKENS)
    print(f"{args.threads} threads, {args.dtype}, {args.stat} of {args.repeats} (ms)")
    header = (
        f"{'E/K':>5} {'H/I':>9} {'T':>4} {'ours':>8} {'ref':>8} {'tf eager':>9} {'tf grouped':>11}"
    )
    int8_header = "  int8 ours/int8  int8 rel. error" if int8 else ""
    print(header + "   ref/ours  eager/ours  grouped/ours  ours' rel. error" + int8_header)
    for e, k, h, i in shapes:
        gen = torch.Generator().manual_seed(0)
        w_gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
        w_down = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
        eager = transformers_experts(w_gate_up, w_down, k, "eager")
        grouped = transformers_experts(w_gate_up, w_down, k, "grouped_mm")
        if int8 is not None:
            int8.fused_experts.warm(w_gate_up, w_down, 16)
        for t in tokens:
            x = torch.randn(t, h, generator=gen).to(dtype)
            weights, ids = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k)
            weights = weights / weights.sum(-1, keepdim=True)
            inputs = (x, w_gate_up, w_down, ids, weights)
            candidates = {
                "ours": partial(ops.fused_experts, *inputs),
                "ref": partial(fused_experts_ref, *inputs),
                "eager": partial(eager, x, ids, weights),
                "grouped": partial(grouped, x, ids, weights),
            }
            if int8 is not None:
                candidates["int8"] = partial(int8.fused_experts, *inputs)
            with torch.inference_mode():
                ms = time_ms(candidates, args.repeats, args.stat)
                expected = fused_experts_ref(*inputs).double()
                err = float((ops.fused_experts(*inputs).double() - expected).norm())
                err /= float(expected.norm())
                int8_cells = ""
                if int8 is not None:
                    got = int8.fused_experts(*inputs).double()
                    int8_err = float((got - expected).norm() / expected.norm())
                    int8_cells = (
                        f" {ms['int8']:5.3f} {ms['ours'] / ms['int8']:9.2f} {int8_err:16.1e}"
                    )
            ours, ref, tf_eager, tf_grouped = (ms[n] for n in ("ours", "ref", "eager", "grouped"))
            print(
                f"{e:>2}/{k:<2} {h:>4}/{i:<4} {t:>4} {ours:8.3f} {ref:8.3f} {tf_eager:9.3f} "
                f"{tf_grouped:11.3f}   {ref / ours:8.2f}  {tf_eager / ours:10.2f}  "
                f"{tf_grouped / ours:12.2f}  {err:16.1e}{int8_cells}",
                flush=True,
            )


if __name__ == "__main__":
    main()

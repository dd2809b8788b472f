"""Kernel benchmark: checks each operation once against an independent torch computation,
then times it. Run `python -m bench.kernels [--out FILE]`.

On CUDA the Triton backend is measured at serving sizes and each memory-bound kernel's
achieved bandwidth is set against a plain device-to-device copy, the practical ceiling. On
CPU the torch backend runs at small sizes, so the script stays exercised where there is no
GPU. Figures are printed as a table and written as JSON (default bench-results/kernels.json).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from spillway.kernels.moe import fused_experts_ref
from spillway.kernels.ops import KernelOps, select_ops
from spillway.kernels.rotary import rope_cache

DEFAULT_OUT = Path("bench-results/kernels.json")
DECODE_TARGET = 0.7  # share of copy bandwidth decode attention should reach at batch 64, 4k


@dataclass
class Case:
    """One operation at one size: how to run it, how to check it, what it must move."""

    name: str
    shape: str
    run: Callable[[KernelOps], torch.Tensor]
    reference: Callable[[], torch.Tensor]  # an independent torch computation of run's result
    bytes_moved: int  # compulsory DRAM traffic: every input read once, every output written once
    flops: int = 0
    target: float | None = None  # share of copy bandwidth this case is expected to reach


@dataclass
class Result:
    name: str
    shape: str
    time_us: float
    gbps: float
    bw_fraction: float | None
    tflops: float | None
    rel_error: float
    ok: bool
    target: float | None = None
    meets_target: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# --- inputs -------------------------------------------------------------------------------


@dataclass
class Attn:
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def _paged(
    attn: Attn, q_lens: list[int], ctx: list[int], device: torch.device
) -> dict[str, torch.Tensor]:
    """Random paged inputs; each row owns whole blocks, dealt out in shuffled order."""
    bs = attn.block_size
    per_row = [math.ceil(c / bs) for c in ctx]
    width = max(per_row)
    order = torch.randperm(sum(per_row), device=device).int()
    tables = torch.zeros((len(ctx), width), dtype=torch.int32, device=device)
    start = 0
    for r, n in enumerate(per_row):
        tables[r, :n] = order[start : start + n]
        start += n
    cache_shape = (sum(per_row), bs, attn.kv_heads, attn.head_dim)
    starts = torch.tensor([0, *q_lens], device=device).cumsum(0).int()
    return {
        "q": torch.randn(
            (sum(q_lens), attn.q_heads, attn.head_dim), device=device, dtype=attn.dtype
        ),
        "k_cache": torch.randn(cache_shape, device=device, dtype=attn.dtype),
        "v_cache": torch.randn(cache_shape, device=device, dtype=attn.dtype),
        "block_tables": tables,
        "context_lens": torch.tensor(ctx, dtype=torch.int32, device=device),
        "query_start": starts,
    }


def _attention_reference(t: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """Causal attention row by row with explicit float32 math: shares no code with either
    backend's attention."""
    out = torch.empty(t["q"].shape, dtype=torch.float32, device=t["q"].device)
    starts, lens = t["query_start"].tolist(), t["context_lens"].tolist()
    bs, kv_heads = t["k_cache"].shape[1], t["k_cache"].shape[2]
    group = t["q"].shape[1] // kv_heads
    for r, ctx in enumerate(lens):
        blocks = t["block_tables"][r, : math.ceil(ctx / bs)].long()
        # keys, vals: [Hq, ctx, D]
        keys, vals = (
            t[c][blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, 1).transpose(0, 1)
            for c in ("k_cache", "v_cache")
        )
        q = t["q"][starts[r] : starts[r + 1]].float().transpose(0, 1)  # [Hq, n, D]
        n = q.shape[1]
        scores = q @ keys.transpose(1, 2) * scale  # [Hq, n, ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > q_pos, float("-inf"))
        out[starts[r] : starts[r + 1]] = (scores.softmax(-1) @ vals).transpose(0, 1)
    return out


def _kv_bytes(attn: Attn, ctx: list[int]) -> int:
    elem = torch.finfo(attn.dtype).bits // 8
    return 2 * sum(ctx) * attn.kv_heads * attn.head_dim * elem


def _attention_flops(attn: Attn, q_lens: list[int], ctx: list[int]) -> int:
    # two matmuls of 2 * D flops per (query, visible key) pair and head
    pairs = sum(n * c - n * (n - 1) // 2 for n, c in zip(q_lens, ctx, strict=True))
    return 4 * pairs * attn.q_heads * attn.head_dim


def decode_case(
    name: str, attn: Attn, rows: int, ctx: int, device: torch.device, target: float | None
) -> Case:
    t = _paged(attn, [1] * rows, [ctx] * rows, device)
    args = (t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["context_lens"])
    scale = attn.head_dim**-0.5
    q_bytes = 2 * t["q"].numel() * t["q"].element_size()  # q in, out back
    return Case(
        name=name,
        shape=f"B={rows} ctx={ctx} H={attn.q_heads}/{attn.kv_heads} D={attn.head_dim} "
        f"bs={attn.block_size} {str(attn.dtype).removeprefix('torch.')}",
        run=lambda ops: ops.paged_decode_attention(*args, scale, max_context_len=ctx),
        reference=lambda: _attention_reference(t, scale),
        bytes_moved=_kv_bytes(attn, [ctx] * rows) + q_bytes,
        flops=_attention_flops(attn, [1] * rows, [ctx] * rows),
        target=target,
    )


def attention_case(
    name: str, attn: Attn, q_lens: list[int], ctx: list[int], device: torch.device
) -> Case:
    t = _paged(attn, q_lens, ctx, device)
    args = (
        t["q"],
        t["k_cache"],
        t["v_cache"],
        t["block_tables"],
        t["context_lens"],
        t["query_start"],
        attn.head_dim**-0.5,
    )
    prefill = [n for n in q_lens if n > 1]
    return Case(
        name=name,
        shape=f"{len(prefill)} prefill x {max(prefill, default=0)} + "
        f"{len(q_lens) - len(prefill)} decode, ctx<={max(ctx)} "
        f"H={attn.q_heads}/{attn.kv_heads} D={attn.head_dim}",
        run=lambda ops: ops.paged_attention(*args, max_query_len=max(q_lens)),
        reference=lambda: _attention_reference(t, args[-1]),
        bytes_moved=_kv_bytes(attn, ctx) + 2 * t["q"].numel() * t["q"].element_size(),
        flops=_attention_flops(attn, q_lens, ctx),
    )


def store_kv_case(tokens: int, attn: Attn, device: torch.device) -> Case:
    kv_shape = (tokens, attn.kv_heads, attn.head_dim)
    k = torch.randn(kv_shape, device=device, dtype=attn.dtype)
    v = torch.randn(kv_shape, device=device, dtype=attn.dtype)
    blocks = math.ceil(tokens / attn.block_size) * 2
    cache_shape = (blocks, attn.block_size, attn.kv_heads, attn.head_dim)
    k_cache = torch.zeros(cache_shape, device=device, dtype=attn.dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(blocks * attn.block_size, device=device)[:tokens]

    def run(ops: KernelOps) -> torch.Tensor:
        ops.store_kv(k, v, k_cache, v_cache, slots)
        return k_cache.view(-1, attn.kv_heads, attn.head_dim)[slots]

    return Case(
        name="store_kv",
        shape=f"T={tokens} Hkv={attn.kv_heads} D={attn.head_dim}",
        run=run,
        reference=lambda: k,
        bytes_moved=4 * k.numel() * k.element_size() + slots.numel() * 8,
    )


def rms_norm_case(tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> Case:
    x = torch.randn((tokens, hidden), device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=device, dtype=dtype)
    # every run adds x into the residual again; the check runs first, on the pristine copy
    pristine = residual.clone()
    return Case(
        name="fused_add_rms_norm",
        shape=f"T={tokens} H={hidden}",
        run=lambda ops: ops.fused_add_rms_norm(x, residual, weight, 1e-5)[0],
        reference=lambda: _rms_norm_f64(x.double() + pristine.double(), weight.double()),
        bytes_moved=4 * x.numel() * x.element_size() + weight.numel() * weight.element_size(),
    )


def _rms_norm_f64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def rotary_case(tokens: int, attn: Attn, device: torch.device) -> Case:
    d = attn.head_dim
    q = torch.randn((tokens, attn.q_heads, d), device=device, dtype=attn.dtype)
    k = torch.randn((tokens, attn.kv_heads, d), device=device, dtype=attn.dtype)
    cos, sin = (c.to(device) for c in rope_cache(d, 8192, 500000.0))
    positions = torch.randint(0, 8192, (tokens,), device=device)
    q0 = q.clone()

    def run(ops: KernelOps) -> torch.Tensor:
        q.copy_(q0)  # in place: start each run from the same input
        ops.rotary(q, k, positions, cos, sin)
        return q

    def reference() -> torch.Tensor:
        # the same tables, applied as a complex multiplication in float64
        turn = torch.complex(cos[positions].double(), sin[positions].double())[:, None, :]
        z = torch.complex(q0[..., : d // 2].double(), q0[..., d // 2 :].double()) * turn
        return torch.cat((z.real, z.imag), dim=-1)

    elem = q.element_size()
    return Case(
        name="rotary",
        shape=f"T={tokens} H={attn.q_heads}/{attn.kv_heads} D={d}",
        run=run,
        reference=reference,
        bytes_moved=2 * (q.numel() + k.numel()) * elem + 2 * tokens * (d // 2) * 4,
    )


def experts_case(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, device
) -> Case:
    """A MoE layer's experts (`fused_experts`) under random top-k routing."""
    x = torch.randn((tokens, hidden), device=device, dtype=dtype)
    w_gate_up = (torch.randn((experts, 2 * inter, hidden), device=device) / hidden**0.5).to(dtype)
    w_down = (torch.randn((experts, hidden, inter), device=device) / inter**0.5).to(dtype)
    weights, ids = torch.topk(torch.rand((tokens, experts), device=device), top_k)
    weights = weights / weights.sum(-1, keepdim=True)
    active = int(torch.unique(ids).numel())
    return Case(
        name="fused_experts",
        shape=f"T={tokens} E={experts} K={top_k} H={hidden} I={inter}",
        run=lambda ops: ops.fused_experts(x, w_gate_up, w_down, ids, weights),
        reference=lambda: fused_experts_ref(
            x.double(), w_gate_up.double(), w_down.double(), ids, weights
        ),
        # every routed expert's weights read once, the tokens read and written once
        bytes_moved=active * 3 * hidden * inter * x.element_size()
        + 2 * x.numel() * x.element_size(),
        flops=2 * tokens * top_k * 3 * hidden * inter,
    )


def cases(device: torch.device) -> list[Case]:
    if device.type == "cuda":
        llama8b = Attn(32, 8, 128, 16, torch.bfloat16)
        small = Attn(9, 3, 64, 16, torch.bfloat16)
        return [
            store_kv_case(4096, llama8b, device),
            decode_case("decode_attention", llama8b, 64, 4096, device, DECODE_TARGET),
            decode_case("decode_attention", llama8b, 8, 16384, device, None),
            decode_case("decode_attention", small, 64, 2048, device, None),
            attention_case(
                "mixed_attention", llama8b, [512] + [1] * 63, [1024] + [2048] * 63, device
            ),
            attention_case("prefill_attention", llama8b, [1024] * 4, [2048] * 4, device),
            rms_norm_case(4096, 4096, torch.bfloat16, device),
            rotary_case(4096, llama8b, device),
            # a Qwen3-30B-A3B layer's experts: decode batches and a prefill chunk
            *(experts_case(t, 128, 8, 2048, 768, torch.bfloat16, device) for t in (1, 64, 4096)),
        ]
    # CPU: the sizes of a small model's step, kept small so the run takes seconds
    small = Attn(9, 3, 64, 16, torch.float32)
    return [
        store_kv_case(256, small, device),
        decode_case("decode_attention", small, 8, 512, device, None),
        attention_case("mixed_attention", small, [64, 1, 1, 1], [64, 300, 200, 100], device),
        attention_case("prefill_attention", small, [128, 128], [128, 256], device),
        rms_norm_case(64, 576, torch.float32, device),
        rotary_case(64, small, device),
        experts_case(64, 8, 2, 256, 512, torch.float32, device),
    ]


# --- measurement --------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_cuda(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _time_cuda(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _time_cpu(fn: Callable[[], object], budget_s: float = 0.5, max_reps: int = 50) -> float:
    fn()  # warm-up: first-call allocations and dispatch
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def timer_for(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of a call: Triton's do_bench on CUDA, a wall-clock loop elsewhere."""
    return _time_cuda if device.type == "cuda" else _time_cpu


def measure(case: Case, ops: KernelOps, device: torch.device, copy_gbps: float | None) -> Result:
    out = case.run(ops)
    ref = case.reference()
    rel = float((out.double() - ref.double()).norm() / ref.double().norm())
    tolerance = 1e-2 if out.dtype in (torch.bfloat16, torch.float16) else 1e-4
    ms = timer_for(device)(lambda: case.run(ops))
    gbps = case.bytes_moved / (ms * 1e-3) / 1e9
    fraction = gbps / copy_gbps if copy_gbps else None
    return Result(
        name=case.name,
        shape=case.shape,
        time_us=ms * 1e3,
        gbps=gbps,
        bw_fraction=fraction,
        tflops=case.flops / (ms * 1e-3) / 1e12 if case.flops else None,
        rel_error=rel,
        ok=rel < tolerance,
        target=case.target,
        meets_target=None if case.target is None or fraction is None else fraction >= case.target,
    )


def bench_kernels(device: torch.device, ops: KernelOps, copy_gbps: float | None) -> list[Result]:
    torch.manual_seed(0)
    return [measure(case, ops, device, copy_gbps) for case in cases(device)]


# Further sections plug in beside the kernels (the worker's whole decode step does, from
# `python -m bench.decode_step`): each takes (device, ops, copy_gbps) and returns
# rows for the table and the JSON file.
Section = Callable[[torch.device, KernelOps, float | None], list[Result]]
SECTIONS: dict[str, Section] = {"kernels": bench_kernels}


# --- report -------------------------------------------------------------------------------


def format_table(results: list[Result]) -> str:
    header = (
        f"{'kernel':<20} {'shape':<52} {'time us':>10} {'GB/s':>8} {'copy%':>6} "
        f"{'TFLOP/s':>8} {'rel err':>9}  check"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        pct = f"{100 * r.bw_fraction:5.1f}%" if r.bw_fraction is not None else "-"
        tflops = f"{r.tflops:8.2f}" if r.tflops is not None else "-"
        check = "ok" if r.ok else "FAIL"
        if r.target is not None and r.meets_target is not None:
            check += f", {'meets' if r.meets_target else 'MISSES'} {100 * r.target:.0f}% target"
        if r.extra.get("note"):
            check += f"; {r.extra['note']}"
        lines.append(
            f"{r.name:<20} {r.shape:<52} {r.time_us:10.1f} {r.gbps:8.1f} {pct:>6} "
            f"{tflops:>8} {r.rel_error:9.2e}  {check}"
        )
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main(
    argv: list[str] | None = None,
    sections: dict[str, Section] | None = None,
    prog: str = "python -m bench.kernels",
) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (CPU timings swing widely when threads outnumber free cores)",
    )
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ops = select_ops(args.backend, device)
    copy_gbps = copy_bandwidth(device) if device.type == "cuda" else None
    print(f"device: {device_name(device)}   backend: {ops.name}", end="")
    if device.type == "cpu":
        print(f"   threads: {torch.get_num_threads()}", end="")
    print(f"   copy bandwidth: {copy_gbps:.0f} GB/s" if copy_gbps else "")

    report: dict[str, Any] = {
        "device": device_name(device),
        "backend": ops.name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "copy_bandwidth_gbps": copy_gbps,
    }
    failed = False
    for section, bench in (sections or SECTIONS).items():
        results = bench(device, ops, copy_gbps)
        print(f"\n[{section}]\n{format_table(results)}")
        report[section] = [asdict(r) for r in results]
        failed |= not all(r.ok for r in results)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

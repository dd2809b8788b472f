"""The CPU path of the recurrent decode steps against the references and transformers:

    python -m bench.ssm_kernels [--threads 2] [--repeats 10] [--stat median] [--heads-div 1]
                                [--prefill]

For R in {1, 8, 64} decode rows and two models' layer shapes (Granite-4.0-H-tiny's Mamba2
mixer: conv over 3328 channels, 48 heads x 64 x state 128; Qwen3-Next's gated DeltaNet: conv
over 8192 channels, 16 key / 32 value heads of 128 x 128; `--heads-div` divides the head
counts and channels), prints the milliseconds of each step by

  ours      `CpuOps` with the rows in one run of slots (the pool's rows as a view)
  gather    `CpuOps` with the rows in every other slot (gathered and scattered back)
  ref       the `kernels.ssm_reference` reference (transformers' computation, by slot)
  hf        transformers' own torch function on the same states, handed over as a batch

then the ratios ref / ours and hf / ours (> 1: ours is faster). The state pool holds 2 R
slots, float32, like the worker's; inputs are float32.

`--prefill` (CUDA) times the prefill scans instead, at the same layer shapes: a step's
prefill rows of PREFILL_LENS tokens packed in the worker's chunks of 64, through the Triton
kernel (`kernels.ssd_chunk_scan`, `kernels.gated_delta_chunk`) and through the worker's
torch form on the same GPU (`ssd_scan`, `delta_scan`), and torch / kernel.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.moe_experts import time_ms
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.ssm_reference import (
    causal_conv1d_update_ref,
    gated_delta_rule_step_ref,
    selective_state_update_ref,
)

ROWS = (1, 8, 64)
GRANITE = {"channels": 48 * 64 + 2 * 128, "heads": 48, "head_dim": 64, "groups": 1, "state": 128}
QWEN3_NEXT = {"channels": 2 * 16 * 128 + 32 * 128, "k_heads": 16, "v_heads": 32, "dim": 128}


def _slots(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(one run, every other slot) in a pool of 2 * rows slots."""
    return torch.arange(rows), torch.arange(rows) * 2


def conv_candidates(rows: int, channels: int) -> dict[str, Callable[[], object]]:
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_update

    ops = CpuOps()
    run, scattered = _slots(rows)
    x = torch.randn(rows, channels)
    weight, bias = torch.randn(channels, 4), torch.randn(channels)
    pool = torch.randn(2 * rows, channels, 3)
    states = pool[:rows].clone()
    return {
        "ours": lambda: ops.causal_conv1d_update(x, pool, weight, bias, run),
        "gather": lambda: ops.causal_conv1d_update(x, pool, weight, bias, scattered),
        "ref": lambda: causal_conv1d_update_ref(x, pool, weight, bias, run),
        "hf": lambda: causal_conv1d_update(x[:, :, None], states, weight, bias, "silu"),
    }


def mamba_candidates(rows: int, h: int, p: int, g: int, n: int) -> dict[str, Callable[[], object]]:
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        mamba2_selective_state_update,
    )

    ops = CpuOps()
    run, scattered = _slots(rows)
    pool = torch.randn(2 * rows, h, p, n)
    states = pool[:rows].clone()
    x, dt = torch.randn(rows, h, p), torch.randn(rows, h)
    b, c = torch.randn(rows, g, n), torch.randn(rows, g, n)
    a, d, dt_bias = -torch.rand(h), torch.randn(h), torch.randn(h)
    kw = {"D": d, "dt_bias": dt_bias}

    def hf() -> object:
        # what the granitemoehybrid layer hands over: per-head scalars expanded
        return mamba2_selective_state_update(
            states,
            x,
            dt[:, :, None].expand(-1, -1, p),
            a[:, None, None].expand(-1, p, n),
            b,
            c,
            d[:, None].expand(-1, p),
            dt_bias=dt_bias[:, None].expand(-1, p),
            dt_softplus=True,
        )

    return {
        "ours": lambda: ops.selective_state_update(pool, x, dt, a, b, c, run, **kw),
        "gather": lambda: ops.selective_state_update(pool, x, dt, a, b, c, scattered, **kw),
        "ref": lambda: selective_state_update_ref(pool, x, dt, a, b, c, run, **kw),
        "hf": hf,
    }


def delta_candidates(rows: int, hk: int, hv: int, dim: int) -> dict[str, Callable[[], object]]:
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )

    ops = CpuOps()
    run, scattered = _slots(rows)
    q, k, v = torch.randn(rows, hk, dim), torch.randn(rows, hk, dim), torch.randn(rows, hv, dim)
    g, beta = -torch.rand(rows, hv), torch.rand(rows, hv)
    pool = 0.1 * torch.randn(2 * rows, hv, dim, dim)
    states = pool[:rows].clone()

    def hf() -> object:
        return torch_recurrent_gated_delta_rule(
            q[:, None],
            k[:, None],
            v[:, None],
            g[:, None],
            beta[:, None],
            initial_state=states,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    return {
        "ours": lambda: ops.gated_delta_rule_step(q, k, v, g, beta, pool, run),
        "gather": lambda: ops.gated_delta_rule_step(q, k, v, g, beta, pool, scattered),
        "ref": lambda: gated_delta_rule_step_ref(q, k, v, g, beta, pool, run),
        "hf": hf,
    }


PREFILL_LENS = (4096,), (1024, 333, 64, 5), (512,) * 16


def _synced(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:  # a GPU launch returns before the work is done
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    return run


def prefill_candidates(
    kind: str, lens: tuple[int, ...], div: int, device: str = "cuda"
) -> dict[str, Callable]:
    from spillway.kernels.gated_delta_chunk import gated_delta_chunk_scan
    from spillway.kernels.ssd_chunk_scan import ssd_chunk_scan
    from spillway.services.worker.layers.delta_scan import delta_scan
    from spillway.services.worker.layers.ssd_scan import CHUNK, ChunkLayout, ssd_scan

    dev = torch.device(device)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    layout = ChunkLayout.build(starts, lens, sum(lens), dev, CHUNK)
    t, r = sum(lens), len(lens)

    def rand(*shape: int) -> torch.Tensor:
        return layout.gather(torch.randn(shape, device=dev))

    if kind == "mamba2":
        h, p = GRANITE["heads"] // div, GRANITE["head_dim"]
        g, n = GRANITE["groups"], GRANITE["state"]
        x, b, c = rand(t, h, p), rand(t, g, n), rand(t, g, n)
        dt = layout.gather(0.05 + 0.5 * torch.rand(t, h, device=dev))
        a, d = -torch.rand(h, device=dev), torch.randn(h, device=dev)
        h0 = torch.randn(r, h, p, n, device=dev)
        return {
            "kernel": _synced(lambda: ssd_chunk_scan(x, dt, a, b, c, d, h0)),
            "torch": _synced(lambda: ssd_scan(CHUNK, x, dt, a, b, c, d, h0)),
        }
    hk, hv, dim = QWEN3_NEXT["k_heads"] // div, QWEN3_NEXT["v_heads"] // div, QWEN3_NEXT["dim"]
    q, k, v = rand(t, hk, dim), rand(t, hk, dim), rand(t, hv, dim)
    gl = layout.gather(-torch.rand(t, hv, device=dev))
    beta = layout.gather(torch.rand(t, hv, device=dev))
    s0 = 0.1 * torch.randn(r, hv, dim, dim, device=dev)
    return {
        "kernel": _synced(lambda: gated_delta_chunk_scan(q, k, v, gl, beta, s0)),
        "torch": _synced(lambda: delta_scan(q, k, v, gl, beta, s0)),
    }


def prefill_main(repeats: int, stat: str, div: int) -> None:
    print(f"{stat} ms over {repeats} rounds on {torch.cuda.get_device_name()}, heads / {div}")
    print(f"{'scan':<10} {'rows':<22} {'kernel':>8} {'torch':>8} {'torch/kernel':>13}")
    with torch.inference_mode():
        for kind in ("mamba2", "deltanet"):
            for lens in PREFILL_LENS:
                ms = time_ms(prefill_candidates(kind, lens, div), repeats, stat)
                label = f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else str(lens)
                print(f"{kind:<10} {label:<22} {ms['kernel']:>8.3f} {ms['torch']:>8.3f} "
                      f"{ms['torch'] / ms['kernel']:>13.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--heads-div", type=int, default=1, help="divide head counts by this")
    parser.add_argument("--prefill", action="store_true", help="the prefill scans (CUDA)")
    args = parser.parse_args()
    if args.prefill:
        prefill_main(args.repeats, args.stat, args.heads_div)
        return
    torch.set_num_threads(args.threads)
    div = args.heads_div
    gr, qn = GRANITE, QWEN3_NEXT
    cases: list[tuple[str, Callable[[int], dict[str, Callable[[], object]]]]] = [
        ("granite conv", lambda r: conv_candidates(r, gr["channels"] // div)),
        (
            "granite mamba2",
            lambda r: mamba_candidates(
                r, gr["heads"] // div, gr["head_dim"], gr["groups"], gr["state"]
            ),
        ),
        ("qwen3-next conv", lambda r: conv_candidates(r, qn["channels"] // div)),
        (
            "qwen3-next deltanet",
            lambda r: delta_candidates(r, qn["k_heads"] // div, qn["v_heads"] // div, qn["dim"]),
        ),
    ]
    print(f"{args.stat} ms over {args.repeats} rounds, {args.threads} threads, heads / {div}")
    print(f"{'step':<20} {'R':>3} {'ours':>8} {'gather':>8} {'ref':>8} {'hf':>8} "
          f"{'ref/ours':>9} {'hf/ours':>8}")  # fmt: skip
    with torch.inference_mode():
        for name, make in cases:
            for rows in ROWS:
                ms = time_ms(make(rows), args.repeats, args.stat)
                print(
                    f"{name:<20} {rows:>3} {ms['ours']:>8.3f} {ms['gather']:>8.3f} "
                    f"{ms['ref']:>8.3f} {ms['hf']:>8.3f} "
                    f"{ms['ref'] / ms['ours']:>9.2f} {ms['hf'] / ms['ours']:>8.2f}"
                )


if __name__ == "__main__":
    main()

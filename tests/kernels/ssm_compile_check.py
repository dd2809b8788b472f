"""Compiles the recurrent decode-step kernels for a Hopper target with no GPU present, as
`tests.kernels.compile_check` does for the others: `python -m tests.kernels.ssm_compile_check`
prints one JSON object per kernel."""

from __future__ import annotations

import sys

import torch

from tests.kernels.compile_check import run


def _launchers() -> dict:
    from spillway.kernels.causal_conv1d import causal_conv1d_update
    from spillway.kernels.gated_delta import gated_delta_rule_step
    from spillway.kernels.gated_delta_chunk import gated_delta_chunk_scan
    from spillway.kernels.selective_state import selective_state_update
    from spillway.kernels.ssd_chunk_scan import ssd_chunk_scan

    # Granite-4.0-H-tiny's Mamba2 mixer and Qwen3-Next's gated DeltaNet, bf16 inputs over
    # float32 pools; nothing is launched, so the pools hold two slots.
    rows, bf16 = 4, torch.bfloat16
    slots = torch.arange(rows) % 2
    conv_x = torch.zeros(rows, 3328, dtype=bf16)
    conv_pool = torch.zeros(2, 3328, 3)
    conv_w = torch.zeros(3328, 4, dtype=bf16)
    h, p, n = 48, 64, 128
    ssm_pool = torch.zeros(2, h, p, n)
    x, z = torch.zeros(rows, h, p, dtype=bf16), torch.zeros(rows, h, p, dtype=bf16)
    dt, b = torch.zeros(rows, h, dtype=bf16), torch.zeros(rows, 1, n, dtype=bf16)
    a = torch.zeros(h)
    q = torch.zeros(rows, 16, 128, dtype=bf16)
    v = torch.zeros(rows, 32, 128, dtype=bf16)
    g = torch.zeros(rows, 32)
    delta_pool = torch.zeros(2, 32, 128, 128)
    # The prefill scans: one row of two 64-token chunks (the worker's CHUNK), float32 as the
    # worker hands them over (the conv's output); x, B, C as row-strided views of it.
    chunks, q_len, f32 = 2, 64, torch.float32
    conv_out = torch.zeros(1, chunks, q_len, h * p + 2 * n)
    sx, sb, sc = conv_out.split([h * p, n, n], dim=-1)
    sx, sb, sc = (t.reshape(1, chunks, q_len, -1, t.shape[-1] // (h if t is sx else 1))
                  for t in (sx, sb, sc))  # fmt: skip
    sdt = torch.zeros(1, chunks, q_len, h)
    qkv = torch.zeros(1, chunks, q_len, 2 * 16 * 128 + 32 * 128)
    cq, ck, cv = qkv.split([16 * 128, 16 * 128, 32 * 128], dim=-1)
    cq, ck = cq.reshape(1, chunks, q_len, 16, 128), ck.reshape(1, chunks, q_len, 16, 128)
    cv = cv.reshape(1, chunks, q_len, 32, 128)
    dg = torch.zeros(1, chunks, q_len, 32, dtype=f32)
    return {
        "causal_conv1d": lambda: causal_conv1d_update(
            conv_x, conv_pool, conv_w, a.new_zeros(3328), slots
        ),
        "selective_state": lambda: selective_state_update(
            ssm_pool, x, dt, a, b, b, slots, D=a, dt_bias=a, z=z
        ),
        "gated_delta": lambda: gated_delta_rule_step(q, q, v, g, g, delta_pool, slots),
        "ssd_chunk_scan": lambda: ssd_chunk_scan(sx, sdt, a, sb, sc, a, ssm_pool[:1]),
        "gated_delta_chunk": lambda: gated_delta_chunk_scan(cq, ck, cv, dg, dg, delta_pool[:1]),
    }


def main() -> int:
    return run(_launchers)


if __name__ == "__main__":
    sys.exit(main())

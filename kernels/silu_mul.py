"""SwiGLU's activation over the fused gate and up projections: silu(gate) * up.

It has no Triton kernel of its own (the MoE kernel fuses it into its gate_up epilogue,
`fused_moe`); this torch form is what the Triton backend runs and what the CPU backend
falls back to where its native one (`cpu.decode_ops`) does not fit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

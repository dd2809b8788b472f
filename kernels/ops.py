"""The worker's hot-path operations (`KernelOps`, in `kernels._ops_protocol`), its two backends,
and `select_ops`, which picks one: `TritonOps` here (the CUDA path) and `cpu.ops.CpuOps` (the
CPU path, whose plain torch form also serves as every kernel's reference).

Each op's signature and contract (shapes, layouts, dtypes) is written once, in `KernelOps`,
which both backends subclass, so mypy checks each backend's ops against it. A backend whose
op is a kernel's launcher binds that function (`TritonOps.rms_norm =
staticmethod(rmsnorm.rms_norm)`).

What only the CPU backend can do (tuning at start-up, reading the model file's blocks, the
bound on a speculative verify's rows, native sampling, all decoder layers of a decode step
in one call) is `cpu.ops.CpuAbilities`, which the worker asks for with `isinstance`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from spillway.kernels import (
    causal_conv1d,
    decode_attention,
    fused_moe,
    gated_delta,
    kv_store,
    prefill_attention,
    rmsnorm,
    selective_state,
)
from spillway.kernels import rotary as rotary_kernel
from spillway.kernels._jit import interpreting
from spillway.kernels._ops_protocol import KernelOps
from spillway.kernels.cpu.native import DEFAULT_CACHE_DIR
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.cpu.quantized_weight import ExpertWeights, Weight
from spillway.kernels.silu_mul import silu_mul_ref


class TritonOps(KernelOps):
    """The same operations as Triton kernels: the CUDA path. Most ops are their kernel's
    launcher as it stands (each launcher asserts the layout contract `kernels._ops_protocol`
    states)."""

    name = "triton"

    store_kv = staticmethod(kv_store.store_kv)
    paged_attention = staticmethod(prefill_attention.paged_attention)
    paged_decode_attention = staticmethod(decode_attention.paged_decode_attention)
    rms_norm = staticmethod(rmsnorm.rms_norm)
    fused_add_rms_norm = staticmethod(rmsnorm.fused_add_rms_norm)
    rotary = staticmethod(rotary_kernel.rotary)
    # No kernel of its own: the MoE kernel fuses it into its gate_up epilogue.
    silu_mul = staticmethod(silu_mul_ref)
    fused_experts = staticmethod(fused_moe.fused_experts)
    causal_conv1d_update = staticmethod(causal_conv1d.causal_conv1d_update)
    selective_state_update = staticmethod(selective_state.selective_state_update)
    gated_delta_rule_step = staticmethod(gated_delta.gated_delta_rule_step)

    def linear(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert isinstance(weight, torch.Tensor)  # weights load dequantized for CUDA
        return F.linear(x, weight, bias)  # cuBLAS: the projections are not ours to beat

    def embedding(self, ids: torch.Tensor, table: Weight) -> torch.Tensor:
        assert isinstance(table, torch.Tensor)
        return F.embedding(ids, table)

    def experts_and_shared(self, *args: object, **kwargs: object) -> None:
        """No fused shared expert on CUDA: `fused_experts` and the shared expert's
        projections apart (each a kernel that fills the GPU)."""
        return None


def select_ops(
    backend: str = "auto",
    device: str | torch.device = "cpu",
    *,
    native_dir: str | Path | None = DEFAULT_CACHE_DIR,
    quantize: str = "none",
) -> KernelOps:
    """`auto`: Triton on CUDA (when installed), the CPU backend (`torch`) elsewhere.

    `triton` on a non-CUDA device runs the kernels in Triton's CPU interpreter, which is
    only meant for testing and must be asked for with TRITON_INTERPRET=1. The CPU backend
    builds its native kernels in `native_dir` (None: pure torch) and quantizes its
    projections as `quantize` says; quantization is a CPU mode.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {backend!r}: use auto, torch or triton")
    on_cuda = torch.device(device).type == "cuda"
    if quantize != "none" and on_cuda:
        raise ValueError(f"--quantize {quantize} is a CPU mode; on CUDA use --dtype bfloat16")
    if backend == "torch" or (backend == "auto" and not (on_cuda and _triton_importable())):
        native: Literal["auto"] | None = "auto" if native_dir is not None else None
        return CpuOps(native, native_dir or DEFAULT_CACHE_DIR, quantize)
    if not on_cuda and not interpreting():
        raise ValueError(
            f"the triton backend needs a CUDA device, not {device!r}; set TRITON_INTERPRET=1 "
            "to run its kernels in the (slow) interpreter for testing"
        )
    if not _triton_importable():
        raise ValueError("the triton backend needs the triton package: pip install triton")
    if quantize != "none":
        raise ValueError(f"--quantize {quantize} needs the torch backend")
    return TritonOps()


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# `Weight` and `ExpertWeights` too: the forms a projection's and a MoE layer's experts'
# weights take (`cpu.quantized_weight`).
__all__ = ["ExpertWeights", "KernelOps", "TritonOps", "Weight", "select_ops"]

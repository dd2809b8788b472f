"""The worker's hot-path operations behind one interface (`KernelOps`), its two backends, and
`select_ops`, which picks one: `TritonOps` here (the CUDA path) and `cpu.ops.CpuOps` (the CPU
path, whose plain torch form also serves as every kernel's reference).

Each op's signature is written once, in `KernelOps`; a backend whose op is a kernel's
launcher binds that function (`TritonOps.rms_norm = staticmethod(rmsnorm.rms_norm)`), and
mypy checks both backends against the protocol (`select_ops` returns either as one).

Shape and layout contract (shared by every backend; the launchers assert it):

    q            [T, Hq, D]        the step's query tokens, rows packed back to back
    k, v         [T, Hkv, D]       the step's new keys / values
    k_cache      [NB, BS, Hkv, D]  one layer's paged cache (v_cache alike)
    block_tables [R, MB] int32     row r's blocks in order; entries past the row's last
                                   block are padding and never read
    context_lens [R] int32         tokens in the cache for row r *including* this step's
    query_start  [R + 1] int32     row r's queries are q[query_start[r]:query_start[r+1]]
    slot_mapping [T] int64         block_id * BS + offset for each new token; < 0 = skip
    positions    [T] int64         absolute position of each token

A row's queries are the last q_len positions of its context: query i of row r sits at
position context_lens[r] - q_len + i and attends causally to keys [0, that position].
Every row has at least one query (q_len >= 1), so T == R means every row is a decode row.
The step's new keys and values are stored (`store_kv`) before attention reads the cache.

Triton kernels need D and BS to be powers of two, D >= 16 and BS >= 16; dtypes are float32,
bfloat16 or float16, and attention accumulates in float32 on both backends.

What only the CPU backend can do (tuning at start-up, reading the model file's blocks, the
bound on a speculative verify's rows, native sampling) is `cpu.ops.CpuAbilities`, which the
worker asks for with `isinstance`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

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
from spillway.kernels.cpu.decode_layers import Geometry, LayerTensors
from spillway.kernels.cpu.native import DEFAULT_CACHE_DIR
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.cpu.quantized_weight import ExpertWeights, Weight
from spillway.kernels.silu_mul import silu_mul_ref


class KernelOps(Protocol):
    """What the worker calls; `TritonOps` and `cpu.ops.CpuOps` both provide it."""

    name: str  # the backend as `--attention-backend` names it: "torch" or "triton"

    def linear(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x W^T + b: x [M, K], weight [N, K] -> [M, N]."""
        ...

    def embedding(self, ids: torch.Tensor, table: Weight) -> torch.Tensor:
        """The table's rows at ids."""
        ...

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Writes k, v [T, Hkv, D] into their cache slots; slots < 0 are skipped."""
        ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start: torch.Tensor,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        max_query_len: int | None = None,
    ) -> torch.Tensor:
        """Mixed prefill/extend/decode attention over the paged cache: [T, Hq, D].
        `max_query_len`, when the caller knows it, is the longest row's query count."""
        ...

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        max_context_len: int | None = None,
    ) -> torch.Tensor:
        """All-decode fast path: q [R, Hq, D] holds row r's single query; returns [R, Hq, D]."""
        ...

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual <- x + residual (in place); returns (rms_norm(residual), residual)."""
        ...

    def rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> None:
        """Llama rotary (rotate-half convention) on q [T,Hq,D] and k [T,Hkv,D], in place.

        cos_cache / sin_cache: [max_pos, D // 2] float32.
        """
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 I] (the fused gate and up projections) -> silu(gate) * up [T, I]."""
        ...

    def fused_experts(
        self,
        x: torch.Tensor,
        w_gate_up: ExpertWeights,
        w_down: ExpertWeights,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """A MoE layer's experts (`kernels.moe` states the shapes); kept in a model file's
        blocks on the CPU alone (`cpu.quantized_weight.QuantizedExperts`)."""
        ...

    def causal_conv1d_update(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slots: torch.Tensor,
        activation: str | None = "silu",
    ) -> torch.Tensor:
        """The short convolution's decode step (`kernels.ssm_reference` states the state
        pools and the slots); updates conv_state in place, returns [R, C]."""
        ...

    def selective_state_update(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        slots: torch.Tensor,
        *,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_softplus: bool = True,
        z: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mamba2's decode step; updates state [S, H, P, N] in place, returns [R, H, P]."""
        ...

    def gated_delta_rule_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
    ) -> torch.Tensor:
        """Gated DeltaNet's decode step; updates state [S, Hv, K, V] in place, returns
        [R, Hv, V]."""
        ...

    def decode_layers(
        self,
        x: torch.Tensor,
        layers: Sequence[LayerTensors],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        geometry: Geometry,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All decoder layers of a decode step (one token per row) at once: (x, residual)
        as the layer-by-layer loop leaves them, or None where this backend has no such path
        for this step (then the caller loops)."""
        ...


class TritonOps(KernelOps):
    """The same operations as Triton kernels: the CUDA path. Most ops are their kernel's
    launcher as it stands (each launcher asserts the layout contract above)."""

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

    def decode_layers(self, *args: object, **kwargs: object) -> None:
        """No one-call layer loop on CUDA: a decode step there replays a CUDA graph."""
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

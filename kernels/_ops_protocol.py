"""`KernelOps`: the worker's hot-path operations, each op's signature and contract written
once. Both backends subclass it, `kernels.ops.TritonOps` (the CUDA path) and
`kernels.cpu.ops.CpuOps` (the CPU path), and mypy checks each of their ops against it.

This module imports no backend, so that both can import it (`kernels.ops`, which picks a
backend in `select_ops`, imports `kernels.cpu`; the reverse would be an import cycle). The
weights an op takes are its backend's own forms (`kernels.ops.Weight`: a tensor, or on the
CPU a weight kept in the model file's blocks); here they are a tensor or `InBlocks`.

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
"""

from __future__ import annotations

from typing import Protocol

import torch


class InBlocks(Protocol):
    """A weight kept in the model file's quantized blocks rather than as a tensor
    (`cpu.quantized_weight`: only the CPU backend reads those); the ops that take one need
    no more of it here than that it is one."""

    @property
    def shape(self) -> torch.Size: ...


class KernelOps(Protocol):
    """What the worker calls; `kernels.ops.TritonOps` and `kernels.cpu.ops.CpuOps` subclass it."""

    name: str  # the backend as `--attention-backend` names it: "torch" or "triton"

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | InBlocks, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x W^T + b: x [M, K], weight [N, K] -> [M, N]."""
        ...

    def embedding(self, ids: torch.Tensor, table: torch.Tensor | InBlocks) -> torch.Tensor:
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
        w_gate_up: torch.Tensor | InBlocks,
        w_down: torch.Tensor | InBlocks,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """A MoE layer's experts (`kernels.moe` states the shapes); kept in a model file's
        blocks on the CPU alone (`cpu.quantized_weight.QuantizedExperts`)."""
        ...

    def experts_and_shared(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor | InBlocks,
        w_down: torch.Tensor | InBlocks,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared_gate_up: torch.Tensor,
        shared_down: torch.Tensor,
        shared_gate: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """`fused_experts` plus the always-on shared expert (shared_gate_up [2 Is, H],
        shared_down [H, Is]; its output scaled by sigmoid(x shared_gate^T) where shared_gate
        [1, H] is given) in one pass, or None where this backend has no such path for
        these tensors (then the caller runs the two apart)."""
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

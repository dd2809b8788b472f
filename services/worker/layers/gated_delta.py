"""Qwen3-Next's gated DeltaNet layer ("linear_attention") over a flat batch and a state pool.

Per layer: in_proj_qkvz gives, per key head, its q and k and the value heads' v and gate z
of its group; in_proj_ba gives beta's and the decay's inputs. q, k, v go through a short
causal convolution (state: its last K - 1 inputs; no bias), then the gated delta rule
(state [Hv, Dk, Dv] per sequence), whose output is RMS-normed per value head, gated by
silu(z), and projected out.

Rows of one token (decode) go through the decode-step kernels
(`KernelOps.causal_conv1d_update`, `gated_delta_rule_step`), all rows in one call. A row
of several tokens (a prefill chunk) runs in torch with every other such row of the step
(`_scan_rows`): the causal conv over each row's window, then the delta rule's chunked WY
form (rows packed in chunks of 64 tokens, one batched triangular solve for all chunks,
then the states passed chunk to chunk), from the slots' states to those after each row's
last token, left in the pool, so the state carries from chunk to chunk. `chunked=False` runs
every token through the step kernels instead (L steps, the others passing slot -1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spillway.kernels.cpu.chunk_scan import ChunkScans
from spillway.kernels.cpu.ops import CpuAbilities
from spillway.kernels.ops import KernelOps
from spillway.services.worker.layers.delta_scan import chunk_delta_scan
from spillway.services.worker.layers.mixer_rows import MixerRows, ScanRows
from spillway.services.worker.layers.ssd_scan import CHUNK, ChunkLayout, conv_rows
from spillway.services.worker.state_pool import take_step_snapshots
from spillway.shared.model_config import HybridConfig


@dataclass
class GatedDeltaWeights:
    in_proj_qkvz: torch.Tensor  # [2 Hk Dk + 2 Hv Dv, hidden], grouped by key head
    in_proj_ba: torch.Tensor  # [2 Hv, hidden], grouped by key head
    conv_weight: torch.Tensor  # [C, K], C = 2 Hk Dk + Hv Dv (q, k, v)
    dt_bias: torch.Tensor  # [Hv]
    A: torch.Tensor  # [Hv] float32: -exp(A_log)
    norm: torch.Tensor  # [Dv]: the gated RMSNorm's weight (shared by the value heads)
    out_proj: torch.Tensor  # [hidden, Hv Dv]


def gated_delta_dims(c: HybridConfig) -> tuple[int, int]:
    """(key_dim, conv channels): Hk Dk, and q, k, v's widths together."""
    key_dim = c.linear_k_heads * c.linear_k_dim
    return key_dim, 2 * key_dim + c.linear_v_heads * c.linear_v_dim


def gated_delta_mixer(
    ops: KernelOps,
    c: HybridConfig,
    eps: float,
    h: torch.Tensor,  # [T, hidden], the normed input of this layer
    w: GatedDeltaWeights,
    conv_state: torch.Tensor,  # [S, C, K - 1] float32
    state: torch.Tensor,  # [S, Hv, Dk, Dv] float32
    query_start: torch.Tensor,  # [R + 1]
    slots: torch.Tensor,  # [R] int64
    max_query_len: int,
    takes: Sequence[tuple[int, int, int]] = (),
    snapshots: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunked: bool = True,
) -> torch.Tensor:
    """[T, hidden]: the layer's output; updates the rows' states in place. `takes`
    (row, j, snapshot): the row's conv and recurrent states once its token j ran are
    copied into that snapshot of `snapshots` (this layer's snapshot pools). Rows of
    several tokens take the chunked form (`chunked`), others the decode-step kernels."""
    t = h.shape[0]
    hk, hv, dk, dv = c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    per = hv // hk  # value heads per key head
    key_dim, _conv_dim = gated_delta_dims(c)
    qkvz = ops.linear(h, w.in_proj_qkvz).view(t, hk, 2 * dk + 2 * per * dv)
    q, k, v, z = qkvz.split([dk, dk, per * dv, per * dv], dim=-1)
    ba = ops.linear(h, w.in_proj_ba).view(t, hk, 2 * per)
    b, a = ba.split([per, per], dim=-1)
    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    beta = b.reshape(t, hv).sigmoid()
    g = w.A * F.softplus(a.reshape(t, hv).float() + w.dt_bias)  # [T, Hv] float32
    out = torch.zeros(t, hv, dv, dtype=h.dtype, device=h.device)
    rows = MixerRows.split(query_start, slots, t, max_query_len, chunked)
    for step in rows.token_steps():
        conv = ops.causal_conv1d_update(
            step.gather(mixed), conv_state, w.conv_weight, None, step.slots
        )
        cq, ck, cv = conv.split([key_dim, key_dim, hv * dv], dim=-1)
        o = ops.gated_delta_rule_step(
            cq.reshape(-1, hk, dk),
            ck.reshape(-1, hk, dk),
            cv.reshape(-1, hv, dv),
            step.gather(g),
            step.gather(beta),
            state,
            step.slots,
            use_qk_l2norm=True,
        )  # [R, Hv, Dv]
        out = step.put(out, o)
        take_step_snapshots(takes, step.j, rows.scan, slots, snapshots, conv_state, state)
    scanning = rows.scan_rows(takes)
    if scanning is not None:
        scans = ops.scans if isinstance(ops, CpuAbilities) else None
        _scan_rows(c, w, mixed, g, beta, conv_state, state, scanning, snapshots, out, scans)
    normed = _norm_then_gate(out.reshape(-1, dv), z.reshape(-1, dv), w.norm, eps)
    return ops.linear(normed.view(t, hv * dv), w.out_proj)


def _scan_rows(
    c: HybridConfig,
    w: GatedDeltaWeights,
    mixed: torch.Tensor,  # [T, C]: every token's q, k, v before the convolution
    g: torch.Tensor,  # [T, Hv] float32: log decays
    beta: torch.Tensor,  # [T, Hv]
    conv_state: torch.Tensor,  # [S, C, K - 1] float32 (the rows' slots updated in place)
    state: torch.Tensor,  # [S, Hv, Dk, Dv] float32 (likewise)
    rows: ScanRows,
    snapshots: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,  # [T, Hv, Dv]: the rows' outputs written here
    scans: ChunkScans | None = None,  # the native CPU kernels
) -> None:
    """Every scanning row at once, in chunks of Q tokens (`ssd_scan.ChunkLayout`; padding
    has beta = 0 and g = 0, so it leaves the state as it is): the causal conv over each
    slot's K - 1 inputs and the row's, then the delta rule's chunked WY form
    (`delta_scan`), from the slots' states to the states after each row's last token,
    which go back to the slots. Each take (row, j, snapshot) gets its row's states once
    token j ran."""
    f32 = torch.float32
    hk, hv, dk, dv = c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    key_dim, _ = gated_delta_dims(c)
    slots = rows.slots
    layout = ChunkLayout.build(rows.starts, rows.lens, mixed.shape[0], mixed.device, CHUNK)
    conv_out, inputs = conv_rows(layout, mixed, conv_state[slots], w.conv_weight, None, scans)
    cq, ck, cv = conv_out.split([key_dim, key_dim, hv * dv], dim=-1)  # [R, K, Q, ...]
    r, nk, q_len = conv_out.shape[:3]
    valid = layout.valid.view(r, nk, q_len)[..., None]
    scan = chunk_delta_scan(  # the Triton kernel on CUDA, the torch form elsewhere
        cq.reshape(r, nk, q_len, hk, dk), ck.reshape(r, nk, q_len, hk, dk),
        cv.reshape(r, nk, q_len, hv, dv), layout.gather(g.to(f32)) * valid,
        layout.gather(beta.to(f32)) * valid, state[slots], scans=scans,
        keep_states=bool(rows.own_takes()),
    )  # fmt: skip
    layout.scatter(scan.o, out)
    rows.store(inputs, scan, layout.chunk, conv_state, state, snapshots)


def _norm_then_gate(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of each value head's output, then times silu(z) (Qwen3-Next's order)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(z.float())).to(dtype)

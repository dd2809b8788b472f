"""Gated DeltaNet's prefill for every scanning row of a step at once: the delta rule's
chunked WY form over rows packed into chunks of Q tokens (`ssd_scan.ChunkLayout`; padding
has beta = 0 and g = 0, so it leaves the state as it is).

The recurrence

    S_t = e^{g_t} S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),
    o_t = S_t^T q_t

unrolled over a chunk from its entering state S, with G_t the running sum of g: the new
values solve (I + A) U = beta (V - e^{G} K S), A[t, s] = beta_t e^{G_t - G_s} k_t.k_s for
s < t (unit lower-triangular). (I + A)^-1 does not depend on S, so every chunk's
W1 = (I + A)^-1 beta V and W2 = (I + A)^-1 beta e^G K come from one batched solve (the WY
form); then, chunk after chunk for all rows together, U = W1 - W2 S,
o_t = e^{G_t} S^T q_t + sum_{s <= t} e^{G_t - G_s} (q_t.k_s) u_s and S moves on to the
chunk's end.

`delta_scan` is that torch form (the CPU path); `chunk_delta_scan` runs the Triton kernel
(`kernels.gated_delta_chunk`) instead on CUDA, with the same result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spillway.kernels.cpu.chunk_scan import ChunkScans, fits


@dataclass
class DeltaScanResult:
    o: torch.Tensor  # [R, K, Q, Hv, Dv] float32
    u: torch.Tensor  # [R, K, Q, Hv, Dv]: each token's new value
    h_in: torch.Tensor | None  # [R, K, Hv, Dk, Dv]: the state entering each chunk, if kept
    h_end: torch.Tensor  # [R, Hv, Dk, Dv]: the state after each row's last token
    g: torch.Tensor  # [R, K, Q, Hv]: log decays, zero at padding
    k: torch.Tensor  # [R, K, Q, Hk, Dk]: the keys as given (before the L2 norm)
    l2norm: bool

    def state_at(self, row: int, token: int, chunk: int) -> torch.Tensor:
        """[Hv, Dk, Dv]: row's state once its token `token` ran."""
        assert self.h_in is not None, "the scan ran without keeping the chunks' states"
        i, j = divmod(token, chunk)
        cum = self.g[row, i, : j + 1].cumsum(0)  # [j + 1, Hv]
        upto = (cum[-1][None, :] - cum).exp()  # decay from each token to token j
        keys = _per_value_head(_l2(self.k[row, i, : j + 1]) if self.l2norm
                               else self.k[row, i, : j + 1], self.h_in.shape[2])  # fmt: skip
        added = torch.einsum("sh,shk,shv->hkv", upto, keys, self.u[row, i, : j + 1])
        return cum[-1].exp()[:, None, None] * self.h_in[row, i] + added


def delta_scan(
    q: torch.Tensor,  # [R, K, Q, Hk, Dk] float32 (after the conv)
    k: torch.Tensor,  # [R, K, Q, Hk, Dk]
    v: torch.Tensor,  # [R, K, Q, Hv, Dv]
    g: torch.Tensor,  # [R, K, Q, Hv] float32 log decays, zero at padding
    beta: torch.Tensor,  # [R, K, Q, Hv] float32, zero at padding
    h0: torch.Tensor,  # [R, Hv, Dk, Dv] float32: each row's state before its first token
    scale: float | None = None,  # Dk^-1/2 unless given
    l2norm: bool = True,
) -> DeltaScanResult:
    """The chunked WY form in torch over rows already laid out in chunks
    (`ChunkLayout.gather`); q and k are L2-normed here when `l2norm`."""
    f32 = torch.float32
    nk, q_len, _hk, dk = q.shape[1:]
    hv = v.shape[3]
    scale = dk**-0.5 if scale is None else scale

    def heads(x: torch.Tensor) -> torch.Tensor:  # [R, K, Q, n, D] -> [R, K, Hv, Q, D]
        return _per_value_head(x, hv).permute(0, 1, 3, 2, 4)

    qh = heads(_l2(q) if l2norm else q.to(f32)) * scale
    kh = heads(_l2(k) if l2norm else k.to(f32))
    vh = heads(v.to(f32))
    gc = g.to(f32).permute(0, 1, 3, 2)  # [R, K, Hv, Q]
    bc = beta.to(f32).permute(0, 1, 3, 2)
    cum = gc.cumsum(-1)  # [R, K, Hv, Q]
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = (bc[..., None] * decay * (kh @ kh.transpose(-1, -2))).tril(-1)
    eye = torch.eye(q_len, dtype=f32, device=q.device)
    rhs = torch.cat([bc[..., None] * vh, (bc * cum.exp())[..., None] * kh], dim=-1)
    solved = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    w1, w2 = solved.split([vh.shape[-1], dk], dim=-1)  # [R, K, Hv, Q, Dv], [.., Q, Dk]
    attend = decay * (qh @ kh.transpose(-1, -2))  # [R, K, Hv, Q, Q]
    tail = (cum[..., -1:] - cum).exp()  # decay from each token to its chunk's end
    s = h0
    entering, values, outs = [], [], []
    for i in range(nk):
        entering.append(s)
        u = w1[:, i] - w2[:, i] @ s  # [R, Hv, Q, Dv]
        values.append(u)
        outs.append(cum[:, i].exp()[..., None] * (qh[:, i] @ s) + attend[:, i] @ u)
        s = (
            cum[:, i, :, -1, None, None].exp() * s
            + (kh[:, i] * tail[:, i, ..., None]).transpose(-1, -2) @ u
        )
    o = torch.stack(outs, dim=1).permute(0, 1, 3, 2, 4)  # [R, K, Q, Hv, Dv]
    u_all = torch.stack(values, dim=1).permute(0, 1, 3, 2, 4)
    return DeltaScanResult(o, u_all, torch.stack(entering, dim=1), s, g, k, l2norm)


def use_kernel(t: torch.Tensor) -> bool:
    """Whether the Triton kernel runs the scan: on CUDA tensors with Triton installed."""
    if not t.is_cuda:
        return False
    from spillway.kernels.gated_delta_chunk import available

    return available()


def chunk_delta_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = True,
    scans: ChunkScans | None = None,
    keep_states: bool = True,
) -> DeltaScanResult:
    """`delta_scan`'s result from the Triton kernel on CUDA, from the native CPU kernel
    (`kernels.cpu.chunk_scan`) where `scans` is given and fits, from `delta_scan`
    elsewhere. Without `keep_states` the native kernel keeps no chunk's entering state
    (h_in: None), so `state_at` cannot be asked."""
    if not use_kernel(q):
        if scans is None or not fits(q, k, v, g, beta, h0):
            return delta_scan(q, k, v, g, beta, h0, scale, l2norm)
        return _native_delta_scan(scans, q, k, v, g, beta, h0, scale, l2norm, keep_states)
    from spillway.kernels.gated_delta_chunk import gated_delta_chunk_scan

    o, u, h_in, h_end = gated_delta_chunk_scan(
        q, k, v, g, beta, h0, scale=scale, use_qk_l2norm=l2norm
    )
    return DeltaScanResult(o, u, h_in, h_end, g, k, l2norm)


def _native_delta_scan(
    scans: ChunkScans,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    scale: float | None,
    l2norm: bool,
    keep_states: bool,
) -> DeltaScanResult:
    """The native kernel, the per-key-head [Q, Q] products (k.k, q.k) and the running sums
    of the log decays computed here, once for all value heads of a key head."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qn = (_l2(q) if l2norm else q.to(torch.float32)) * scale  # [R, K, Q, Hk, Dk]
    kn = _l2(k) if l2norm else k.to(torch.float32)
    kh = kn.permute(0, 1, 3, 2, 4)  # [R, K, Hk, Q, Dk]
    kt = kh.transpose(-1, -2)
    kk, qk = kh @ kt, qn.permute(0, 1, 3, 2, 4) @ kt  # [R, K, Hk, Q, Q]
    cum = g.to(torch.float32).cumsum(2)  # [R, K, Q, Hv]
    o, u, h_in, h_end = scans.delta(
        qn, kn, v.to(torch.float32), cum, beta.to(torch.float32), kk, qk, h0, keep_states
    )
    return DeltaScanResult(o, u, h_in, h_end, g, k, l2norm)


def _per_value_head(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., n, D] -> [..., Hv, D]: key head h // (Hv / n) serves value head h."""
    n = x.shape[-2]
    return x if n == hv else x.repeat_interleave(hv // n, dim=-2)


def _l2(x: torch.Tensor) -> torch.Tensor:
    """transformers' l2norm of modeling_qwen3_next (eps 1e-6), in float32."""
    x = x.to(torch.float32)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

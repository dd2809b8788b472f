"""The recurrent layers' prefill on the CPU in native code (`csrc/chunk_scan.c`): Mamba2's
chunked SSD scan, gated DeltaNet's chunked delta rule and their short causal convolution
(with SiLU), over rows laid out in chunks by `ssd_scan.ChunkLayout`.

The torch forms (`layers.ssd_scan.ssd_scan`, `layers.delta_scan.delta_scan`) stay the
reference: these give their outputs and states up to float32 rounding (sums in another
order, the exponential of `fast_exp.h`). The callers (`ssd_scan.chunk_scan`,
`delta_scan.chunk_delta_scan`) precompute the head-independent [Q, Q] products and the
running sums of the log decays in torch and hand them over. Measured by
`python -m bench.hybrid_prefill` (figures in docs/measurements/).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from spillway.kernels.cpu import matvec, native
from spillway.kernels.cpu.native import bind, ptr

SOURCE = Path(__file__).with_name("csrc") / "chunk_scan.c"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def fits(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is a float32 CPU tensor (what the kernels take)."""
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)


class ChunkScans:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._ssd = bind(library.ssd_chunk_scan_f32, ctypes.c_int, [_PTR] * 11 + [_I64] * 7)
        self._delta = bind(library.delta_chunk_scan_f32, ctypes.c_int, [_PTR] * 12 + [_I64] * 7)
        self._conv = bind(
            library.causal_conv_silu_f32, None, [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR]
            + [_I64] * 4,
        )  # fmt: skip

    def ssd(
        self,
        x: torch.Tensor,  # [R, K, Q, H, P] float32
        dt: torch.Tensor,  # [R, K, Q, H]
        cum: torch.Tensor,  # [R, K, Q, H]: running sum of dt A within each chunk
        cb: torch.Tensor,  # [R, K, G, Q, Q]: C_t . B_s
        b: torch.Tensor,  # [R, K, Q, G, N]
        c: torch.Tensor,  # [R, K, Q, G, N]
        d: torch.Tensor,  # [H]
        h0: torch.Tensor,  # [R, H, P, N]
        keep_h_in: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(y [R, K, Q, H, P], the state entering each chunk [R, K, H, P, N] or None,
        the state after the last chunk [R, H, P, N])."""
        rows, chunks, q, heads, p = x.shape
        groups, n = b.shape[3:]
        args = [t.contiguous() for t in (x, dt, cum, cb, b, c, d.float(), h0)]
        assert cb.shape == (rows, chunks, groups, q, q) and heads % groups == 0
        y = torch.empty_like(args[0])
        h_in = x.new_empty(rows, chunks, heads, p, n) if keep_h_in else None
        h_end = x.new_empty(rows, heads, p, n)
        code = self._ssd(
            *(a.data_ptr() for a in args), y.data_ptr(), ptr(h_in), h_end.data_ptr(),
            rows, chunks, q, heads, p, groups, n,
        )  # fmt: skip
        if code != 0:
            raise MemoryError("ssd_chunk_scan could not allocate its buffers")
        return y, h_in, h_end

    def delta(
        self,
        q: torch.Tensor,  # [R, K, Q, Hk, Dk] float32, normed and scaled as the layer does
        k: torch.Tensor,  # [R, K, Q, Hk, Dk]
        v: torch.Tensor,  # [R, K, Q, Hv, Dv]
        cum: torch.Tensor,  # [R, K, Q, Hv]: running sum of the log decays within each chunk
        beta: torch.Tensor,  # [R, K, Q, Hv]
        kk: torch.Tensor,  # [R, K, Hk, Q, Q]: k_t . k_s
        qk: torch.Tensor,  # [R, K, Hk, Q, Q]: q_t . k_s
        h0: torch.Tensor,  # [R, Hv, Dk, Dv]
        keep_h_in: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(o, u [R, K, Q, Hv, Dv], the state entering each chunk [R, K, Hv, Dk, Dv] or
        None, the state after the last chunk [R, Hv, Dk, Dv])."""
        rows, chunks, ql, hk, dk = q.shape
        hv, dv = v.shape[3:]
        assert hv % hk == 0 and kk.shape == qk.shape == (rows, chunks, hk, ql, ql)
        args = [t.contiguous() for t in (q, k, v, cum, beta, kk, qk, h0)]
        o = v.new_empty(rows, chunks, ql, hv, dv)
        u = torch.empty_like(o)
        h_in = v.new_empty(rows, chunks, hv, dk, dv) if keep_h_in else None
        h_end = v.new_empty(rows, hv, dk, dv)
        code = self._delta(
            *(a.data_ptr() for a in args), o.data_ptr(), u.data_ptr(), ptr(h_in),
            h_end.data_ptr(), rows, chunks, ql, hk, hv, dk, dv,
        )  # fmt: skip
        if code != 0:
            raise MemoryError("delta_chunk_scan could not allocate its buffers")
        return o, u, h_in, h_end

    def conv_silu(
        self,
        x: torch.Tensor,  # [R, L, C] float32, unit stride in C
        state: torch.Tensor,  # [R, C, K - 1]: each row's inputs before its first token
        weight: torch.Tensor,  # [C, K]
        bias: torch.Tensor | None,  # [C]
    ) -> torch.Tensor:
        """silu(the causal depthwise conv) [R, L, C], token-major."""
        rows, length, channels = x.shape
        width = weight.shape[1]
        if x.stride(2) != 1:
            x = x.contiguous()
        state = state.contiguous()
        assert state.shape == (rows, channels, width - 1)
        wt = weight.float().t().contiguous()  # [K, C]
        b = None if bias is None else bias.float().contiguous()
        out = x.new_empty(rows, length, channels)
        self._conv(
            x.data_ptr(), x.stride(0), x.stride(1), state.data_ptr(), wt.data_ptr(), ptr(b),
            out.data_ptr(), rows, length, channels, width,
        )  # fmt: skip
        return out


def load(cache_dir: str | Path = native.DEFAULT_CACHE_DIR) -> ChunkScans | None:
    """The kernels, built on first use (AVX-512 where this CPU has it, else AVX2); None
    where they cannot be built here."""
    library = native.build(SOURCE, matvec.compile_flags(), cache_dir)
    return None if library is None else ChunkScans(library)

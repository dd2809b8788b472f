"""The elementwise operations of a step in one native call each (`csrc/decode_ops.c`):
norms, rotary, KV store and the SwiGLU gate.

At one row the torch path dispatches some 25 small operators per layer for these (a few
microseconds each, 750 per SmolLM2-135M step); one ctypes call per operation costs about
as much as one of them. Results equal the torch path's up to float32 rounding (the norm's
sum and SiLU's exponential are computed in another order / form); rotary and the KV store
are exact. Callers check `fits` and keep the torch path for anything else.

Many rows (a 512-token prefill chunk, a 64-row decode step) take them too: one pass over
the values against the torch path's several (each with its temporary), measured on the
2-core Xeon at 512 tokens of SmolLM2-135M: norm 1.0 -> 0.8 ms, SwiGLU gate 3.5 -> 0.6,
rotary 0.5 -> 0.07, KV store 0.17 -> 0.07. The KV store also writes a bfloat16 cache
(`--kv-cache-dtype bfloat16`), rounding as torch does.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from spillway.kernels.cpu import matvec, native
from spillway.kernels.cpu.native import address_of, bind

SOURCE = Path(__file__).with_name("csrc") / "decode_ops.c"
# The one-call decode loop's row limit (`decode_layers`); these operations take any.
MAX_ROWS = matvec.MAX_ROWS
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# The cache dtypes `store_kv` writes (from float32 rows).
STORE_DTYPES = (torch.float32, torch.bfloat16)


def compile_flags() -> list[str]:
    # Rotary must round like the torch path: no a * b - c * d contracted into one FMA.
    return [*matvec.compile_flags(), "-ffp-contract=off"]


def fits(rows: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether `rows` and `others` are float32 CPU tensors (any number of rows)."""
    return all(t.dtype == torch.float32 and t.is_cpu for t in (rows, *others))


class DecodeOps:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._norm = bind(library.add_rms_norm, None, [_PTR, _PTR, _PTR, _F32, _PTR, _I64, _I64])
        self._rotary = bind(
            library.rotary, ctypes.c_int, [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64]
        )
        store_args = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
        self._stores = {
            torch.float32: bind(library.store_kv, ctypes.c_int, store_args),
            torch.bfloat16: bind(library.store_kv_bf16, ctypes.c_int, store_args),
        }
        self._silu_mul = bind(library.silu_mul, None, [_PTR, _PTR, _I64, _I64])
        self._to_unit = bind(library.rows_to_unit, None, [_PTR, _PTR, _PTR, _I64, _I64])
        self._times = bind(library.rows_times, None, [_PTR, _PTR, _I64, _I64])
        self._use_pool = bind(library.decode_ops_use_pool, None, [_PTR])

    def use_pool(self, run_address: int | None) -> None:
        """The norm, rotary and gate of many rows on the process's shared helper threads
        (`pool.Pool.run_address`), or on OpenMP's (None). Set for the library, which every
        instance of this build shares; the outputs are the same either way."""
        self._use_pool(run_address)

    def addresses(self) -> dict[str, int | None]:
        """The operations' entry points, for native callers (`decode_layers`)."""
        fns = {
            "add_rms_norm": self._norm,
            "rotary": self._rotary,
            "store_kv": self._stores[torch.float32],
            "store_kv_bf16": self._stores[torch.bfloat16],
            "silu_mul": self._silu_mul,
        }
        return {name: address_of(fn) for name, fn in fns.items()}

    def add_rms_norm(
        self,
        x: torch.Tensor | None,  # [T, H] or None: norm only
        residual: torch.Tensor,  # [T, H], updated in place when x is given
        weight: torch.Tensor,  # [H]
        eps: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, hidden = residual.shape
        assert residual.is_contiguous() and weight.is_contiguous() and weight.numel() == hidden
        if x is not None:
            x = x.contiguous()
            assert x.shape == residual.shape
        target = out if out is not None and out.is_contiguous() else torch.empty_like(residual)
        self._norm(
            None if x is None else x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps,
            target.data_ptr(), rows, hidden,
        )  # fmt: skip
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target

    def rotary(
        self,
        heads: torch.Tensor,  # [T, H, D], unit stride in D, heads D apart
        positions: torch.Tensor,  # [T] int64
        cos_table: torch.Tensor,  # [P, D / 2]
        sin_table: torch.Tensor,
    ) -> None:
        tokens, nheads, d = heads.shape
        assert heads.stride(2) == 1 and heads.stride(1) == d
        assert positions.dtype == torch.int64 and positions.is_contiguous()
        assert cos_table.is_contiguous() and sin_table.is_contiguous()
        assert cos_table.shape == sin_table.shape and cos_table.shape[1] * 2 == d
        code = self._rotary(
            heads.data_ptr(), tokens, heads.stride(0), nheads, d, positions.data_ptr(),
            cos_table.data_ptr(), sin_table.data_ptr(), cos_table.shape[0],
        )  # fmt: skip
        if code != 0:
            raise IndexError(f"rotary: a position outside 0..{cos_table.shape[0] - 1}")

    def store_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D], rows of Hkv * D contiguous values
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D] contiguous, float32 or bfloat16
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [T] int64
    ) -> None:
        """k and v (float32) into their slots; a bfloat16 cache gets them rounded to the
        nearest, ties to even, as torch's `.to(torch.bfloat16)` rounds."""
        tokens, kv_heads, d = k.shape
        width = kv_heads * d
        for t in (k, v):
            assert t.shape == (tokens, kv_heads, d) and t.stride(2) == 1 and t.stride(1) == d
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert k.dtype == v.dtype == torch.float32
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in STORE_DTYPES
        assert k_cache.shape == v_cache.shape and k_cache.shape[2] * k_cache.shape[3] == width
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == tokens
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        code = self._stores[k_cache.dtype](
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), tokens, width, num_slots,
        )  # fmt: skip
        if code != 0:
            raise IndexError(f"store_kv: a slot past the cache's {num_slots}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 I] (gate, then up) -> silu(gate) * up [T, I]."""
        gate_up = gate_up.contiguous()
        tokens, width = gate_up.shape
        out = torch.empty(tokens, width // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), tokens, width // 2)
        return out

    def rows_to_unit(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, W] -> (x / s, s): s [T, 1] each row's largest magnitude (at least 1e-30),
        torch's `x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)`; the same values."""
        x = x.contiguous()
        tokens, width = x.shape
        out = torch.empty_like(x)
        scale = torch.empty(tokens, 1, dtype=x.dtype)
        self._to_unit(x.data_ptr(), out.data_ptr(), scale.data_ptr(), tokens, width)
        return out, scale

    def rows_times(self, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """y [T, W] *= scale [T, 1], in place (y contiguous)."""
        tokens, width = y.shape
        assert y.is_contiguous() and scale.is_contiguous() and scale.numel() == tokens
        self._times(y.data_ptr(), scale.data_ptr(), tokens, width)
        return y


def load(cache_dir: str | Path = native.DEFAULT_CACHE_DIR) -> DecodeOps | None:
    """The operations, built on first use; None where they cannot be built here."""
    library = native.build(SOURCE, compile_flags(), cache_dir)
    return None if library is None else DecodeOps(library)

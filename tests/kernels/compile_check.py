"""Compiles every kernel to GPU machine code ahead of time, with no GPU present.

The interpreter runs kernels as numpy and accepts programs the compiler rejects (and vice
versa), so each launcher's real arguments are captured and compiled for a Hopper target
with the integer and pointer specialisation a live launch would get. Triton's own helpers
are built for the interpreter when TRITON_INTERPRET is set, so this runs in a process of
its own: `python -m tests.kernels.compile_check` prints one JSON object per kernel.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch

import spillway.kernels._jit as kjit


def _launchers() -> dict:
    from spillway.kernels.decode_attention import paged_decode_attention
    from spillway.kernels.fused_moe import fused_experts
    from spillway.kernels.kv_store import store_kv
    from spillway.kernels.prefill_attention import paged_prefill_attention
    from spillway.kernels.rmsnorm import fused_add_rms_norm
    from spillway.kernels.rotary import rotary

    # Shapes of an 8B Llama at bf16; nothing is launched, so the tensors stay tiny.
    rows, q_heads, kv_heads, dim, bs = 4, 32, 8, 128, 16
    bf16 = torch.bfloat16
    q = torch.zeros(rows, q_heads, dim, dtype=bf16)
    cache = torch.zeros(2, bs, kv_heads, dim, dtype=bf16)
    tables = torch.zeros(rows, 8, dtype=torch.int32)
    ctx = torch.ones(rows, dtype=torch.int32)
    starts = torch.arange(rows + 1, dtype=torch.int32)
    kv = q[:, :kv_heads]
    hidden = torch.zeros(rows, 4096, dtype=bf16)
    positions = torch.zeros(rows, dtype=torch.int64)
    # a Qwen3-30B-A3B layer's experts, two of its 128 (the kernel's code does not depend on E)
    w_gate_up = torch.zeros(2, 2 * 768, 2048, dtype=bf16)
    w_down = torch.zeros(2, 2048, 768, dtype=bf16)
    topk_ids = torch.tensor([[0, 1]] * rows)
    topk_weights = torch.full((rows, 2), 0.5)

    def moe() -> None:
        x = hidden[:, :2048]
        for m in (16, 64):  # decode's tiles, then prefill's
            fused_experts(x, w_gate_up, w_down, topk_ids, topk_weights, block_m=m)
        # float32 (its own tile depth) at prefill's tiles
        f32 = (x.float(), w_gate_up.float(), w_down.float())
        fused_experts(*f32, topk_ids, topk_weights, block_m=64)

    return {
        "decode": lambda: paged_decode_attention(
            q, cache, cache, tables, ctx, 0.1, query_start=starts, num_splits=4
        ),
        "prefill": lambda: paged_prefill_attention(
            q, cache, cache, tables, ctx, starts, 0.1, skip_decode_rows=True
        ),
        "store_kv": lambda: store_kv(kv, kv, cache, cache, positions),
        "rms_norm": lambda: fused_add_rms_norm(hidden, hidden, hidden[0], 1e-5),
        "rotary": lambda: rotary(q, kv, positions, torch.zeros(8, 64), torch.zeros(8, 64)),
        "fused_moe": moe,
    }


def _capture(launch) -> list[tuple]:
    calls = []
    original = kjit.LazyKernel.__getitem__

    def capture(self, grid):
        return lambda *args, **kwargs: calls.append((self.fn, args, kwargs))

    kjit.LazyKernel.__getitem__ = capture
    try:
        launch()
    finally:
        kjit.LazyKernel.__getitem__ = original
    return calls


def _compile(fn, args, kwargs):
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kjit.jit_helpers(fn)  # the device functions it calls, as a live launch would
    jitted = JITFunction(fn)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(jitted.arg_names, args, strict=False)) | kwargs
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(jitted.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
            continue
        ty, attr = native_specialize_impl(CUDABackend, value, False, True, True)
        signature[param.name] = ty
        if ty == "constexpr":  # an integer 1 is specialised away, as at a live launch
            constants[param.name] = attr
        elif attr:
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    source = ASTSource(jitted, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> int:
    return run(_launchers)


def run(launchers: Callable[[], dict]) -> int:
    """Compiles every kernel each of `launchers()` launches, one JSON line per kernel (also
    `ssm_compile_check`'s, over the recurrent layers' launchers)."""
    os.environ.pop("TRITON_INTERPRET", None)
    try:  # private API, free to move between releases
        from triton._C.libtriton import native_specialize_impl  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        print(json.dumps({"skip": f"this triton cannot compile ahead of time: {e}"}))
        return 0
    for name, launch in launchers().items():
        for fn, args, kwargs in _capture(launch):
            entry = {"launcher": name, "kernel": fn.__name__}
            try:
                compiled = _compile(fn, args, dict(kwargs))
                entry |= {"cubin_bytes": len(compiled.asm["cubin"])}
                entry |= {"shared": compiled.metadata.shared}
            except Exception as e:  # reported, so the test names the kernel that failed
                entry["error"] = f"{type(e).__name__}: {e}"
            print(json.dumps(entry), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

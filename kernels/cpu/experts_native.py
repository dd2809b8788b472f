"""A MoE layer's experts in one native call (`csrc/experts.c`): the routed experts, grouped
by expert so that each expert's weights are read once per step, and the shared expert,
float32 on the CPU.

At batch 16-64 a decode step sends its rows to most of a layer's experts, a few rows each.
The per-expert loop of `experts.CpuExperts` (a Python call and an OpenMP fork per product)
and torch's `grouped_mm` (a loop of oneDNN products) spend most of such a step outside the
weight stream; this kernel is one call and one OpenMP region per layer, its work items
taken dynamically by the threads (on a shared machine a descheduled thread's share goes to
the others instead of stalling the barrier of every product). Built like `matvec`'s
library (cached per source and flags, AVX-512 where the CPU has it, else AVX2 + FMA);
`load` returns None where it cannot be built.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from spillway.kernels.cpu import native
from spillway.kernels.cpu.native import ptr
from spillway.kernels.cpu.step_threads import StepThreads

SOURCE = Path(__file__).with_name("csrc") / "experts.c"
# The vector paths the source has, best first.
ISAS = native.ISAS
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# experts_f32's C arguments.
_ARGS = [
    _PTR, _I64, _I64,  # x, tokens, hidden
    _PTR, _PTR, _I64,  # ids, weights, top-k
    _PTR, _PTR, _I64, _I64,  # w_gate_up, w_down, experts, intermediate
    _PTR, _PTR, _I64, _PTR,  # shared gate_up, down, intermediate, gate
    _PTR, ctypes.c_int,  # out, parallel
]  # fmt: skip
# Below this many bytes of weights a layer runs on the calling thread alone (waking a
# sleeping OpenMP thread costs more than it saves on a small layer).
PARALLEL_MIN_BYTES = 1 << 20
# Up to this many tokens a layer above that size runs on every thread or on the caller's
# alone by timing both (`StepThreads`): one decode row's layer is a few hundred
# microseconds, and where the services have taken the other core the region's end waits
# for it (a scheduler tick); more tokens always share the work.
TIMED_MAX_TOKENS = 8


class NativeExperts(native.IsaLibrary):
    source, what = SOURCE, "experts kernel"

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        super().__init__(library, isa)
        self._fn = native.bind(library.experts_f32, ctypes.c_int, _ARGS)
        self.threads = StepThreads()
        self.parallel: bool | None = None  # fixed by tests; None: timed (`TIMED_MAX_TOKENS`)

    @staticmethod
    def fits(
        x: torch.Tensor,
        w_gate_up: object,
        w_down: object,
        shared_gate_up: torch.Tensor | None = None,
        shared_down: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> bool:
        """Float32 CPU tensors, contiguous (experts kept in blocks are not read here)."""
        tensors = [x, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate]
        return all(
            t is None
            or (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.float32
                and t.device.type == "cpu"
                and t.is_contiguous()
            )
            for t in tensors
        )

    def __call__(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared_gate_up: torch.Tensor | None = None,
        shared_down: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]: sum over k of topk_weights[t, k] expert_{topk_ids[t, k]}(x[t]),
        plus the shared expert's output (scaled by sigmoid(x . shared_gate) where given);
        shapes as `kernels.moe` states them, shared_gate_up [2 Is, H], shared_down [H, Is],
        shared_gate [1, H]."""
        t, h = x.shape
        e, two_i, _ = w_gate_up.shape
        ids = topk_ids.contiguous()
        weights = topk_weights.contiguous()
        shared_inter = 0 if shared_gate_up is None else shared_gate_up.shape[0] // 2
        out = torch.empty(t, h, dtype=torch.float32)
        weight_bytes = (e if t * ids.shape[1] >= e else t * ids.shape[1]) * 3 * two_i // 2 * h * 4
        parallel = weight_bytes >= PARALLEL_MIN_BYTES and torch.get_num_threads() > 1
        timed = parallel and self.parallel is None and t <= TIMED_MAX_TOKENS
        if timed:
            parallel = self.threads.together(t)
        elif parallel and self.parallel is not None:
            parallel = self.parallel
        start = time.perf_counter_ns()
        code = self._fn(
            x.data_ptr(), t, h, ids.data_ptr(), weights.data_ptr(), ids.shape[1],
            w_gate_up.data_ptr(), w_down.data_ptr(), e, two_i // 2,
            ptr(shared_gate_up), ptr(shared_down), shared_inter, ptr(shared_gate),
            out.data_ptr(), int(parallel),
        )  # fmt: skip
        if timed:
            self.threads.record(t, parallel, time.perf_counter_ns() - start)
        if code == -1:
            raise MemoryError("native experts could not allocate their buffers")
        if code == -2:
            raise ValueError(f"an expert id lies outside [0, {e})")
        return out


def load(
    cache_dir: str | Path = native.DEFAULT_CACHE_DIR, isa: str | None = None
) -> NativeExperts | None:
    """The kernel built for `isa` on first use; None where it cannot be built here. By
    default the best path this CPU runs, and None where that is the portable one (the torch
    paths are then as fast); tests ask for each path by name."""
    if isa is None and native.best_isa() == "portable":
        return None
    return NativeExperts.load(cache_dir, isa)

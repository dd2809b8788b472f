"""Device helpers of the recurrent layers' kernels: their grid (`selective_state`,
`gated_delta` and the chunk scans `ssd_chunk_scan`, `gated_delta_chunk`), and for the
decode steps (`causal_conv1d` too) a row's state in the pool by its slot, and its output.
A padding row (slot < 0, `kernels.ssm_reference`) reads and writes no state and outputs
zeros.
"""

from __future__ import annotations

from spillway.kernels._jit import helper
from spillway.kernels._tl import tl


@helper
def row_head_lanes(BLOCK: tl.constexpr):
    """(row, head, this program's BLOCK lanes of the head's tiled dim): the grid is
    (rows, heads, blocks of that dim)."""
    return (
        tl.program_id(0).to(tl.int64),
        tl.program_id(1),
        tl.program_id(2) * BLOCK + tl.arange(0, BLOCK),
    )


@helper
def row_state(state_ptr, slots_ptr, row, stride_slot, lanes):
    """(The row's state in the pool, a mask over `lanes` that is False throughout for a
    padding row.) A padding row points at slot 0, so that even its masked addresses stay
    inside the pool."""
    slot = tl.load(slots_ptr + row)
    return state_ptr + tl.maximum(slot, 0) * stride_slot, (lanes * 0 + slot) >= 0


@helper
def store_output(out_ptrs, y, live, ok):
    """The row's outputs y at out_ptrs (lanes `ok`) in out's dtype: zeros where not `live`
    (a padding row)."""
    tl.store(out_ptrs, tl.where(live, y, 0.0).to(out_ptrs.dtype.element_ty), mask=ok)

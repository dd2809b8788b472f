"""Device helpers of the recurrent decode-step kernels (`causal_conv1d`, `selective_state`,
`gated_delta`): a row's state in the pool by its slot, and its output. A padding row
(slot < 0, `kernels.ssm_reference`) reads and writes no state and outputs zeros.
"""

from __future__ import annotations

from spillway.kernels._jit import helper
from spillway.kernels._tl import tl


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

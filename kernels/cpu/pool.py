"""The helper threads the native kernels of a process share for many-row work
(`csrc/pool.c`), in place of an OpenMP region per call.

A region under the worker's passive waits wakes a sleeping thread and its closing barrier
waits for it to check in, even when it finds no work left: about 90 us a region on a 2-core
VM, and a 64-row decode step of SmolLM2-135M opens some 150. The pool's calling thread
starts on the items at once and returns when they are done, whether or not a helper came;
a helper spins 200 us after its last item (the step's next call finds it awake) and then
sleeps. Kernels take it where handed in (`matmul_q8`'s many-row int8 product, `matvec`'s panel
kernel, the paged attention in `native`, the norm, rotary and gate of many rows in
`decode_ops`); their outputs are the same either way, each item computed on its own.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from spillway.kernels.cpu import native
from spillway.kernels.cpu.native import address_of, bind

SOURCE = Path(__file__).with_name("csrc") / "pool.c"


class Pool:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._start = bind(library.pool_start, ctypes.c_int, [ctypes.c_int])
        self._helpers = bind(library.pool_helpers, ctypes.c_int, [])
        self.run_address = address_of(library.pool_run)

    def start(self, helpers: int) -> int:
        """Helpers started until `helpers` run (they live as long as the process, and take
        the calling thread's float mode); returns how many run."""
        return int(self._start(helpers))

    @property
    def helpers(self) -> int:
        return int(self._helpers())


def load(cache_dir: str | Path = native.DEFAULT_CACHE_DIR) -> Pool | None:
    """The process's pool (one library per build: every caller gets the same threads),
    built on first use; None where it cannot be built here (no compiler, not Linux)."""
    library = native.build(SOURCE, [*native.compile_flags(), "-pthread"], cache_dir)
    return None if library is None else Pool(library)

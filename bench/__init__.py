"""Benchmarks, run from the checkout as `python -m bench.NAME`.

`python -m` puts the checkout first on sys.path, where the folder kernels/ would shadow
Hugging Face's `kernels` package (which transformers imports); the product is imported as
`spillway.*` from the installed package. So the checkout moves to the end of the path
before any benchmark imports anything.

The math threads of a benchmark wait as the worker's do (`SPILLWAY_CPU_WAIT_POLICY`'s
default, passive) unless OMP_WAIT_POLICY says otherwise: OpenMP's own default spins, and
the native kernels' threads and torch's (two OpenMP runtimes) then spin against each other
(an exact 128-token prefill at two threads took 525-570 ms so, 270-290 passive).
"""

from __future__ import annotations

import os as _os
import sys as _sys

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _ROOT] + [_ROOT]
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

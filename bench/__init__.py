"""Benchmarks, run from the checkout as `python -m bench.NAME`.

`python -m` puts the checkout first on sys.path, where the folder kernels/ would shadow
Hugging Face's `kernels` package (which transformers imports); the product is imported as
`spillway.*` from the installed package. So the checkout moves to the end of the path
before any benchmark imports anything.
"""

from __future__ import annotations

import os as _os
import sys as _sys

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _ROOT] + [_ROOT]

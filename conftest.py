"""Put the checkout last on sys.path, for every test process.

Tests import their helpers as `tests.*` and the benchmarks as `bench.*` from the checkout,
and the product as `spillway.*` from the installed package. The checkout also holds the
folders that package maps (services/, shared/, kernels/): first on the path, `kernels`
would name our folder for transformers, which imports Hugging Face's `kernels`. Last, every
installed package wins its name and the checkout serves only what nothing else has.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT] + [ROOT]

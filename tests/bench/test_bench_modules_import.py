"""Every benchmark module imports: a benchmark is run by hand, rarely, and a moved name
in the code it drives would otherwise surface only then."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

MODULES = sorted(p.stem for p in (Path(__file__).parents[2] / "bench").glob("*.py"))


def test_the_list_is_not_empty():
    assert "hybrid_prefill" in MODULES and len(MODULES) > 10


@pytest.mark.parametrize("name", MODULES)
def test_it_imports(name: str):
    module = importlib.import_module(f"bench.{name}")
    assert module.__name__ == f"bench.{name}"

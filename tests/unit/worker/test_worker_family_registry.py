"""The registry lists every family module: a module under models/ that defines a FAMILY is
found by each of its model_types, and no model_type belongs to two families."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from spillway.services.worker import models
from spillway.services.worker.models.registry import FAMILIES, family_for


def test_every_family_module_is_registered_under_each_of_its_model_types():
    found = []
    for info in pkgutil.iter_modules(models.__path__):
        module = importlib.import_module(f"{models.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if family is not None:
            found.append(family)
            assert all(FAMILIES[t] is family for t in family.model_types), info.name
    model_types = [t for f in found for t in f.model_types]
    assert len(model_types) == len(set(model_types)) == len(FAMILIES)


def test_an_unknown_model_type_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*qwen3_next"):
        family_for("gpt2")

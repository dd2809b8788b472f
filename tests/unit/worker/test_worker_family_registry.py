"""The registry lists every family module: a module under models/ that defines a FAMILY is
found by each of its model_types, and no model_type belongs to two families; a GGUF
file's family options are read by its family's hook."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace

import pytest

from spillway.services.worker import models
from spillway.services.worker.models.registry import FAMILIES, family_for, load_model_config
from spillway.shared.model_config import load_base_config
from spillway.shared.model_files import resolve_model
from tests.gguf_files import write_header_only


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


def test_a_gguf_file_s_family_options_come_from_the_family_s_hook(tmp_path, monkeypatch):
    """shared.model_config reads the fields every family shares (what the gateway reads);
    the family's read_gguf reads the rest from the file's keys, each named without the
    architecture's prefix. A family without the hook gets the shared fields alone."""
    keys = {
        "block_count": 2, "embedding_length": 64, "attention.head_count": 4,
        "attention.key_length": 16, "attention.sliding_window": 8, "vocab_size": 256,
    }  # fmt: skip
    source = resolve_model(str(write_header_only(tmp_path / "g.gguf", "gemma2", **keys)))
    base = load_base_config(source)
    assert (base.layer_windows, base.attention_scale, base.embedding_scale) == ((), None, 1.0)
    assert base.extra["gguf_keys"]["attention.sliding_window"] == 8
    assert load_model_config(source).layer_windows == (8, None)

    asked = []

    def read_gguf(key, config):
        asked.extend([key("attention.sliding_window", None), key("no.such.key", "absent")])
        return replace(config, num_mtp_layers=1)

    monkeypatch.setitem(FAMILIES, "gemma2", replace(FAMILIES["gemma2"], read_gguf=read_gguf))
    assert load_model_config(source).num_mtp_layers == 1 and asked == [8, "absent"]
    monkeypatch.setitem(FAMILIES, "gemma2", replace(FAMILIES["gemma2"], read_gguf=None))
    assert load_model_config(source) == base

"""vLLM's serving options on the command line: lists travel to child processes intact,
and --allowed-origins takes vLLM's JSON list form as well as plain words."""

from __future__ import annotations

import argparse

import pytest

from spillway.services.cli.options import add_options, as_arguments, overrides_from
from spillway.shared.config import load_settings


def _parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_options(parser, load_settings())
    return load_settings(**overrides_from(parser.parse_args(list(argv))))


def test_lists_and_values_survive_the_trip_to_a_child():
    settings = _parse(
        "--served-model-name", "a", "b", "--max-model-len", "128",
        "--chat-template", "t.jinja", "--allowed-origins", "https://x.example", "*",
    )  # fmt: skip
    assert settings.served_model_name == ["a", "b"]
    assert settings.allowed_origins == ["https://x.example", "*"]
    child = _parse(*as_arguments(settings))
    for name in ("served_model_name", "max_model_len", "chat_template", "allowed_origins"):
        assert getattr(child, name) == getattr(settings, name)


def test_allowed_origins_in_vllms_json_form():
    assert _parse("--allowed-origins", '["https://a.example"]').allowed_origins == [
        "https://a.example"
    ]
    with pytest.raises(SystemExit):
        _parse("--allowed-origins", "[not json")

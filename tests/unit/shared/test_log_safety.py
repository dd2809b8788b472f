"""Error text for logs and health bodies keeps the error's kind and drops payload."""

from __future__ import annotations

import os
import re

import pytest
import redis
import torch
from pydantic import BaseModel, ValidationError

from spillway.shared.log_safety import BINARY, error_text, safe_text, size_text

KV_VALUE = bytes(range(256)) * 64 + os.urandom(4096)
# What the end-to-end check calls binary in a log line.
BINARY_TRACE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufffd]|(?:\\x[0-9a-fA-F]{2}){8,}")


def _refused_pipeline_write() -> redis.ResponseError:
    """The exception redis-py raises for a pipelined SET refused at maxmemory."""
    e = redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
    redis.client.Pipeline.annotate_exception(
        None, e, 1, ("SET", "spill:seq:r1:1:0", KV_VALUE, "EX", 3600)
    )
    return e


def _printable(text: str) -> bool:
    return text.isprintable() and "\\x" not in text and "\ufffd" not in text


def test_a_refused_pipeline_write_keeps_kind_command_and_reason_not_the_value():
    e = _refused_pipeline_write()
    assert not _printable(str(e))  # what a plain "%s" of it logged
    text = error_text(e)
    assert text == (
        "OutOfMemoryError: command #1 (SET ...) of pipeline failed: "
        "command not allowed when used memory > 'maxmemory'."
    )


def test_quoted_input_is_dropped():
    class Submit(BaseModel):
        max_tokens: int

    with pytest.raises(ValidationError) as info:
        Submit.model_validate({"max_tokens": "Tell me the secret plan for Tuesday"})
    text = error_text(info.value)
    assert "secret plan" not in text and "max_tokens" in text
    assert "input_value=..." in text


@pytest.mark.parametrize(
    "shown",
    [repr, lambda b: b.decode("utf-8", errors="replace"), lambda b: b.decode("latin-1")],
    ids=["repr", "lossy-utf8", "latin-1"],
)
@pytest.mark.parametrize(
    "value",
    [os.urandom(2048), torch.randn(512).numpy().tobytes()],
    ids=["random", "float32-kv"],
)
def test_binary_runs_become_a_marker(shown, value):
    text = safe_text(f"value {shown(value)} refused", limit=100_000)
    assert text.startswith("value ") and text.endswith(" refused") and BINARY in text
    assert not BINARY_TRACE.search(text), text
    assert len(text) < len(shown(value)) / 4  # what is left is the few printable bytes


def test_plain_text_is_kept_and_long_text_cut():
    assert safe_text("Connection refused (port 6379)") == "Connection refused (port 6379)"
    assert safe_text("line one\nline two") == "line one line two"
    assert len(safe_text("x" * 1000, limit=50)) == 50


def test_sizes_read_as_words():
    assert [size_text(n) for n in (512, 1536, 3 * 1024 * 1024)] == ["512 B", "1.5 KB", "3.0 MB"]

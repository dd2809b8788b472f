"""`--trace-file` and `--log-format` on `spillway up` and `spillway serve`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SPILLWAY = str(Path(sys.executable).with_name("spillway"))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SPILLWAY, *args], capture_output=True, text=True, timeout=60)


def test_up_and_serve_offer_both_options_with_their_defaults():
    for command in (["up"], ["serve", "gateway"]):
        text = " ".join(_run(*command, "--help").stdout.split())
        assert "--trace-file TRACE_FILE" in text, command
        assert "--log-format {text,json}" in text, command
        assert "(default: text)" in text


def test_a_log_format_other_than_text_or_json_is_refused():
    r = _run("up", "--log-format", "xml")
    assert r.returncode == 2
    assert "invalid choice: 'xml'" in r.stderr


def test_an_unwritable_trace_file_stops_up_before_anything_starts(tmp_path):
    path = tmp_path / "no-such-dir" / "spans.jsonl"
    r = _run("up", "--trace-file", str(path))
    assert r.returncode == 1
    assert f"--trace-file {path}: No such file or directory" in r.stderr
    assert "ready" not in r.stdout

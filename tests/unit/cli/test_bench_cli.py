"""`spillway bench` and the worker options on the command line."""

from __future__ import annotations

import pytest

from services.cli.main import build_parser, main


def test_bench_options_default_to_the_p1_workload():
    args = build_parser().parse_args(["bench"])
    assert (args.requests, args.input_len, args.output_len) == (64, 128, 128)
    assert args.rate == float("inf") and args.concurrency is None and not args.compare


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--requests", "0"], "at least 1"),
        (["bench", "--rate", "-1"], "rate"),
        (["bench", "--launch", "--url", "http://127.0.0.1:1"], "not both"),
    ],
)
def test_bad_bench_options_are_clear_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_up_lists_the_worker_cpu_options(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads THREADS worker math threads on the CPU (default: every core" in text
    assert "--quantize {none,int8}" in text

"""`spillway bench` and the worker options on the command line."""

from __future__ import annotations

import pytest

from spillway.services.cli.main import build_parser, main


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


def test_a_subprocess_peer_runs_with_the_environment_it_is_given(tmp_path, monkeypatch):
    """llama.cpp runs with the environment from before the bench set our OpenMP wait policy
    (passive waits would cost its barriers most of its speed): the peer process gets the
    `env` handed in, not this process's."""
    import json
    import os
    import sys

    from spillway.services.cli.bench import peers
    from spillway.services.cli.bench.workload import BenchRequest

    script = tmp_path / "peer.py"
    script.write_text(
        "import json, os, sys\n"
        "spec = json.loads(sys.stdin.read())\n"
        "policy = os.environ.get('OMP_WAIT_POLICY', 'unset')\n"
        "print(json.dumps({'output_ids': [[1]], 'duration_s': 0.5, 'note': policy}))\n"
    )
    monkeypatch.setitem(peers.PEER_SCRIPTS, "probe", script)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    requests = [BenchRequest(0, [5, 6], 1, 0.0)]
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    given = peers.run_subprocess_peer("probe", sys.executable, "m.gguf", requests, env=clean)
    inherited = peers.run_subprocess_peer("probe", sys.executable, "m.gguf", requests)
    assert given.error is None and given.note == "unset", given.error
    assert inherited.note == "PASSIVE"
    assert json.dumps(given.output_ids) == "[[1]]"


@pytest.mark.parametrize("signame", ["SIGSEGV", "SIGILL"])
def test_llama_cpp_crashing_with_its_extra_buffers_runs_again_without_them(
    tmp_path, monkeypatch, signame
):
    """A llama.cpp build whose repacked (AMX) weights crash `llama_decode` (a segfault or
    an illegal instruction) is measured without them, and its note says so; one that runs
    is run once, as it comes."""
    import sys

    from spillway.services.cli.bench import peers
    from spillway.services.cli.bench.workload import BenchRequest

    calls = tmp_path / "calls"
    script = tmp_path / "peer.py"
    script.write_text(
        "import json, os, signal, sys\n"
        "spec = json.loads(sys.stdin.read())\n"
        f"open({str(calls)!r}, 'a').write(str(spec.get('extra_bufts')) + '\\n')\n"
        "if spec.get('extra_bufts') is not False and spec['model'] == 'crash.gguf':\n"
        f"    os.kill(os.getpid(), signal.{signame})\n"
        "print(json.dumps({'output_ids': [[1]], 'duration_s': 0.5, 'note': 'ran'}))\n"
    )
    monkeypatch.setitem(peers.PEER_SCRIPTS, "llama.cpp", script)
    requests = [BenchRequest(0, [5, 6], 1, 0.0)]
    crashed = peers.run_llama_cpp_peer(sys.executable, "crash.gguf", requests)
    assert crashed.error is None and crashed.output_ids == [[1]]
    assert (
        crashed.note
        == f"ran; extra buffer types (AMX repacking) off: it died of {signame} with them"
    )
    assert calls.read_text().split() == ["None", "False"]
    calls.unlink()
    fine = peers.run_llama_cpp_peer(sys.executable, "fine.gguf", requests)
    assert fine.error is None and fine.note == "ran"
    assert calls.read_text().split() == ["None"]


def test_the_launched_system_serves_the_benchs_model_unless_the_launch_args_name_one():
    from spillway.services.cli.bench.command import launch_args

    assert launch_args("--port 0", "/m/q4.gguf") == ["--model", "/m/q4.gguf", "--port", "0"]
    assert launch_args("--model /m/other.gguf", "/m/q4.gguf") == ["--model", "/m/other.gguf"]
    assert launch_args("--model=/m/x.gguf --workers 2", "d") == [
        "--model=/m/x.gguf",
        "--workers",
        "2",
    ]

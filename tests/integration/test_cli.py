"""The `spillway` command line: help, option errors, private servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spillway.services.cli import up as up_module
from spillway.services.cli.servers import free_port, port_open
from spillway.shared.config import load_settings

SPILLWAY = str(Path(sys.executable).with_name("spillway"))
CONTRACT_OPTIONS = [
    "--host", "--port", "--model", "--workers", "--kv-blocks", "--block-size", "--max-batch",
    "--dtype", "--preemption-mode", "--no-prefix-cache", "--namespace", "--api-key",
    "--nats-url", "--redis-url", "--otlp-endpoint",
]  # fmt: skip


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SPILLWAY, *args], capture_output=True, text=True, timeout=60)


def test_help_lists_every_option_with_its_default():
    top = _run("--help")
    assert top.returncode == 0 and "up" in top.stdout and "serve" in top.stdout
    r = _run("up", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for opt in CONTRACT_OPTIONS:
        assert opt in text, opt
    assert "(default: 8000)" in text and "(default: SmolLM2-135M-Instruct)" in text
    assert "(default: nats://127.0.0.1:4222)" in text


def test_invalid_option_value_is_a_clear_error():
    r = _run("up", "--block-size", "24")
    assert r.returncode == 2
    assert "block size must be a power of two" in r.stderr


def test_several_workers_share_the_cores_and_take_one_gpu_each():
    one = up_module.worker_launches(load_settings(workers=1), 16, ["0", "1"])
    assert one == [([], {})]
    two = up_module.worker_launches(load_settings(workers=2), 16, [])
    assert two == [(["--threads", "8"], {})] * 2
    pinned = up_module.worker_launches(load_settings(workers=3, threads=2), 2, ["0", "1"])
    assert [extra for extra, _ in pinned] == [[], [], []]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in pinned] == ["0", "1", "0"]


def test_expert_parallel_workers_are_groups_of_ranks_with_a_rendezvous_each():
    ports = iter([29500, 29501])
    launches = up_module.worker_launches(
        load_settings(workers=2, expert_parallel=2), 8, ["0", "1", "2", "3"], lambda: next(ports)
    )
    assert [extra for extra, _ in launches] == [
        ["--threads", "2", "--expert-parallel", "2", "--dist-url", f"tcp://127.0.0.1:{port}",
         "--rank", str(rank)]
        for port in (29500, 29501)
        for rank in (0, 1)
    ]  # fmt: skip
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launches] == ["0", "1", "2", "3"]


def test_expert_parallel_on_a_dense_model_is_refused_before_anything_starts(tmp_path):
    from tests.unit.worker.tiny_llama import write_synthetic_config

    path = write_synthetic_config(tmp_path)
    r = _run("up", "--model", f"synthetic:{path}", "--expert-parallel", "2")
    assert r.returncode == 1
    assert "--expert-parallel 2:" in r.stderr and "is a dense model" in r.stderr


def test_private_servers_start_when_the_default_urls_do_not_answer(monkeypatch):
    nats_default = f"nats://127.0.0.1:{free_port()}"
    redis_default = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setattr(up_module, "DEFAULT_NATS_URL", nats_default)
    monkeypatch.setattr(up_module, "DEFAULT_REDIS_URL", redis_default)
    settings = load_settings(nats_url=nats_default, redis_url=redis_default)
    resolved, started = up_module.ensure_servers(settings)
    try:
        assert [s.name for s in started] == ["nats", "redis"]
        assert resolved.nats_url != nats_default and resolved.redis_url != redis_default
        for url in (resolved.nats_url, resolved.redis_url):
            host_port = url.split("//")[1].split("/")[0]
            assert port_open("127.0.0.1", int(host_port.split(":")[1]))
    finally:
        for s in started:
            s.stop()
    assert all(s.proc.poll() is not None for s in started)


def test_an_unreachable_explicit_url_is_an_error():
    settings = load_settings(nats_url=f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(up_module.StartupError, match="no NATS server answers"):
        up_module.ensure_servers(settings)


def test_reachable_servers_are_used_as_they_are(nats_url, redis_url):
    settings = load_settings(nats_url=nats_url, redis_url=redis_url)
    resolved, started = up_module.ensure_servers(settings)
    assert started == []
    assert (resolved.nats_url, resolved.redis_url) == (nats_url, redis_url)

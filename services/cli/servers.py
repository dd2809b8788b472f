"""Private nats-server / redis-server processes on free ports.

Used by `spillway up` when no server answers at the default URL, and by the tests,
which always talk to real servers.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SEARCH_DIRS = ("/usr/sbin", "/usr/bin", "/usr/local/bin", "/opt/homebrew/bin")


def find_binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for d in SEARCH_DIRS:
        if Path(d, name).is_file():
            return str(Path(d, name))
    raise FileNotFoundError(
        f"{name} is not installed: run `make install` (it installs it with apt) or install it"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class ServerProcess:
    name: str
    url: str
    proc: subprocess.Popen
    workdir: tempfile.TemporaryDirectory = field(repr=False)
    # A nats-server with per-service users: each user's password (see nats_auth.py).
    passwords: dict[str, str] = field(default_factory=dict, repr=False)
    monitor_url: str | None = None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.workdir.cleanup()


def _wait_for_port(proc: subprocess.Popen, name: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start")
        if port_open("127.0.0.1", port):
            return
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not open port {port} within {timeout}s")


def start_nats(timeout: float = 10.0, users_namespace: str | None = None) -> ServerProcess:
    """A private nats-server. With `users_namespace` (a namespace, "" for the default) it
    runs with one user per service and the `client` user for everyone else, its
    permissions scoped to that namespace's subjects (nats_auth.py)."""
    port = free_port()
    workdir = tempfile.TemporaryDirectory(prefix="spillway-nats-")
    binary = find_binary("nats-server")
    passwords: dict[str, str] = {}
    monitor_url = None
    if users_namespace is None:
        args = [binary, "-a", "127.0.0.1", "-p", str(port)]
    else:
        from spillway.services.cli.nats_auth import new_passwords, server_config

        passwords = new_passwords()
        monitor_port = free_port()
        monitor_url = f"http://127.0.0.1:{monitor_port}"
        config = Path(workdir.name, "nats.conf")
        config.write_text(server_config(port, passwords, users_namespace, monitor_port))
        config.chmod(0o600)
        args = [binary, "-c", str(config)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_port(proc, "nats-server", port, timeout)
    url = f"nats://127.0.0.1:{port}"
    return ServerProcess("nats", url, proc, workdir, passwords, monitor_url)


def start_redis(timeout: float = 10.0, port: int | None = None) -> ServerProcess:
    """On `port` when given (a restart where clients expect it), else on a free one."""
    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="spillway-redis-")
    args = [
        find_binary("redis-server"),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--dir", workdir.name,
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_port(proc, "redis-server", port, timeout)
    return ServerProcess("redis", f"redis://127.0.0.1:{port}/0", proc, workdir)

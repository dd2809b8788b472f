"""A whole system started through its CLI (`spillway up --port 0`) as a child process.

Used by the end-to-end tests and the benchmarks: they drive the system exactly as a user
would, through its command and its APIs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from spillway.services.cli.children import Child

SPILLWAY = str(Path(sys.executable).with_name("spillway"))
SERVICES = ("gateway", "scheduler", "worker", "spillstore")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has not collected it yet.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


class System:
    def __init__(self, *args: str, timeout: float = 300.0, env: dict[str, str] | None = None):
        # Kept after the run: a failing test prints its tail.
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="spillway-up-", suffix=".log", delete=False
        )
        self.lines: list[str] = []
        self.url = ""
        self.proc = subprocess.Popen(
            [SPILLWAY, "up", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError(f"spillway up did not get ready:\n{self.tail()}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if line.startswith("ready: "):
                self.url = line.removeprefix("ready: ").strip()
                self._ready.set()
        self._ready.set()  # exited before ready

    def tail(self, n: int = 60) -> str:
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(self.lines[-20:] + text.splitlines()[-n:])

    def service_pids(self) -> dict[str, int]:
        pids = {}
        for pid in _children(self.proc.pid):
            cmd = _cmdline(pid)
            for s in SERVICES:
                if f" serve {s} " in f"{cmd} ":
                    pids[s] = pid
        return pids

    def worker_pids(self) -> list[int]:
        """Every worker process (`--workers N` starts N)."""
        return [pid for pid in _children(self.proc.pid) if " serve worker " in f"{_cmdline(pid)} "]

    def all_descendants(self) -> list[int]:
        out, todo = [], [self.proc.pid]
        while todo:
            kids = _children(todo.pop())
            out += kids
            todo += kids
        return out

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for pid in self.all_descendants():
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_until(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def _ready_by(child: Child, deadline: float) -> bool:
    """Waits for `child` to be ready; False once it died or the deadline passed."""
    while not child.ready.wait(0.1):
        if not child.alive or time.monotonic() > deadline:
            return False
    return True


class ServiceGroup:
    """Services started each with `spillway serve` (the docker compose way), one by one
    or side by side, so a test can stop, restart or kill any one of them while the others
    keep running."""

    def __init__(self, *common: str, env: dict[str, str] | None = None) -> None:
        self.common = list(common)
        self.env = {**os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="spillway-services-", suffix=".log", delete=False, mode="w"
        )
        self.children: dict[str, Child] = {}
        self._starting: dict[str, Child] = {}  # launched, not yet waited for
        self.lines: list[str] = []

    def start(
        self,
        service: str,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 300,
        name: str | None = None,
    ) -> Child:
        """Starts `service` and waits until it is ready; `name` (default: the service)
        is what stop() knows it by, so that two workers can run side by side."""
        child = self.launch(service, *args, env=env, name=name)
        self.wait_ready(timeout)
        return child

    def launch(
        self, service: str, *args: str, env: dict[str, str] | None = None, name: str | None = None
    ) -> Child:
        """Starts `service` without waiting for it (wait_ready does): services that need
        nothing of each other load side by side."""
        child = Child(
            service,
            [*self.common, *args],
            {**self.env, **(env or {})},
            self.lines.append,
            stderr=self.log,
        )
        self._starting[name or service] = child
        return child

    def wait_ready(self, timeout: float = 300) -> None:
        """Until every service launched since the last wait is ready; one that dies or is
        not ready within `timeout` is killed (with the others still starting) and it
        raises."""
        deadline = time.monotonic() + timeout
        starting, self._starting = self._starting, {}
        late = next((c for c in starting.values() if not _ready_by(c, deadline)), None)
        for name, child in starting.items():
            if child.ready.is_set():
                self.children[name] = child  # stop_all stops it
            else:
                child.kill()
        if late is not None:
            raise RuntimeError(f"{late.service} did not get ready:\n{self.tail()}")

    @property
    def url(self) -> str:
        """The gateway's base URL (from its readiness line)."""
        return self.children["gateway"].ready_detail.split()[0]

    def stop(self, service: str, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        child = self.children.pop(service)
        if child.alive:
            child.proc.send_signal(sig)
            if not child.wait(timeout):
                child.kill()
        return child.proc.returncode

    def stop_all(self, timeout: float = 30) -> None:
        """SIGTERM to every service at once, then each waited for (one by one, each
        process's own exit took a second or more); one still running at the end of
        `timeout` is killed."""
        children = list(self.children.values())
        self.children.clear()
        for child in children:
            child.terminate()
        deadline = time.monotonic() + timeout
        for child in children:
            if not child.wait(max(0.0, deadline - time.monotonic())):
                child.kill()

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(self.lines[-20:] + text.splitlines()[-n:])

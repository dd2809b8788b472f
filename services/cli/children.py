"""Child service processes of `spillway up`: spawned, watched for readiness, stopped.

Each child runs `spillway serve <service>` in its own session (so a terminal's Ctrl-C
reaches only the parent, which stops the children in order) and dies with the parent
on Linux even if the parent is killed outright.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO

from spillway.shared.lifecycle import READY_MARK

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):  # not Linux: the orderly shutdown still applies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def popen_child(args: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        args, env=env, start_new_session=True, preexec_fn=_die_with_parent, **kw
    )


class Child:
    """One service process; its stdout is forwarded line by line and watched for `ready`."""

    def __init__(
        self,
        service: str,
        args: list[str],
        env: dict[str, str],
        emit: Callable[[str], None],
        stderr: IO[str] | None = None,
    ) -> None:
        self.service = service
        self._spec = (args, env, emit)
        self.ready = threading.Event()
        self.ready_detail = ""
        self.proc = popen_child(
            [sys.executable, "-P", "-m", "spillway.services.cli.main", "serve", service, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            bufsize=1,
        )
        self._emit = emit
        self._reader = threading.Thread(target=self._read, name=f"{service}-out", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            marker = f"spillway-{self.service} {READY_MARK}"
            if line.startswith(marker) and not self.ready.is_set():
                self.ready_detail = line[len(marker) :].strip()
                self.ready.set()
            self._emit(line)

    def respawn(self) -> Child:
        """The same service started again, in a new process."""
        return Child(self.service, *self._spec)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait()

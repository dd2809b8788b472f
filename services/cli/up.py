"""`spillway up`: every service as its own process, private NATS/Redis when needed."""

from __future__ import annotations

import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

from services.cli.children import Child
from services.cli.options import as_arguments
from services.cli.servers import ServerProcess, port_open, start_nats, start_redis
from shared.config import DEFAULT_NATS_URL, DEFAULT_REDIS_URL, Settings, child_environment

START_ORDER = ("spillstore", "scheduler", "worker", "gateway")
STARTUP_TIMEOUT_S = 300.0


class StartupError(RuntimeError):
    pass


def _reachable(url: str, default_port: int) -> bool:
    u = urlparse(url)
    return port_open(u.hostname or "127.0.0.1", u.port or default_port)


def ensure_servers(settings: Settings) -> tuple[Settings, list[ServerProcess]]:
    """Uses the servers at the configured URLs; starts private ones for default URLs
    that do not answer; fails clearly for a non-default URL that does not answer."""
    started: list[ServerProcess] = []
    nats_url, redis_url = settings.nats_url, settings.redis_url
    if not _reachable(nats_url, 4222):
        if nats_url != DEFAULT_NATS_URL:
            raise StartupError(f"no NATS server answers at {nats_url}")
        started.append(start_nats())
        nats_url = started[-1].url
        print(f"nats: started a private nats-server at {nats_url}", flush=True)
    if not _reachable(redis_url, 6379):
        if redis_url != DEFAULT_REDIS_URL:
            raise StartupError(f"no Redis server answers at {redis_url.split('@')[-1]}")
        started.append(start_redis())
        redis_url = started[-1].url
        print(f"redis: started a private redis-server at {redis_url}", flush=True)
    return settings.with_overrides(nats_url=nats_url, redis_url=redis_url), started


def check_supported(settings: Settings) -> None:
    if settings.workers > 1:
        raise StartupError("--workers above 1 is not available yet: run one worker per system")


def wait_healthy(url: str, children: list[Child], stop: threading.Event, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        _raise_if_dead(children)
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        stop.wait(0.2)
    if not stop.is_set():
        raise StartupError(f"{url}/health did not turn 200 within {timeout:.0f}s")


def _raise_if_dead(children: list[Child]) -> None:
    for c in children:
        if not c.alive:
            raise StartupError(f"{c.service} exited with code {c.proc.returncode} during start")


def wait_ready(children: list[Child], stop: threading.Event, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(c.ready.is_set() for c in children):
        if stop.is_set():
            return
        _raise_if_dead(children)
        if time.monotonic() > deadline:
            late = [c.service for c in children if not c.ready.is_set()]
            raise StartupError(f"not ready within {timeout:.0f}s: {', '.join(late)}")
        stop.wait(0.1)


def stop_children(children: list[Child], drain_timeout_s: float) -> None:
    """Gateway first (it stops accepting and lets running requests finish), then the rest."""
    gateways = [c for c in children if c.service == "gateway"]
    others = [c for c in children if c.service != "gateway"]
    for group, grace in ((gateways, drain_timeout_s + 5.0), (others, 10.0)):
        for c in group:
            c.terminate()
        deadline = time.monotonic() + grace
        for c in group:
            if not c.wait(max(0.0, deadline - time.monotonic())):
                c.kill()


def _emit(line: str) -> None:
    print(line, flush=True)


def up(settings: Settings) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    servers: list[ServerProcess] = []
    children: list[Child] = []
    code = 0
    try:
        check_supported(settings)
        settings, servers = ensure_servers(settings)
        args = as_arguments(settings)
        env = child_environment()
        children = [Child(s, args, env, _emit) for s in START_ORDER]
        wait_ready(children, stop, STARTUP_TIMEOUT_S)
        if not stop.is_set():
            gateway = next(c for c in children if c.service == "gateway")
            url = gateway.ready_detail.split()[0]
            wait_healthy(url, children, stop, STARTUP_TIMEOUT_S)
            if not stop.is_set():
                print(f"ready: {url}", flush=True)
        watch(children, stop)
    except StartupError as e:
        print(f"spillway: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        stop_children(children, settings.drain_timeout_s)
        for s in servers:
            s.stop()
    return code


def watch(children: list[Child], stop: threading.Event) -> None:
    """Runs until Ctrl-C / SIGTERM. A child that exits is reported; the rest keep serving
    (a dead worker shows as 503 on /health, which is what clients should see)."""
    reported: set[str] = set()
    while not stop.wait(0.5):
        for c in children:
            if not c.alive and c.service not in reported:
                reported.add(c.service)
                print(
                    f"spillway: {c.service} exited with code {c.proc.returncode}",
                    file=sys.stderr,
                    flush=True,
                )
        if len(reported) == len(children):
            raise StartupError("every service has exited")

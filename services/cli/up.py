"""`spillway up`: every service as its own process, private NATS/Redis when needed.

A private nats-server gets one user per service (nats_auth.py): each child connects with
its own credentials, handed over in its environment, and clients without credentials may
use the public `llm.*` subjects only.

While it runs, `spillway up` supervises its children: one that exits is restarted after
a backoff, with a log line; one that keeps exiting (a crash loop, supervisor.py) stops
the whole system with an error. Ctrl-C or SIGTERM drains: the gateway answers new
requests with 503, lets running ones finish for up to drain_timeout_s, ends the rest
with finish_reason "abort"; then every child stops and the exit code is 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlparse

from spillway.services.cli.children import Child
from spillway.services.cli.options import as_arguments
from spillway.services.cli.servers import (
    ServerProcess,
    free_port,
    port_open,
    start_nats,
    start_redis,
)
from spillway.services.cli.supervisor import RestartPolicy, RestartTracker
from spillway.shared.clock import MonotonicClock
from spillway.shared.config import DEFAULT_NATS_URL, DEFAULT_REDIS_URL, Settings, child_environment

START_ORDER = ("spillstore", "scheduler", "worker", "gateway")
STARTUP_TIMEOUT_S = 300.0
WATCH_INTERVAL_S = 0.2


class StartupError(RuntimeError):
    pass


def _reachable(url: str, default_port: int) -> bool:
    u = urlparse(url)
    return port_open(u.hostname or "127.0.0.1", u.port or default_port)


def ensure_servers(settings: Settings) -> tuple[Settings, list[ServerProcess]]:
    """Uses the servers at the configured URLs; starts private ones for default URLs
    that do not answer (or always, with private_servers); fails clearly for a
    non-default URL that does not answer."""
    started: list[ServerProcess] = []
    nats_url, redis_url = settings.nats_url, settings.redis_url
    if settings.private_servers or not _reachable(nats_url, 4222):
        if nats_url != DEFAULT_NATS_URL and not settings.private_servers:
            raise StartupError(f"no NATS server answers at {nats_url}")
        started.append(start_nats(users_namespace=settings.namespace))
        nats_url = started[-1].url
        print(
            f"nats: started a private nats-server at {nats_url} (one user per service; "
            f"clients connect without credentials and may use llm.* only; monitoring at "
            f"{started[-1].monitor_url})",
            flush=True,
        )
    if settings.private_servers or not _reachable(redis_url, 6379):
        if redis_url != DEFAULT_REDIS_URL and not settings.private_servers:
            raise StartupError(f"no Redis server answers at {redis_url.split('@')[-1]}")
        started.append(start_redis())
        redis_url = started[-1].url
        print(f"redis: started a private redis-server at {redis_url}", flush=True)
    return settings.with_overrides(nats_url=nats_url, redis_url=redis_url), started


def service_environment(service: str, servers: list[ServerProcess]) -> dict[str, str]:
    """A child's environment: ours, plus its own NATS user on a private server."""
    nats = next((s for s in servers if s.name == "nats" and s.passwords), None)
    if nats is None:
        return child_environment()
    return child_environment(
        {"SPILLWAY_NATS_USER": service, "SPILLWAY_NATS_PASSWORD": nats.passwords[service]}
    )


def worker_launches(
    settings: Settings,
    num_cpus: int,
    gpus: list[str],
    free_port: Callable[[], int] = free_port,
) -> list[tuple[list[str], dict[str, str]]]:
    """`--workers N`: the extra arguments and environment of each of N worker processes,
    each with its own KV pool. Without --threads they share the cores between them (N
    workers each spinning on every core would only fight); on a machine with several GPUs
    each gets one, in turn.

    `--expert-parallel P`: each worker is P processes (ranks 0..P-1, rank 0 the one the
    scheduler sees) meeting at a rendezvous of their own on a free local port; the cores
    and GPUs are shared out over all N * P processes."""
    n, p = settings.workers, settings.expert_parallel
    extra: list[str] = []
    if settings.threads is None and n * p > 1:
        extra = ["--threads", str(max(1, num_cpus // (n * p)))]
    launches = []
    for i in range(n):
        group = (
            ["--expert-parallel", str(p), "--dist-url", f"tcp://127.0.0.1:{free_port()}"]
            if p > 1
            else []
        )
        for r in range(p):
            k = i * p + r
            env = (
                {"CUDA_VISIBLE_DEVICES": gpus[k % len(gpus)]} if n * p > 1 and len(gpus) > 1 else {}
            )
            ranked = [*group, "--rank", str(r)] if p > 1 else []
            launches.append(([*extra, *ranked], env))
    return launches


def check_servable_model(settings: Settings) -> None:
    """A GGUF file of an architecture we do not load is refused before anything starts,
    with the reason. Only a local file is read here: the default model (which may need a
    download), a missing one and a folder's config are the worker's to resolve and
    report."""
    from spillway.shared.gguf_arch import gguf_architecture
    from spillway.shared.model_config import gguf_fields
    from spillway.shared.model_files import DEFAULT_MODEL, resolve_model

    if settings.model == DEFAULT_MODEL:
        return
    try:
        source = resolve_model(settings.model)
        fields = gguf_fields(source.path) if source.kind == "gguf" else None
    except Exception:  # an unreadable model: the worker reports it as before
        return
    if fields is not None:
        try:
            gguf_architecture(fields)
        except ValueError as e:
            raise StartupError(f"{source.path}: {e}") from e


def check_expert_parallel_model(settings: Settings) -> None:
    """--expert-parallel N > 1 on a model it cannot split (a dense one, or N not dividing
    its experts) is refused before anything starts."""
    if settings.expert_parallel == 1:
        return
    # The experts are a family option: the worker's family modules read them.
    from spillway.services.worker.service import load_model_config
    from spillway.shared.expert_parallel import check_expert_parallel
    from spillway.shared.model_files import resolve_model

    source = resolve_model(settings.model)
    placeholder = settings.with_overrides(rank=0, dist_url="tcp://127.0.0.1:1")
    try:
        check_expert_parallel(placeholder, load_model_config(source), source.model_id)
    except ValueError as e:
        raise StartupError(str(e)) from e


def visible_gpus() -> list[str]:
    """The GPU ids this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi's list)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


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
    """Gateway first (it stops accepting and lets running requests finish), then the rest
    (a scheduler drains whatever it still runs)."""
    gateways = [c for c in children if c.service == "gateway"]
    others = [c for c in children if c.service != "gateway"]
    for group in (gateways, others):
        for c in group:
            c.terminate()
        deadline = time.monotonic() + drain_timeout_s + 5.0
        for c in group:
            if not c.wait(max(0.0, deadline - time.monotonic())):
                c.kill()


def check_trace_file(path: str | None) -> None:
    """Fails at once, with the reason, when the trace file cannot be appended to (rather
    than every child failing on it in turn)."""
    if not path:
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    except OSError as e:
        raise StartupError(f"--trace-file {path}: {e.strerror or e}") from e


def _emit(line: str) -> None:
    print(line, flush=True)


def _say(line: str) -> None:
    print(f"spillway: {line}", file=sys.stderr, flush=True)


def up(settings: Settings) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    servers: list[ServerProcess] = []
    children: list[Child] = []
    code = 0
    try:
        check_trace_file(settings.trace_file)
        check_servable_model(settings)
        check_expert_parallel_model(settings)
        settings, servers = ensure_servers(settings)
        args = as_arguments(settings)
        for s in START_ORDER:
            env = service_environment(s, servers)
            if s == "worker":
                cpus = len(os.sched_getaffinity(0))
                children += [
                    Child(s, [*args, *extra], {**env, **own}, _emit)
                    for extra, own in worker_launches(settings, cpus, visible_gpus())
                ]
            else:
                children.append(Child(s, args, env, _emit))
        wait_ready(children, stop, STARTUP_TIMEOUT_S)
        if not stop.is_set():
            gateway = next(c for c in children if c.service == "gateway")
            url = gateway.ready_detail.split()[0]
            wait_healthy(url, children, stop, STARTUP_TIMEOUT_S)
            if not stop.is_set():
                print(f"ready: {url}", flush=True)
        policy = RestartPolicy(
            settings.restart_limit, settings.restart_window_s, settings.restart_backoff_s
        )
        supervise(children, stop, policy)
        _say(f"stopping: running requests get up to {settings.drain_timeout_s:g}s to finish")
    except StartupError as e:
        _say(str(e))
        code = 1
    finally:
        stop_children(children, settings.drain_timeout_s)
        for s in servers:
            s.stop()
    return code


def supervise(children: list[Child], stop: threading.Event, policy: RestartPolicy) -> None:
    """Runs until Ctrl-C / SIGTERM, restarting every child that exits (`children` always
    holds the current processes). Raises StartupError on a crash loop."""
    clock = MonotonicClock()
    trackers = {c.service: RestartTracker(policy, clock) for c in children}
    restart_at: dict[int, float] = {}  # index in children -> when to start it again
    while not stop.wait(WATCH_INTERVAL_S):
        now = clock.now()
        for i, child in enumerate(children):
            if i in restart_at or child.alive:
                continue
            tracker = trackers[child.service]
            delay = tracker.on_exit()
            if delay is None:
                raise StartupError(
                    f"{child.service} keeps exiting ({tracker.recent_exits} exits within "
                    f"{policy.window_s:g}s, the last with code {child.proc.returncode}): "
                    "giving up"
                )
            _say(
                f"{child.service} exited with code {child.proc.returncode}; restarting it "
                f"in {delay:g}s (exit {tracker.recent_exits} of at most {policy.limit} "
                f"within {policy.window_s:g}s)"
            )
            restart_at[i] = now + delay
        for i, due in list(restart_at.items()):
            if now >= due:
                del restart_at[i]
                children[i] = children[i].respawn()
                _say(f"{children[i].service} restarted (pid {children[i].proc.pid})")

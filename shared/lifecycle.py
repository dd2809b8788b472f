"""How every service process starts, announces readiness and stops.

A service is `async def serve(settings, stop: asyncio.Event)`: it connects, announces
itself ready, and returns once `stop` is set (SIGINT or SIGTERM) and it has wound down.
`spillway up` reads the readiness line from each child's stdout; with a health file
(shared/health.py) the same readiness starts the beats a container healthcheck reads.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from spillway.shared.health import READINESS, keep_health_file
from spillway.shared.malloc_heap import trim_every
from spillway.shared.memory_report import report_memory

READY_MARK = "ready"
# How often every service gives malloc's free pages back (shared/malloc_heap.py).
HEAP_TRIM_S = 60.0


def announce_ready(service: str, detail: str = "") -> None:
    """One line on stdout: `spillway-<service> ready <detail>` (parsed by `spillway up`)."""
    print(f"spillway-{service} {READY_MARK} {detail}".rstrip(), flush=True)
    READINESS.set_ready()


def setup_logging(service: str, level: str = "INFO", log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        from spillway.shared.json_logs import JsonLogFormatter

        handler.setFormatter(JsonLogFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # The NATS client logs every reconnect attempt at ERROR; the bus helper reports those.
    logging.getLogger("nats").setLevel(logging.CRITICAL)


def run_service(
    service: str,
    main: Callable[[asyncio.Event], Awaitable[None]],
    log_level: str = "INFO",
    health_file: Path | None = None,
    log_format: str = "text",
    memory_report_s: float | None = None,
) -> int:
    """Runs `main(stop)` on a fresh event loop until it returns; exit code 0 on a clean stop.
    With `health_file`, beats are written there from readiness on (shared/health.py); with
    `memory_report_s`, the process's memory is logged that often (shared/memory_report.py)."""
    setup_logging(service, log_level, log_format)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        READINESS.reset()
        side = []
        if health_file is not None:
            side.append(
                asyncio.create_task(
                    keep_health_file(health_file, service, READINESS), name="health-file"
                )
            )
        if memory_report_s:
            side.append(asyncio.create_task(report_memory(memory_report_s), name="memory"))
        side.append(asyncio.create_task(trim_every(HEAP_TRIM_S), name="heap-trim"))
        try:
            await main(stop)
        finally:
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)

    try:
        asyncio.run(runner())
    except Exception:
        logging.getLogger(service).exception("%s failed", service)
        return 1
    return 0

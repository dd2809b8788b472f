"""`spillway top`: a live terminal view of every scheduler, from their tick reports
(sched.*.tick, which the `client` NATS user may read). The figures come from
top_figures.TopFigures; this module only subscribes and renders them with rich."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from pydantic import ValidationError
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from spillway.services.cli.top_figures import DEFAULT_WINDOW_S, LaneFigures, TopFigures
from spillway.shared import subjects
from spillway.shared.bus import Bus
from spillway.shared.clock import MonotonicClock
from spillway.shared.protocol import TICK_PHASES, TickReport, decode

REFRESH_S = 0.5
# Lanes silent this long leave the view (a scheduler that is gone).
FORGET_AFTER_S = 120.0
PHASE_HEADERS = {
    "deadline_sweep": "sweep",
    "drain": "drain",
    "store_finished": "store",
    "retire": "retire",
    "swap_in": "swap-in",
    "resume": "resume",
    "admit": "admit",
    "step": "step",
}


def render(figures: list[LaneFigures], subject: str, num_reports: int, bad: int) -> Group:
    """The whole screen: a header, the lanes' figures, their phase times."""
    header = Text.assemble(
        ("spillway top", "bold"),
        f"  {subject}  lanes {len(figures)}  reports {num_reports}",
        (f"  ignored {bad} malformed" if bad else "", "red"),
    )
    if not figures:
        return Group(header, Text("waiting for tick reports..."))
    load = Table(title="load (rates over the last window)", title_justify="left", expand=True)
    for name in ("scheduler", "worker", "tick"):
        load.add_column(name, no_wrap=True)
    for name in ("running", "waiting", "swapped", "KV use", "spills/s", "swap-ins/s",
                 "tok/s", "computed tok/s", "ticks/s"):  # fmt: skip
        load.add_column(name, justify="right", no_wrap=True)
    phases = Table(title="phase time per tick (ms, mean)", title_justify="left", expand=True)
    phases.add_column("scheduler", no_wrap=True)
    phases.add_column("worker", no_wrap=True)
    for name in TICK_PHASES:
        phases.add_column(PHASE_HEADERS[name], justify="right", no_wrap=True)
    for f in figures:
        style = "dim" if f.stale else None
        load.add_row(
            f.scheduler,
            f.worker,
            f"{f.tick}" + (f" (silent {f.age_s:.0f}s)" if f.stale else ""),
            str(f.running),
            str(f.waiting),
            str(f.swapped),
            f"{100 * f.kv_cache_usage:.1f}%",
            f"{f.spills_per_s:.1f}",
            f"{f.swap_ins_per_s:.1f}",
            f"{f.tokens_per_s:.1f}",
            f"{f.computed_tokens_per_s:.1f}",
            f"{f.ticks_per_s:.1f}",
            style=style,
        )
        phases.add_row(
            f.scheduler,
            f.worker,
            *(f"{1000 * f.phase_s.get(name, 0.0):.3f}" for name in TICK_PHASES),
            style=style,
        )
    return Group(header, load, phases)


async def watch(
    nats_url: str,
    namespace: str,
    window_s: float = DEFAULT_WINDOW_S,
    console: Console | None = None,
) -> int:
    bus = await Bus.connect(nats_url, namespace, "spillway-top")
    figures = TopFigures(MonotonicClock(), window_s)
    bad = 0

    async def on_report(msg) -> None:
        nonlocal bad
        try:
            figures.add(decode(TickReport, msg.data))
        except ValidationError:
            bad += 1  # another version's report, or junk: the view goes on

    subject = bus.subject(subjects.sched_tick("*"))
    await bus.nc.subscribe(subject, cb=on_report)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        with Live(
            render([], subject, 0, 0), console=console, screen=True, auto_refresh=False
        ) as live:
            while not stop.is_set():
                figures.forget_stale(FORGET_AFTER_S)
                live.update(render(figures.figures(), subject, figures.num_reports, bad))
                live.refresh()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), REFRESH_S)
    finally:
        await bus.close()
    return 0


def top_main(nats_url: str, namespace: str, window_s: float) -> int:
    if window_s <= 0:
        print(f"spillway top: --window must be positive, got {window_s}", file=sys.stderr)
        return 2
    if namespace and not subjects.is_token(namespace):
        print(
            f"spillway top: --namespace {namespace!r}: letters, digits, '-' and '_' only",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(watch(nats_url, namespace, window_s))
    except ConnectionError as e:  # the bus's own message names the URL (password hidden)
        print(f"spillway top: {e}", file=sys.stderr)
        return 1

"""Tick reports on a guarded NATS server (one user per service, as `spillway up` sets it
up): a client logged in as `client` reads every scheduler tick on sched.<id>.tick, phases
in the seeds' order, with the retirements, spills and swap-ins the run made; it cannot
forge one; and `spillway top` shows them live in a real terminal (tmux)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest

from spillway.services.cli.servers import ServerProcess, start_nats
from spillway.services.scheduler.service import serve
from spillway.shared import subjects
from spillway.shared.bus import Bus
from spillway.shared.config import load_settings
from spillway.shared.protocol import TICK_PHASES, SpillStats, StatsRequest, TickReport, decode
from tests.integration.scheduler.scripted_worker import ScriptedWorker
from tests.integration.scheduler.test_sched_service import Gateway, _until_stats

ROOT = Path(__file__).resolve().parents[3]
SCHEDULER_ID = "sched-tick"
BLOCK_BYTES = 4096
WAIT_S = 10.0
REPORT_FIELDS = {
    "scheduler", "worker", "tick", "time", "phases", "running", "waiting", "swapped",
    "kv_cache_usage",
}  # fmt: skip


@dataclass
class Guarded:
    server: ServerProcess
    namespace: str
    gateway: Gateway
    worker: ScriptedWorker
    raw: list[bytes] = field(default_factory=list)  # what the client read
    violations: list[str] = field(default_factory=list)
    client: nats.NATS | None = None

    def reports(self) -> list[TickReport]:
        return [decode(TickReport, body) for body in self.raw]


@pytest.fixture
async def guarded() -> AsyncIterator[Guarded]:
    namespace = f"t{uuid.uuid4().hex[:8]}"
    server = start_nats(users_namespace=namespace)
    pw = server.passwords
    settings = load_settings(
        nats_url=server.url,
        namespace=namespace,
        nats_user="scheduler",
        nats_password=pw["scheduler"],
        service_id=SCHEDULER_ID,
        worker_timeout_s=2.0,
        step_timeout_s=3.0,
        max_batch=4,
        max_num_batched_tokens=64,
        preemption_mode="spill",
        spill_store=True,
        prefix_tier_blocks=0,
        debug_invariants=True,
    )
    # The spill store, as far as the scheduler can tell: healthy, with room.
    store = await Bus.connect(
        server.url, namespace, "test-spillstore", service="spillstore",
        user="spillstore", password=pw["spillstore"],
    )  # fmt: skip

    async def stats(_req, _ctx, _raw) -> SpillStats:
        return SpillStats(redis_ok=True, capacity_bytes=1 << 30)

    await store.serve(subjects.SPILL_STATS, StatsRequest, stats)
    stop = asyncio.Event()
    scheduler = asyncio.create_task(serve(settings, stop))
    gateway_bus = await Bus.connect(
        server.url, namespace, "test-gateway", service="gateway",
        user="gateway", password=pw["gateway"],
    )  # fmt: skip
    gateway = Gateway(gateway_bus)
    await gateway.start()
    await _until_stats(gateway, lambda s: True)
    # 8 blocks of 4 tokens: three 25-token sequences cannot all hold their blocks.
    worker = ScriptedWorker(
        server.url, namespace, num_kv_blocks=8, confirm_spills=True, password=pw["worker"]
    )
    worker.info = worker.info.model_copy(update={"block_bytes": BLOCK_BYTES})
    await worker.start()
    await _until_stats(gateway, lambda s: s.num_workers == 1)
    g = Guarded(server, namespace, gateway, worker)
    try:
        yield g
    finally:
        if g.client is not None:
            await g.client.close()
        await worker.stop()
        stop.set()
        await asyncio.wait_for(scheduler, WAIT_S)
        await gateway_bus.close()
        await store.close()
        server.stop()


async def _listen_as_client(g: Guarded) -> None:
    async def on_error(e: Exception) -> None:
        g.violations.append(str(e))

    async def on_report(msg) -> None:
        g.raw.append(msg.data)

    g.client = await nats.connect(
        g.server.url, user="client", password=g.server.passwords["client"], error_cb=on_error
    )
    await g.client.subscribe(f"{g.namespace}.sched.*.tick", cb=on_report)
    await g.client.flush()


async def _until(predicate, timeout: float = WAIT_S) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


def _phase(report: TickReport, name: str):
    return next(p for p in report.phases if p.name == name)


async def test_the_client_user_reads_every_tick_with_what_each_phase_did(guarded):
    g = guarded
    await _listen_as_client(g)
    ids = ["a", "b", "c"]
    g.worker.gate.clear()  # every request queued before the first step
    replies = await asyncio.gather(*(g.gateway.submit(r, max_tokens=20) for r in ids))
    assert all(reply.ok for reply in replies)
    g.worker.gate.set()
    await g.gateway.wait_finished(*ids)

    def retired() -> dict[str, str]:
        return {
            x.request_id: x.finish_reason for r in g.reports() for x in _phase(r, "retire").retired
        }

    await _until(lambda: set(retired()) == set(ids))
    assert not g.violations, g.violations
    assert retired() == dict.fromkeys(ids, "length")
    reports = g.reports()
    for body, report in zip(g.raw, reports, strict=True):
        assert set(json.loads(body)) == REPORT_FIELDS
        assert [p.name for p in report.phases] == list(TICK_PHASES)
        assert (report.scheduler, report.worker) == (SCHEDULER_ID, "w1")
    assert [r.tick for r in reports] == sorted(r.tick for r in reports)
    # Ids and figures only: no prompt or output token ever rides in a report.
    assert all(b'"token_ids"' not in body and b'"prompt' not in body for body in g.raw)
    stats = await g.gateway.stats()
    preempted = [p for r in reports for ph in r.phases for p in ph.preempted]
    assert stats.preemptions["spill"] > 0
    assert len(preempted) == stats.preemptions["spill"] + stats.preemptions["recompute"]
    assert all(p.bytes > 0 and p.bytes % BLOCK_BYTES == 0 for p in preempted if p.mode == "spill")
    swapped_in = [s for r in reports for s in _phase(r, "swap_in").swapped_in]
    restores = [x.seq_id for p in g.worker.plans for x in p.restores]
    assert swapped_in and sorted(s.request_id for s in swapped_in) == sorted(restores)
    admitted = [a.request_id for r in reports for a in _phase(r, "admit").admitted]
    assert sorted(admitted) == ids
    assert sum(_phase(r, "step").sampled for r in reports) == 3 * 20
    assert max(r.running for r in reports) >= 2 and max(r.swapped for r in reports) >= 1


async def test_the_client_user_cannot_forge_a_tick_report(guarded):
    g = guarded
    await _listen_as_client(g)
    assert g.client is not None
    forged = TickReport(scheduler="forged", worker="w9", tick=1, time=0.0, phases=[])
    await g.client.publish(f"{g.namespace}.sched.forged.tick", forged.model_dump_json().encode())
    await g.client.flush()
    await _until(lambda: len(g.violations) >= 1)
    assert "permissions violation" in g.violations[0]
    assert (await g.gateway.submit("after", max_tokens=2)).ok
    await g.gateway.wait_finished("after")
    await _until(lambda: any(_phase(r, "retire").retired for r in g.reports()))
    assert all(r.scheduler == SCHEDULER_ID for r in g.reports())


def _tmux(socket: str, *args: str) -> str:
    done = subprocess.run(
        ["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=10, check=False
    )
    return done.stdout


def _load_row(screen: str) -> list[str] | None:
    """The cells of the scheduler's row in the load table (the one with a KV %)."""
    for line in screen.splitlines():
        if SCHEDULER_ID in line and "%" in line:
            return [c.strip() for c in line.replace("│", "|").split("|") if c.strip()]
    return None


async def test_spillway_top_shows_the_scheduler_live_in_a_terminal(guarded, tmp_path):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: infra/setup.sh (make install) installs it")
    g = guarded
    g.worker.step_delay_s = 0.005  # a steady load: ticks of a few ms
    running = True

    async def load() -> None:
        n = 0
        while running:
            batch = [f"load{n + i}" for i in range(3)]
            n += 3
            await asyncio.gather(*(g.gateway.submit(r, max_tokens=20) for r in batch))
            await g.gateway.wait_finished(*batch)

    loader = asyncio.create_task(load())
    socket = f"spillway-test-{uuid.uuid4().hex[:8]}"
    errors = tmp_path / "top.err"
    command = (
        f"cd {ROOT} && {sys.executable} -P -m spillway.services.cli.main top "
        f"--nats-url {g.server.url} --namespace {g.namespace} --window 2 2>{errors}; sleep 60"
    )
    # The pane's own size, not one a parent process left in COLUMNS / LINES (rich reads those).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TMUX") and k not in ("COLUMNS", "LINES")
    }
    subprocess.run(
        ["tmux", "-L", socket, "new-session", "-d", "-x", "160", "-y", "40", command],
        check=True, timeout=10, env=env,
    )  # fmt: skip
    screen = ""
    try:
        row: list[str] | None = None

        def live() -> bool:
            nonlocal screen, row
            screen = _tmux(socket, "capture-pane", "-p")
            row = _load_row(screen)
            # scheduler, worker, tick, running, waiting, swapped, KV, spills/s, swap-ins/s,
            # tok/s, computed tok/s, ticks/s. The whole screen, too: a capture may land
            # while `top` is redrawing it, with the load table drawn and the next not yet.
            return (
                row is not None
                and len(row) == 12
                and float(row[9]) > 0
                and "phase time per tick" in screen
            )

        ok = False
        with contextlib.suppress(TimeoutError):
            await _until(live, 30.0)
            ok = True
        # The screen that passed is the one checked below (not a fresh capture).
        assert ok and row is not None, (
            f"screen:\n{screen}\nstderr:\n{errors.read_text() if errors.exists() else ''}"
        )
        assert row[0] == SCHEDULER_ID and row[1] == "w1"
        assert int(row[2]) > 0 and float(row[11]) > 0  # ticks, and ticks per second
        assert "spillway top" in screen and "phase time per tick" in screen
        assert "step" in screen and "swap-in" in screen
    finally:
        running = False
        _tmux(socket, "kill-server")
        loader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await loader

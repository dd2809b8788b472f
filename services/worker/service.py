"""The worker service: the NATS shell around ModelRunner (the only worker file on the bus).

    sched.<id>.register  request/reply to the scheduler it picks from the leases (one that
      or worker.register drives no worker first; the queue group when it knows none),
                         retried until answered
    worker.heartbeat     published every heartbeat_interval_s, naming its scheduler
    worker.<id>.step     request/reply: StepPlan -> StepResult
    sched.heartbeat      the schedulers' leases: when its scheduler's lapses (or drops it)
                         the worker registers elsewhere (ownership.py)
    worker.discover      a new scheduler asks: only a worker without a live scheduler
                         registers again, so a stream of these disturbs nothing

SIGTERM drains: the next heartbeat says `draining`, its scheduler takes no new requests
and aborts what still runs after drain_timeout_s, and the worker steps on until it holds
no sequence (or its scheduler is gone, or that time and a grace second passed).

A worker belongs to the scheduler that took its registration and refuses every plan sent
by anyone else (the `Spillway-Sender` header); a plan that changes nothing, the
scheduler's probe at registration, is answered for anyone.

Steps run one at a time on a single executor thread, so the event loop stays free for
heartbeats while the model computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

from nats.aio.msg import Msg
from opentelemetry.context import Context
from opentelemetry.trace import Span, set_span_in_context

from spillway.services.worker.arrival_order import ArrivalOrder
from spillway.services.worker.ep_group import KEEPALIVE, close_group, follow, leave
from spillway.services.worker.expert_parallel import ExpertGroup
from spillway.services.worker.info import worker_info
from spillway.services.worker.loading import load_runner
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.ownership import Ownership
from spillway.services.worker.runner import KVIo, ModelRunner
from spillway.services.worker.step_spans import StepSpans
from spillway.services.worker.threads import flush_denormals
from spillway.shared import subjects
from spillway.shared.beacon import Beacon
from spillway.shared.bus import Bus, BusError, sender_of
from spillway.shared.clock import MonotonicClock
from spillway.shared.config import Settings
from spillway.shared.leases import LeaseBook, StallGuard
from spillway.shared.lifecycle import announce_ready
from spillway.shared.log_safety import error_text
from spillway.shared.protocol import (
    ErrorInfo,
    Heartbeat,
    RegisterReply,
    SchedulerLease,
    SpillRecord,
    StepPlan,
    StepResult,
    WorkerInfo,
)
from spillway.shared.telemetry import Telemetry
from spillway.shared.waiting import raise_if_cancelled, wait_event

log = logging.getLogger(__name__)

# What the CLI may reach: `serve`, and the model's config with its family's options for
# `spillway up`'s checks before anything starts.
__all__ = ["load_model_config", "serve"]

# The scheduler probes our step subject before it answers.
REGISTER_TIMEOUT_S = 5.0
REGISTER_RETRY_S = 0.5
FIRST_LEASE_WAIT_S = 1.0
# Draining ends once no plan came for this long with no sequence held (a plan in flight
# when the last sequence went may still bring one), or this long after drain_timeout_s.
DRAIN_QUIET_S = 0.3
DRAIN_GRACE_S = 1.0


async def serve(
    settings: Settings, stop: asyncio.Event, telemetry: Telemetry | None = None
) -> None:
    tel = telemetry or Telemetry("worker", settings.otlp_endpoint, settings.trace_file)
    worker_id = settings.service_id or uuid.uuid4().hex[:8]
    # One thread for loading and every step: steps never overlap, and torch's per-thread
    # state (inference mode, threads) stays in one place.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{worker_id}")
    try:
        loop = asyncio.get_running_loop()
        # First on the step thread, before any math thread exists: they inherit the mode.
        await loop.run_in_executor(executor, flush_denormals)
        runner, model_id = await loop.run_in_executor(executor, load_runner, settings)
        group = runner.experts if settings.expert_parallel > 1 else None
        if group is not None and group.rank != 0:
            await _follow(runner, group, executor)
            return
        if stop.is_set():  # asked to stop while the weights were loading
            await loop.run_in_executor(executor, leave, group)
            return
        info = worker_info(worker_id, model_id, runner)
        bus = await Bus.for_service(
            settings, "worker", f"spillway-worker-{worker_id}", sender=worker_id
        )
        try:
            service = WorkerService(
                bus,
                tel,
                runner,
                info,
                executor,
                settings.heartbeat_interval_s,
                settings.scheduler_timeout_s,
                settings.drain_timeout_s,
            )
            await service.run(stop)
        finally:
            await loop.run_in_executor(executor, leave, group)
            await bus.close()
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        if telemetry is None:
            tel.shutdown()


async def _follow(runner: ModelRunner, group: ExpertGroup, executor: ThreadPoolExecutor) -> None:
    """A rank other than 0: no bus, no heartbeats; rank 0's plans until it stops. It
    outlives its own SIGTERM on purpose: rank 0, draining, still needs it for its steps."""
    announce_ready("worker", f"rank={group.rank} of {group.size} (expert parallel)")
    await asyncio.get_running_loop().run_in_executor(executor, follow, runner, group)
    close_group()


class WorkerService:
    def __init__(
        self,
        bus: Bus,
        tel: Telemetry,
        runner: ModelRunner,
        info: WorkerInfo,
        executor: ThreadPoolExecutor,
        heartbeat_interval_s: float,
        scheduler_timeout_s: float = 5.0,
        drain_timeout_s: float = 10.0,
    ) -> None:
        self.bus = bus
        self.tel = tel
        self.runner = runner
        self.info = info
        self.executor = executor
        self.heartbeat_interval_s = heartbeat_interval_s
        clock = MonotonicClock()
        self.leases = LeaseBook(clock, scheduler_timeout_s)
        self.ownership = Ownership(info.worker_id, clock, scheduler_timeout_s)
        self.heartbeat = Beacon(bus, subjects.WORKER_HEARTBEAT, self._beat, heartbeat_interval_s)
        self._registering: asyncio.Task[None] | None = None
        self._plan_order = ArrivalOrder()
        self._heard_lease = asyncio.Event()
        self.clock = clock
        self.drain_timeout_s = drain_timeout_s
        self._draining = False
        self._last_step_at = float("-inf")
        self.spans = StepSpans(tel.tracer, info.model_id)

    async def run(self, stop: asyncio.Event) -> None:
        # Overlapping handlers: a plan sent ahead (run-ahead) is queued on the step thread
        # while the step before it runs, and starts the moment that one ends, instead of
        # after its result is sent and the loop has taken the next message (two thread
        # wake-ups on every step's critical path).
        step_sub = await self.bus.serve(
            subjects.worker_step(self.info.worker_id), StepPlan, self._on_step, overlap=True
        )
        # worker.discover has an empty body: no model to validate against.
        discover_sub = await self.bus.subscribe(subjects.WORKER_DISCOVER, bytes, self._on_discover)
        lease_sub = await self.bus.subscribe(
            subjects.SCHED_HEARTBEAT, SchedulerLease, self._on_lease
        )
        await self.bus.settle()
        self._register("starting")
        self.heartbeat.start()
        watch = asyncio.create_task(self._watch_scheduler(), name="worker-watch")
        keepalive = asyncio.create_task(self._keep_group_alive(), name="worker-ep-keepalive")
        announce_ready(
            "worker",
            f"id={self.info.worker_id} blocks={self.info.num_kv_blocks} device={self.info.device}",
        )
        try:
            await stop.wait()
            await self._drain()
        finally:
            self.spans.flush()  # the runs still open end with the worker
            await self.heartbeat.stop()
            tasks = [t for t in (watch, keepalive, self._registering) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for sub in (step_sub, discover_sub, lease_sub):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _drain(self) -> None:
        """SIGTERM: says so in a heartbeat at once (its scheduler takes no new requests
        and ends, with "abort", those still running after drain_timeout_s) and keeps
        stepping until it holds no sequence and no plan came for a moment, or until the
        scheduler had its time (a grace second past drain_timeout_s)."""
        if self.ownership.owner is None:
            return
        self._draining = True
        self.heartbeat.kick()
        log.info("draining: %d sequence(s) held", len(self.runner.sequences))
        deadline = self.clock.now() + self.drain_timeout_s + DRAIN_GRACE_S
        while self.clock.now() < deadline:
            idle = self.clock.now() - self._last_step_at >= DRAIN_QUIET_S
            if (not self.runner.sequences and idle) or self._owner_gone():
                return
            await asyncio.sleep(0.05)
        log.warning("draining: stopping with %d sequence(s) held", len(self.runner.sequences))

    def _owner_gone(self) -> bool:
        """Our scheduler stopped (its lease lapsed) or dropped us: nobody will finish or
        forget the sequences we hold."""
        owner = self.ownership.owner
        lease = self.leases.get(owner) if owner else None
        return (
            lease is None
            or not self.leases.is_live(lease.scheduler_id)
            or self.info.worker_id not in lease.worker_ids
        )

    # --- registration and heartbeats -------------------------------------------------

    def _register(self, why: str) -> None:
        if self._registering is not None and not self._registering.done():
            return  # one registration at a time; it picks the scheduler afresh each try
        log.info("registering: %s", why)
        self._registering = asyncio.create_task(
            self._register_until_answered(), name="worker-register"
        )

    async def _register_until_answered(self) -> None:
        # A worker that just started waits a moment to hear the leases, so that it joins
        # a scheduler that has no worker rather than whichever answers first.
        await wait_event(self._heard_lease, FIRST_LEASE_WAIT_S)
        attempts = 0
        while True:
            target = self.leases.pick_for_worker()
            subject = (
                subjects.sched_register(target.scheduler_id)
                if target is not None
                else subjects.WORKER_REGISTER
            )
            try:
                reply = await self.bus.request(
                    subject, self.info, RegisterReply, REGISTER_TIMEOUT_S
                )
            except BusError as e:
                raise_if_cancelled()  # the request's wait_for may have swallowed it
                attempts += 1
                if attempts == 1 or attempts % 20 == 0:
                    log.info("registration not answered yet (%s); retrying", e.info.message)
                await asyncio.sleep(REGISTER_RETRY_S)
                continue
            owner = reply.scheduler_id or (target.scheduler_id if target else "")
            if self.ownership.join(owner):
                # Sequences of an earlier scheduler will never be finished by anyone; the
                # executor runs this before any step of the new one.
                forget = self.runner.forget_all
                await asyncio.get_running_loop().run_in_executor(self.executor, forget)
            log.info("worker %s belongs to scheduler %s", self.info.worker_id, owner or "?")
            self.heartbeat.kick()
            return

    async def _on_discover(self, _: bytes, ctx: Context, raw: Msg) -> None:
        why = self.ownership.why_register(self.leases)
        if why is not None:
            self._register(why)

    async def _on_lease(self, lease: SchedulerLease, ctx: Context, raw: Msg) -> None:
        self.leases.observe(lease)
        self._heard_lease.set()

    async def _watch_scheduler(self) -> None:
        guard = StallGuard(self.leases.clock, self.heartbeat_interval_s)
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            if guard.stalled():
                self.leases.renew_all()  # we were stalled: the leases' silence is ours
                continue
            if not self.bus.is_connected:
                continue  # nobody can reach us: the leases' silence is ours
            self.leases.lapse()
            why = self.ownership.why_register(self.leases)
            if why is not None and not self._draining:  # a draining worker joins no one
                self._register(why)

    async def _keep_group_alive(self) -> None:
        """An expert-parallel rank 0 shares something every heartbeat interval, through
        the step thread (so in order with the plans): the followers, waiting for the next
        plan, never reach the group's timeout while this rank lives."""
        group = self.runner.experts
        if group is None or group.size == 1:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            await loop.run_in_executor(self.executor, group.share, KEEPALIVE)

    def _beat(self) -> Heartbeat:
        if self.clock.now() - self._last_step_at >= self.heartbeat_interval_s:
            self.spans.flush()  # idle: what the last steps did goes out now
        return Heartbeat(
            info=self.info,
            num_steps=self.runner.num_steps,
            scheduler_id=self.ownership.owner or "",
            draining=self._draining,
        )

    # --- steps -------------------------------------------------------------------------

    async def _on_step(self, plan: StepPlan, ctx: Context, raw: Msg) -> StepResult:
        if _changes_nothing(plan):
            return StepResult(step_id=plan.step_id)
        sender = sender_of(raw)
        # Plans reach the step thread in the order they came, even when one of them waits
        # for the registration below and the next finds the new owner already recorded.
        async with self._plan_order.turn():
            registering = self._registering
            if not self.ownership.may_command(sender) and registering and not registering.done():
                # The scheduler that took our registration may send its first plan before
                # its reply has reached us.
                await asyncio.wait({registering}, timeout=REGISTER_TIMEOUT_S)
            if not self.ownership.may_command(sender):
                return self._refuse(plan, sender)
            self._last_step_at = self.clock.now()
            loop = asyncio.get_running_loop()
            running = loop.run_in_executor(self.executor, self._execute, plan)
        result, forward_ns, kv_io = await running
        if result.error is not None:
            log.warning("step %d: %s", plan.step_id, result.error.message)
        spill_spans: dict[str, Span] = {}
        if self.tel.exporting:
            spill_spans = self.spans.step(plan, ctx, result, forward_ns, kv_io)
        await self._record_spills(result, spill_spans)
        return result

    def _refuse(self, plan: StepPlan, sender: str) -> StepResult:
        log.warning(
            "refused step %d from %r: this worker belongs to scheduler %r",
            plan.step_id,
            sender,
            self.ownership.owner,
        )
        error = ErrorInfo(
            status=403,
            message=f"worker {self.info.worker_id} takes plans from its own scheduler "
            f"({self.ownership.owner!r}) only",
            type="permission_error",
            code="not_my_scheduler",
        )
        return StepResult(step_id=plan.step_id, error=error)

    def _execute(self, plan: StepPlan) -> tuple[StepResult, tuple[int, int], list[KVIo]]:
        """Runs the step on the step thread and takes its timings there: with overlapping
        handlers the next plan may run before this one's handler reads the runner."""
        result = self.runner.execute(plan)
        return result, self.runner.last_forward_ns, self.runner.last_kv_io

    async def _record_spills(self, result: StepResult, spans: dict[str, Span]) -> None:
        """Tells the spill store what this step wrote, for its accounting and expiry (in
        the trace of the request it spilled)."""
        owner = self.ownership.owner or ""
        lease = self.leases.get(owner) if owner else None
        for spill in result.spills:
            if not spill.ok:
                continue
            record = SpillRecord(
                seq_id=spill.seq_id,
                spill_id=spill.spill_id,
                worker_id=self.info.worker_id,
                num_bytes=spill.num_bytes,
                num_keys=spill.num_keys,
                scheduler_id=owner,
                boot_id=lease.boot_id if lease is not None else "",
            )
            try:
                span = spans.get(spill.seq_id)
                context = set_span_in_context(span) if span is not None else None
                await self.bus.publish(subjects.SPILL_RECORDED, record, context=context)
            except Exception as e:  # the data is written; only the accounting waits
                log.warning("spill record for %s not sent: %s", spill.seq_id, error_text(e))


def _changes_nothing(plan: StepPlan) -> bool:
    """A probe (a plan of nothing but its id): any order at all makes it a real step."""
    return not any(getattr(plan, name) for name in StepPlan.model_fields if name != "step_id")

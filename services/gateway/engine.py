"""The gateway's side of generation: submit sequences to the scheduler, route its delta
batches to the requests they belong to, abort what the client no longer wants.

One `RequestRun` per client request: its choices are separate scheduler sequences
(choice i has request id `ids[i]`) sharing one queue that the delta subscription fills.
The run turns deltas into `ChoiceStep`s through each choice's `ChoiceOutput`, aborts a
sequence at the scheduler when a stop string ends it, and ends every choice with
"timeout" itself at the request's deadline (with what it has; the scheduler is told to
abort the rest), whatever the scheduler's tick is doing.

Which scheduler: the least busy live one by the leases (scheduler_watch.py), else any
one of the `sched.submit` queue group; the reply names the one that took it, and only
that scheduler's deltas count for it (`Spillway-Sender`). When that scheduler is gone
(its lease lapsed), our own bus connection was down (its news may be lost), or a
draining scheduler hands a choice back (an error delta coded `handed_back`), the choice
moves to a live scheduler: replayed when it has produced nothing yet, else resumed from
its prompt plus the tokens the client already has (failover.py decides; the client sees
one unbroken stream). Only when no scheduler takes it within resume_timeout_s does it
end with an error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from spillway.services.gateway.choice_output import ChoiceOutput, ChoiceStep, output_options
from spillway.services.gateway.errors import ApiError
from spillway.services.gateway.failover import Decision, Failover, GiveUp, Place, Retry, in_order
from spillway.services.gateway.metrics import GatewayMetrics, TokenTimer
from spillway.services.gateway.responses import Usage, usage_of
from spillway.services.gateway.scheduler_watch import GoneReason, SchedulerWatch
from spillway.services.gateway.tokenizer import ModelTokenizer
from spillway.services.gateway.validation import PreparedRequest
from spillway.shared.beacon import Beacon
from spillway.shared.bus import Bus, BusError, sender_of
from spillway.shared.clock import Clock, MonotonicClock
from spillway.shared.protocol import (
    GATEWAY_BEAT_INTERVAL_S,
    HANDED_BACK_CODE,
    AbortRequest,
    DeltaBatch,
    ErrorInfo,
    GatewayBeat,
    RequestDelta,
    SchedulerStats,
    StatsRequest,
    SubmitReply,
    SubmitRequest,
)
from spillway.shared.regions import RegionMarkers
from spillway.shared.subjects import (
    GATEWAY_HEARTBEAT,
    SCHED_ABORT,
    SCHED_SUBMIT,
    gateway_deltas,
    sched_stats,
    sched_submit,
)
from spillway.shared.waiting import wait_event

log = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 10.0
# How long after a request's deadline the gateway ends it itself: at once (the
# scheduler's own "timeout" delta comes a tick late at best).
DEADLINE_GRACE_S = 0.0


@dataclass(frozen=True)
class _Cancel:
    reason: str


@dataclass(frozen=True)
class _Gone:
    """The scheduler of some choices is gone, or its news to us may be lost."""

    scheduler_id: str
    reason: GoneReason


class RequestRun:
    def __init__(
        self,
        engine: GatewayEngine,
        prepared: PreparedRequest,
        request_ids: list[str],
        arrival: float,
    ) -> None:
        self._engine = engine
        self.prepared = prepared
        self.request_ids = request_ids
        self.scheduler_ids = ["" for _ in request_ids]  # who runs each choice ("": unknown yet)
        self.context: Context | None = None
        self.queue: asyncio.Queue[tuple[RequestDelta, float] | _Cancel | _Gone] = asyncio.Queue()
        options = output_options(prepared, engine.markers)
        self.outputs = [ChoiceOutput(i, engine.tokenizer, options) for i in range(len(request_ids))]
        self._timers = [TokenTimer(arrival) for _ in request_ids]
        self.failovers = [Failover(engine.resume_timeout_s) for _ in request_ids]
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self.deadline_at = (
            arrival + prepared.deadline_ms / 1000 if prepared.deadline_ms is not None else None
        )
        self.aliases: list[str] = []

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def usage(self) -> Usage:
        return usage_of(self.prepared.prompts, self.outputs, self.prepared.n)

    @property
    def finish_reasons(self) -> list[str]:
        return [o.finish_reason or "error" for o in self.outputs]

    def cancel(self, reason: str = "abort") -> None:
        """Asks the consumer of steps() to end every choice now (and abort them)."""
        self.queue.put_nowait(_Cancel(reason))

    def runs_on(self, scheduler_id: str) -> bool:
        return scheduler_id in self.scheduler_ids

    def scheduler_of(self, request_id: str) -> str | None:
        i = self._index.get(request_id)
        return self.scheduler_ids[i] if i is not None else None

    async def steps(self) -> AsyncIterator[ChoiceStep]:
        """Every step with news, until each choice has finished."""
        while not self.finished:
            item = await self._next()
            if item is None or isinstance(item, _Cancel):
                reason = "timeout" if item is None else item.reason
                for output in self.outputs:
                    if not output.finished:
                        step = output.end(reason)
                        await self._on_finished(step, abort=True)
                        yield step
                continue
            if isinstance(item, _Gone):
                for step in await self._scheduler_gone(item):
                    yield step
                continue
            delta, received_at = item
            i = self._index.get(delta.request_id)
            if i is None or self.outputs[i].finished:
                continue
            handed_back = _handed_back(delta)
            if handed_back or not in_order(delta, self.outputs[i].num_tokens):
                now = self._engine.clock.now()
                failover = self.failovers[i]
                decision = (
                    failover.lost(self.scheduler_ids[i], now)
                    if handed_back
                    else failover.news_lost(now)
                )
                failed = await self._carry_out(i, decision)
                if failed is None:
                    continue
                step = failed
            else:
                step = self._apply(i, delta, received_at)
            if step.finished:
                await self._on_finished(step, abort=step.stop_matched or step.error is not None)
            if step.has_news:
                yield step

    def _apply(self, i: int, delta: RequestDelta, received_at: float) -> ChoiceStep:
        output = self.outputs[i]
        vocab_size = self._engine.vocab_size
        bad = [t for t in delta.token_ids if not 0 <= t < vocab_size]
        if bad:
            log.warning(
                "request %s: the scheduler sent token ids outside the vocabulary (%s)",
                delta.request_id,
                bad[:5],
            )
            return output.fail(BAD_TOKENS)
        before = output.num_tokens
        try:
            step = output.apply(delta)
        except Exception:  # news we cannot turn into text must not take the stream down
            log.exception("request %s: a delta could not be applied", delta.request_id)
            return output.fail(BAD_DELTA)
        self._engine.metrics.on_tokens(self._timers[i], output.num_tokens - before, received_at)
        self.failovers[i].tokens(output.num_tokens - before)
        return step

    async def _scheduler_gone(self, gone: _Gone) -> list[ChoiceStep]:
        """Each choice on that scheduler moves to a live one (failover.py decides how);
        those that cannot end with an error."""
        ended = []
        for i, output in enumerate(self.outputs):
            if output.finished or self.scheduler_ids[i] != gone.scheduler_id:
                continue
            now = self._engine.clock.now()
            failover = self.failovers[i]
            if gone.reason == "lost":
                decision = failover.lost(gone.scheduler_id, now)
            else:  # it lives (restarted, or our bus blinked): it may take the choice back
                decision = failover.bus_back(gone.scheduler_id, now)
            step = await self._carry_out(i, decision)
            if step is not None:
                ended.append(step)
        return ended

    async def _carry_out(self, i: int, decision: Decision) -> ChoiceStep | None:
        """Places choice i again until a scheduler takes it (None), or ends it: with
        "timeout" when its deadline passes meanwhile, else with the failover's error."""
        failover = self.failovers[i]
        clock = self._engine.clock
        while decision is not None:
            if self.deadline_at is not None and clock.now() >= self.deadline_at:
                failover.finished()
                step = self.outputs[i].end("timeout")
                await self._on_finished(step, abort=True)
                return step
            if isinstance(decision, GiveUp):
                step = self.outputs[i].fail(decision.error)
                await self._on_finished(step, abort=True)
                return step
            if isinstance(decision, Retry):
                wake = decision.at
                if self.deadline_at is not None:
                    wake = min(wake, self.deadline_at)
                await asyncio.sleep(max(wake - clock.now(), 0.0))
                decision = failover.tick(clock.now())
                continue
            assert isinstance(decision, Place)
            limit = self.prepared.max_tokens
            if limit is not None and decision.resume_from >= limit:
                # Its last token came; the finish that came with it did not: it is whole.
                failover.finished()
                step = self.outputs[i].end("length")
                await self._on_finished(step, abort=True)
                return step
            try:
                await self._engine.place(self, i, decision)
            except ApiError as e:
                info = ErrorInfo(status=e.status, message=e.message, code=e.code)
                decision = failover.refused(clock.now(), e.status == 503, info)
                continue
            failover.accepted(self.scheduler_ids[i])
            decision = None
        return None

    def move(self, index: int, request_id: str) -> str:
        """Choice `index` runs under a new request id from now on; returns the old one."""
        old = self.request_ids[index]
        self._index.pop(old, None)
        self.request_ids[index] = request_id
        self.scheduler_ids[index] = ""
        self._index[request_id] = index
        return old

    async def _next(self) -> tuple[RequestDelta, float] | _Cancel | _Gone | None:
        """The next queued item; None when the deadline backstop fired."""
        if self.deadline_at is None:
            return await self.queue.get()
        left = self.deadline_at + self._engine.deadline_grace_s - self._engine.clock.now()
        # Not asyncio.wait_for: in Python 3.11 it swallows a cancellation that comes as
        # a delta arrives, and the consumer (a stream whose client left) would run on.
        try:
            async with asyncio.timeout(max(left, 0.0)):
                return await self.queue.get()
        except TimeoutError:
            return None

    async def _on_finished(self, step: ChoiceStep, abort: bool) -> None:
        request_id = self.request_ids[step.index]
        self.failovers[step.index].finished()
        self._engine.release(request_id)
        reason = step.finish_reason or "error"
        self._engine.metrics.on_finished(self._timers[step.index], reason, self._engine.clock.now())
        if abort:
            await self._engine.abort([request_id], self.context)

    async def close(self) -> None:
        """Releases the run; sequences still generating (client gone) are aborted now."""
        unfinished = [o for o in self.outputs if not o.finished]
        for output in unfinished:
            await self._on_finished(output.end("abort"), abort=False)
        if unfinished:
            ids = [self.request_ids[o.index] for o in unfinished]
            await self._engine.abort(ids, self.context)
        self._engine.forget(self)


def _handed_back(delta: RequestDelta) -> bool:
    return (
        delta.error is not None and delta.error.code == HANDED_BACK_CODE and not (delta.token_ids)
    )


class GatewayEngine:
    def __init__(
        self,
        bus: Bus,
        gateway_id: str,
        tokenizer: ModelTokenizer,
        metrics: GatewayMetrics,
        clock: Clock | None = None,
        submit_timeout_s: float = SUBMIT_TIMEOUT_S,
        deadline_grace_s: float = DEADLINE_GRACE_S,
        scheduler_timeout_s: float = 5.0,
        resume_timeout_s: float = 30.0,
        vocab_size: int | None = None,
        markers: RegionMarkers | None = None,
    ) -> None:
        self.bus = bus
        self.gateway_id = gateway_id
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.clock = clock or MonotonicClock()
        self.submit_timeout_s = submit_timeout_s
        self.deadline_grace_s = deadline_grace_s
        self.resume_timeout_s = resume_timeout_s
        # Token ids a delta may carry: the model's (it may exceed the tokenizer's).
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.schedulers = SchedulerWatch(bus, self.clock, scheduler_timeout_s, self._gone)
        self.markers = markers or RegionMarkers()
        self.draining = False
        # Unique across gateways (the id) and across restarts of one (the boot tag).
        self._id_prefix = f"{gateway_id}-{uuid.uuid4().hex[:6]}"
        self._counter = itertools.count(1)
        self._routes: dict[str, RequestRun] = {}
        # Deltas that came before their submit's reply, with their senders: only the
        # scheduler that replies is owed them (until then anyone could have sent them).
        self._early: dict[str, list[tuple[str, RequestDelta, float]]] = {}
        self._runs: set[RequestRun] = set()
        self._by_alias: dict[str, set[RequestRun]] = {}
        self._sub: Subscription | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        # Schedulers abort the requests of a gateway whose beat stops (it died).
        self._beat = Beacon(
            bus,
            GATEWAY_HEARTBEAT,
            lambda: GatewayBeat(gateway_id=gateway_id, interval_s=GATEWAY_BEAT_INTERVAL_S),
            GATEWAY_BEAT_INTERVAL_S,
        )

    async def start(self) -> None:
        subject = gateway_deltas(self.gateway_id)
        self._sub = await self.bus.subscribe(subject, DeltaBatch, self._on_deltas)
        await self.schedulers.start()
        self._beat.start()
        await self.bus.settle()

    async def stop(self) -> None:
        await self._beat.stop()
        await self.schedulers.stop()
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    @property
    def num_active(self) -> int:
        return len(self._runs)

    async def _on_deltas(self, batch: DeltaBatch, ctx: Context, msg: Msg) -> None:
        received_at = self.clock.now()
        sender = sender_of(msg)
        for delta in batch.deltas:
            run = self._routes.get(delta.request_id)
            if run is None:
                continue
            expected = run.scheduler_of(delta.request_id)
            if expected == "":  # the submit's reply is not in yet: held until it is
                self._early.setdefault(delta.request_id, []).append((sender, delta, received_at))
                continue
            if expected and sender != expected:
                log.warning(
                    "dropped a delta for %s from %r: scheduler %r runs it",
                    delta.request_id,
                    sender,
                    expected,
                )
                continue
            run.queue.put_nowait((delta, received_at))

    def _gone(self, scheduler_id: str, reason: GoneReason) -> None:
        runs = [run for run in self._runs if run.runs_on(scheduler_id)]
        if runs:
            log.warning(
                "scheduler %s %s: %d requests affected",
                scheduler_id,
                {
                    "lost": "stopped answering",
                    "restarted": "restarted",
                    "interrupted": "may have lost news for us",
                }[reason],
                len(runs),
            )
        for run in runs:
            run.queue.put_nowait(_Gone(scheduler_id, reason))

    async def submit(
        self,
        prepared: PreparedRequest,
        arrival: float,
        context: Context | None = None,
        aliases: list[str] | None = None,
    ) -> RequestRun:
        """Submits every choice; raises ApiError (and leaves nothing behind) on refusal."""
        if self.draining:
            raise ApiError(503, "the gateway is shutting down", code="shutting_down")
        ids = [self._new_request_id() for _ in range(prepared.num_choices)]
        run = RequestRun(self, prepared, ids, arrival)
        run.context = context
        # Routes first: the first delta may arrive before the submit reply does.
        for rid in ids:
            self._routes[rid] = run
        self._track(run, aliases or [])
        # One scheduler for all choices: they share a prompt.
        target = self.schedulers.pick(prompt=prepared.choice_prompt(0))
        try:
            await asyncio.gather(*(self._submit_one(run, i, target) for i in range(len(ids))))
        except BaseException:
            await self.abort(ids, run.context)
            for rid in ids:
                self.release(rid)
            self.forget(run)
            raise
        self.metrics.prompt_tokens.inc(sum(len(prepared.choice_prompt(i)) for i in range(len(ids))))
        return run

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._counter)}"

    async def place(self, run: RequestRun, index: int, place: Place) -> None:
        """Submits choice `index` again under a new id (the old id is dropped, and its
        scheduler told to abort it, should it live), resuming after the first
        `place.resume_from` tokens the client has. Raises ApiError when refused."""
        new_id = self._new_request_id()
        self._routes[new_id] = run
        old_id = run.move(index, new_id)
        self.release(old_id)
        await self.abort([old_id], run.context)
        resumed = run.outputs[index].token_ids[: place.resume_from]
        prompt = [*run.prepared.choice_prompt(index), *resumed]
        await self._submit_one(run, index, self.schedulers.pick(place.exclude, prompt), resumed)
        log.info("request %s runs again as %s after %d tokens", old_id, new_id, len(resumed))

    async def _submit_one(
        self, run: RequestRun, index: int, target: str | None, resumed: list[int] | None = None
    ) -> None:
        """Submits one choice to `target` (a scheduler id; None: whichever of the queue
        group takes it), resuming after the `resumed` tokens when given, and records who
        took it; raises ApiError on refusal."""
        prepared = run.prepared
        deadline_ms = None
        if run.deadline_at is not None:
            deadline_ms = max((run.deadline_at - self.clock.now()) * 1000, 1.0)
        request = SubmitRequest(
            request_id=run.request_ids[index],
            gateway_id=self.gateway_id,
            prompt_token_ids=prepared.choice_prompt(index),
            sampling=prepared.choice_sampling(index),
            max_tokens=prepared.max_tokens,
            stop_token_ids=prepared.stop_token_ids,
            ignore_eos=prepared.ignore_eos,
            priority=prepared.priority,
            deadline_ms=deadline_ms,
            output_token_ids=resumed or [],
        )
        subjects = [sched_submit(target), SCHED_SUBMIT] if target else [SCHED_SUBMIT]
        for attempt, subject in enumerate(subjects, 1):
            try:
                reply = await self.bus.request(
                    subject, request, SubmitReply, self.submit_timeout_s, context=run.context
                )
            except BusError as e:
                if attempt < len(subjects) and e.info.status == 503:
                    continue  # the chosen one just went away: any scheduler will do
                raise _unavailable(e.info) from e
            if reply.ok:
                run.scheduler_ids[index] = reply.scheduler_id
                for sender, delta, received_at in self._early.pop(request.request_id, []):
                    if sender == reply.scheduler_id:
                        run.queue.put_nowait((delta, received_at))
                run.failovers[index].accepted(reply.scheduler_id)
                self.schedulers.note(reply.scheduler_id, request.prompt_token_ids)
                return
            error = reply.error or ErrorInfo(status=503, message="the scheduler refused it")
            if attempt < len(subjects) and error.status == 503:
                continue  # its worker or its lease changed meanwhile: ask the group
            raise ApiError.from_info(error)

    def _track(self, run: RequestRun, aliases: list[str]) -> None:
        self._runs.add(run)
        self._idle.clear()
        run.aliases = [a for a in aliases if a]
        for alias in run.aliases:
            self._by_alias.setdefault(alias, set()).add(run)

    def release(self, request_id: str) -> None:
        """No more deltas wanted for this sequence."""
        self._routes.pop(request_id, None)
        self._early.pop(request_id, None)

    def forget(self, run: RequestRun) -> None:
        for rid in run.request_ids:
            self.release(rid)
        self._runs.discard(run)
        for alias in run.aliases:
            runs = self._by_alias.get(alias)
            if runs is not None:
                runs.discard(run)
                if not runs:
                    del self._by_alias[alias]
        if not self._runs:
            self._idle.set()

    def cancel_alias(self, alias: str) -> int:
        """Cancels the runs known by a client-given id; returns how many."""
        runs = list(self._by_alias.get(alias, ()))
        for run in runs:
            run.cancel("abort")
        return len(runs)

    def cancel_all(self) -> None:
        for run in list(self._runs):
            run.cancel("abort")

    async def wait_idle(self, timeout: float) -> bool:
        return await wait_event(self._idle, timeout)

    async def abort(self, request_ids: list[str], context: Context | None = None) -> None:
        """Tells the schedulers to drop these requests (in their request's trace)."""
        if not request_ids:
            return
        try:
            message = AbortRequest(request_ids=request_ids)
            await self.bus.publish(SCHED_ABORT, message, context=context)
        except Exception:  # the bus is gone (shutdown): the scheduler's deadline frees them
            log.warning("could not publish an abort for %s", request_ids)

    async def scheduler_stats(self, timeout: float = 1.0) -> dict[str, SchedulerStats | None]:
        """Every live scheduler's stats, asked of each one at once (a scheduler that does
        not answer in time maps to None); the schedulers are those whose leases we hear."""
        ids = sorted({lease.scheduler_id for lease in self.schedulers.live()})

        async def ask(scheduler_id: str) -> SchedulerStats | None:
            try:
                return await self.bus.request(
                    sched_stats(scheduler_id), StatsRequest(), SchedulerStats, timeout
                )
            except BusError:
                return None

        answers = await asyncio.gather(*(ask(i) for i in ids))
        return dict(zip(ids, answers, strict=True))


BAD_TOKENS = ErrorInfo(
    status=502,
    message="the scheduler sent token ids outside the model's vocabulary",
    code="bad_upstream_message",
)
BAD_DELTA = ErrorInfo(
    status=502,
    message="the scheduler sent news that could not be read",
    code="bad_upstream_message",
)


def _unavailable(info: ErrorInfo) -> ApiError:
    if info.status == 503:
        return ApiError(503, "no scheduler is available to serve the request", code="unavailable")
    if info.status == 504:
        return ApiError(503, "the scheduler did not answer in time", code="unavailable")
    return ApiError.from_info(info)

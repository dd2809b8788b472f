"""The gateway's side of generation: submit sequences to the scheduler, route its delta
batches to the requests they belong to, abort what the client no longer wants.

One `RequestRun` per client request: its choices are separate scheduler sequences
(choice i has request id `ids[i]`) sharing one queue that the delta subscription fills.
The run turns deltas into `ChoiceStep`s through each choice's `ChoiceOutput`, aborts a
sequence at the scheduler when a stop string ends it, and ends every choice with
"timeout" itself if the scheduler's own deadline delta has not come shortly after the
deadline (a backstop: the client gets an answer within its budget whatever happens).
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
from pydantic import ValidationError

from services.gateway.choice_output import ChoiceOutput, ChoiceStep, output_options
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics, TokenTimer
from services.gateway.responses import Usage, usage_of
from services.gateway.tokenizer import ModelTokenizer
from services.gateway.validation import PreparedRequest
from shared.bus import Bus, BusError
from shared.clock import Clock, MonotonicClock
from shared.protocol import (
    AbortRequest,
    DeltaBatch,
    ErrorInfo,
    RequestDelta,
    SchedulerStats,
    StatsRequest,
    SubmitReply,
    SubmitRequest,
    decode,
)
from shared.regions import RegionMarkers
from shared.subjects import SCHED_ABORT, SCHED_STATS, SCHED_SUBMIT, gateway_deltas

log = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 10.0
# How long after a request's deadline the scheduler's "timeout" delta may take before the
# gateway ends the request itself.
DEADLINE_GRACE_S = 0.5


@dataclass(frozen=True)
class _Cancel:
    reason: str


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
        self.queue: asyncio.Queue[tuple[RequestDelta, float] | _Cancel] = asyncio.Queue()
        options = output_options(prepared, engine.markers)
        self.outputs = [ChoiceOutput(i, engine.tokenizer, options) for i in range(len(request_ids))]
        self._timers = [TokenTimer(arrival) for _ in request_ids]
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
        return usage_of(self.prepared.prompts, self.outputs)

    @property
    def finish_reasons(self) -> list[str]:
        return [o.finish_reason or "error" for o in self.outputs]

    def cancel(self, reason: str = "abort") -> None:
        """Asks the consumer of steps() to end every choice now (and abort them)."""
        self.queue.put_nowait(_Cancel(reason))

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
            delta, received_at = item
            i = self._index.get(delta.request_id)
            if i is None or self.outputs[i].finished:
                continue
            output = self.outputs[i]
            before = output.num_tokens
            step = output.apply(delta)
            self._engine.metrics.on_tokens(self._timers[i], output.num_tokens - before, received_at)
            if step.finished:
                await self._on_finished(step, abort=step.stop_matched)
            if step.has_news:
                yield step

    async def _next(self) -> tuple[RequestDelta, float] | _Cancel | None:
        """The next queued item; None when the deadline backstop fired."""
        if self.deadline_at is None:
            return await self.queue.get()
        left = self.deadline_at + self._engine.deadline_grace_s - self._engine.clock.now()
        try:
            return await asyncio.wait_for(self.queue.get(), max(left, 0.0))
        except TimeoutError:
            return None

    async def _on_finished(self, step: ChoiceStep, abort: bool) -> None:
        request_id = self.request_ids[step.index]
        self._engine.release(request_id)
        reason = step.finish_reason or "error"
        self._engine.metrics.on_finished(self._timers[step.index], reason, self._engine.clock.now())
        if abort:
            await self._engine.abort([request_id])

    async def close(self) -> None:
        """Releases the run; sequences still generating (client gone) are aborted now."""
        unfinished = [o for o in self.outputs if not o.finished]
        for output in unfinished:
            await self._on_finished(output.end("abort"), abort=False)
        if unfinished:
            await self._engine.abort([self.request_ids[o.index] for o in unfinished])
        self._engine.forget(self)


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
        markers: RegionMarkers | None = None,
    ) -> None:
        self.bus = bus
        self.gateway_id = gateway_id
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.clock = clock or MonotonicClock()
        self.submit_timeout_s = submit_timeout_s
        self.deadline_grace_s = deadline_grace_s
        self.markers = markers or RegionMarkers()
        self.draining = False
        # Unique across gateways (the id) and across restarts of one (the boot tag).
        self._id_prefix = f"{gateway_id}-{uuid.uuid4().hex[:6]}"
        self._counter = itertools.count(1)
        self._routes: dict[str, RequestRun] = {}
        self._runs: set[RequestRun] = set()
        self._by_alias: dict[str, set[RequestRun]] = {}
        self._sub: Subscription | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        subject = self.bus.subject(gateway_deltas(self.gateway_id))
        self._sub = await self.bus.nc.subscribe(subject, cb=self._on_deltas)
        await self.bus.settle()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    @property
    def num_active(self) -> int:
        return len(self._runs)

    async def _on_deltas(self, msg: Msg) -> None:
        received_at = self.clock.now()
        try:
            batch = decode(DeltaBatch, msg.data)
        except (ValidationError, ValueError):
            log.warning("dropped a malformed delta batch on %s", msg.subject)
            return
        for delta in batch.deltas:
            run = self._routes.get(delta.request_id)
            if run is not None:
                run.queue.put_nowait((delta, received_at))

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
        ids = [f"{self._id_prefix}-{next(self._counter)}" for _ in range(prepared.num_choices)]
        run = RequestRun(self, prepared, ids, arrival)
        # Routes first: the first delta may arrive before the submit reply does.
        for rid in ids:
            self._routes[rid] = run
        self._track(run, aliases or [])
        try:
            await asyncio.gather(*(self._submit_one(run, i, context) for i in range(len(ids))))
        except BaseException:
            await self.abort(ids)
            for rid in ids:
                self.release(rid)
            self.forget(run)
            raise
        self.metrics.prompt_tokens.inc(sum(len(prepared.choice_prompt(i)) for i in range(len(ids))))
        return run

    async def _submit_one(self, run: RequestRun, index: int, context: Context | None) -> None:
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
        )
        try:
            reply = await self.bus.request(
                SCHED_SUBMIT, request, SubmitReply, self.submit_timeout_s, context=context
            )
        except BusError as e:
            raise _unavailable(e.info) from e
        if not reply.ok:
            raise ApiError.from_info(
                reply.error or ErrorInfo(status=503, message="the scheduler refused the request")
            )

    def _track(self, run: RequestRun, aliases: list[str]) -> None:
        self._runs.add(run)
        self._idle.clear()
        run.aliases = [a for a in aliases if a]
        for alias in run.aliases:
            self._by_alias.setdefault(alias, set()).add(run)

    def release(self, request_id: str) -> None:
        """No more deltas wanted for this sequence."""
        self._routes.pop(request_id, None)

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
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            await self.bus.publish(SCHED_ABORT, AbortRequest(request_ids=request_ids))
        except Exception:  # the bus is gone (shutdown): the scheduler's deadline frees them
            log.warning("could not publish an abort for %s", request_ids)

    async def scheduler_stats(self, timeout: float = 1.0) -> SchedulerStats | None:
        try:
            return await self.bus.request(SCHED_STATS, StatsRequest(), SchedulerStats, timeout)
        except BusError:
            return None


def _unavailable(info: ErrorInfo) -> ApiError:
    if info.status == 503:
        return ApiError(503, "no scheduler is available to serve the request", code="unavailable")
    if info.status == 504:
        return ApiError(503, "the scheduler did not answer in time", code="unavailable")
    return ApiError.from_info(info)

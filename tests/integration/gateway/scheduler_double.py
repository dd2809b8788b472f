"""A scripted scheduler on the real bus, for the gateway's integration tests.

It answers `sched.submit` (and its own `sched.<id>.submit`), `sched.stats`, takes
`sched.abort` and publishes its lease like the real one (naming itself as the sender of
everything), and ticks every few milliseconds publishing ONE DeltaBatch per gateway per
tick, each request's next token id from a fixed reply text (encoded with the real
tokenizer). With `burst`, a request's whole output (at most the reply text) comes in
one delta instead. The prompt's text picks a behaviour:

    "STALL"     accepted, but never produces a token (disconnects, deadline backstop)
    "LONG"      the reply text repeated forever (until max_tokens, deadline or abort)

A resumed submission (output_token_ids) continues at the token index after them, so a
resumed stream's text equals an undisturbed one's. Each delta counts the tokens before it
(`first_token`); `lose_deltas` drops that many of the next token deltas on the floor (as a
bus outage loses news), while later ones go out.
    "FULL"      refused with 429 (queue full)
    "NOWORKER"  refused with 503 (no worker)
    otherwise   the reply text, then EOS (finish "stop"), or "length" at max_tokens
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from spillway.shared.beacon import Beacon
from spillway.shared.bus import Bus
from spillway.shared.protocol import (
    AbortRequest,
    DeltaBatch,
    ErrorInfo,
    RequestDelta,
    SampledLogprobs,
    SchedulerLease,
    SchedulerStats,
    StatsRequest,
    SubmitReply,
    SubmitRequest,
    TokenLogprob,
    decode,
)
from spillway.shared.subjects import (
    SCHED_ABORT,
    SCHED_HEARTBEAT,
    SCHED_STATS,
    SCHED_SUBMIT,
    gateway_deltas,
    sched_stats,
    sched_submit,
)

REPLY_TEXT = "Hello! The answer is 42: one, two, three, four. 世界 🎉 done"
EOS = 2
TICK_S = 0.004
LEASE_INTERVAL_S = 0.05


@dataclass
class Sequence:
    request: SubmitRequest
    output: list[int]
    behaviour: str
    submitted_at: float
    emitted: int = 0
    pending_finish: str | None = None
    first: bool = True


@dataclass
class SchedulerDouble:
    bus: Bus
    tokenizer: object
    num_workers: int = 1
    scheduler_id: str = "double"
    boot_id: str = "boot-1"
    burst: bool = False
    stalls: bool = True  # False: "STALL" prompts get the reply like any other
    # A long first step: a request gives no news at all (not even its own deadline's
    # end) until this long after it arrived.
    first_step_s: float = 0.0
    lose_deltas: int = 0
    submits: list[SubmitRequest] = field(default_factory=list)
    submit_trace_ids: list[int] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)  # ended "timeout" by this double
    active: dict[str, Sequence] = field(default_factory=dict)

    async def start(self) -> None:
        self.reply_ids = self.tokenizer.encode(REPLY_TEXT)
        self.bus.sender = self.scheduler_id
        self._subs = [
            await self.bus.serve(SCHED_SUBMIT, SubmitRequest, self._on_submit),
            await self.bus.serve(sched_submit(self.scheduler_id), SubmitRequest, self._on_submit),
            await self.bus.serve(SCHED_STATS, StatsRequest, self._on_stats),
            await self.bus.serve(sched_stats(self.scheduler_id), StatsRequest, self._on_stats),
        ]
        self._subs.append(
            await self.bus.nc.subscribe(self.bus.subject(SCHED_ABORT), cb=self._on_abort)
        )
        await self.bus.settle()
        self.lease = Beacon(self.bus, SCHED_HEARTBEAT, self._lease, LEASE_INTERVAL_S)
        self.lease.start()
        self._ticker = asyncio.ensure_future(self._tick_forever())

    async def fall_silent(self) -> None:
        """A dead scheduler: no lease, no answers, no ticks."""
        await self.lease.stop()
        self._ticker.cancel()
        for sub in self._subs:
            await sub.unsubscribe()

    def restart(self) -> None:
        """A new process under the same id: it knows none of the old one's requests."""
        self.boot_id = f"{self.boot_id}+"
        self.active.clear()

    async def close(self) -> None:
        await self.lease.stop()
        self._ticker.cancel()
        await asyncio.gather(self._ticker, return_exceptions=True)
        await self.bus.close()

    def _lease(self) -> SchedulerLease:
        return SchedulerLease(
            scheduler_id=self.scheduler_id,
            interval_s=LEASE_INTERVAL_S,
            boot_id=self.boot_id,
            worker_id="w-double" if self.num_workers else None,
            worker_ids=["w-double"] if self.num_workers else [],
            num_running=len(self.active),
        )

    async def wait_aborted(self, request_id: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while request_id not in self.aborted:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def submit_of(self, prompt_marker: str) -> list[SubmitRequest]:
        return [
            s for s in self.submits if prompt_marker in self.tokenizer.decode(s.prompt_token_ids)
        ]

    # --- handlers ----------------------------------------------------------------------

    async def _on_submit(self, req: SubmitRequest, ctx, raw) -> SubmitReply:
        self.submits.append(req)
        self.submit_trace_ids.append(trace.get_current_span(ctx).get_span_context().trace_id)
        prompt = self.tokenizer.decode(req.prompt_token_ids)
        if "FULL" in prompt:
            return SubmitReply(ok=False, error=ErrorInfo(status=429, message="waiting queue full"))
        if "NOWORKER" in prompt:
            return SubmitReply(ok=False, error=ErrorInfo(status=503, message="no worker"))
        markers = ("STALL", "LONG") if self.stalls else ("LONG",)
        behaviour = next((b for b in markers if b in prompt), "REPLY")
        # A resumed request continues its reply after the tokens it already produced.
        seq = Sequence(req, [], behaviour, time.monotonic(), emitted=len(req.output_token_ids))
        self.active[req.request_id] = seq
        return SubmitReply(ok=True, scheduler_id=self.scheduler_id)

    async def _on_stats(self, req: StatsRequest, ctx, raw) -> SchedulerStats:
        return SchedulerStats(
            num_workers=self.num_workers,
            num_running=len(self.active),
            num_waiting=0,
            kv_usage=0.5 if self.active else 0.0,
            preemptions={"spill": 1, "recompute": 2},
            prefix_cache_hit_tokens=3,
            prefix_cache_query_tokens=9,
        )

    async def _on_abort(self, msg) -> None:
        for rid in decode(AbortRequest, msg.data).request_ids:
            self.aborted.append(rid)
            seq = self.active.get(rid)
            if seq is not None:
                seq.pending_finish = "abort"

    # --- ticks -------------------------------------------------------------------------

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            by_gateway: dict[str, list[RequestDelta]] = {}
            for rid, seq in list(self.active.items()):
                delta = self._advance(seq)
                if delta is None:
                    continue
                if self.lose_deltas and delta.token_ids and delta.finish_reason is None:
                    self.lose_deltas -= 1
                    continue
                if delta.finish_reason is not None:
                    del self.active[rid]
                by_gateway.setdefault(seq.request.gateway_id, []).append(delta)
            for gateway_id, deltas in by_gateway.items():
                await self.bus.publish(gateway_deltas(gateway_id), DeltaBatch(deltas=deltas))

    def _advance(self, seq: Sequence) -> RequestDelta | None:
        req = seq.request
        if time.monotonic() - seq.submitted_at < self.first_step_s:
            return None
        finish = seq.pending_finish
        elapsed_ms = (time.monotonic() - seq.submitted_at) * 1000
        timed = req.deadline_ms is not None and elapsed_ms >= req.deadline_ms
        if finish is None and timed and seq.behaviour != "STALL":
            finish = "timeout"
            self.timed_out.append(req.request_id)
        if finish is not None:
            return self._delta(seq, [], finish)
        if seq.behaviour == "STALL":
            return None
        if self.burst:
            n = min(req.max_tokens or len(self.reply_ids), len(self.reply_ids))
            finish = "length" if req.max_tokens is not None and n == req.max_tokens else "stop"
            return self._delta(seq, self.reply_ids[:n], finish)
        if seq.behaviour == "LONG":
            token = self.reply_ids[seq.emitted % len(self.reply_ids)]
        elif seq.emitted < len(self.reply_ids):
            token = self.reply_ids[seq.emitted]
        else:
            token = EOS
        seq.emitted += 1
        if token == EOS and not req.ignore_eos:
            finish = "stop"
        elif req.max_tokens is not None and seq.emitted >= req.max_tokens:
            finish = "length"
        return self._delta(seq, [token], finish)

    def _delta(self, seq: Sequence, tokens: list[int], finish: str | None) -> RequestDelta:
        req = seq.request
        logprobs = None
        if req.sampling.logprobs is not None:
            k = req.sampling.logprobs
            logprobs = [
                SampledLogprobs(
                    token_id=t,
                    logprob=-0.25,
                    top=[
                        TokenLogprob(token_id=t, logprob=-0.25),
                        *[TokenLogprob(token_id=100 + j, logprob=-2.0 - j) for j in range(k)],
                    ][:k],
                )
                for t in tokens
            ]
        delta = RequestDelta(
            request_id=req.request_id,
            token_ids=tokens,
            first_token=seq.emitted if self.burst else seq.emitted - len(tokens),
            logprobs=logprobs,
            finish_reason=finish,
            num_prompt_tokens=len(req.prompt_token_ids) if seq.first else 0,
        )
        seq.first = False
        return delta

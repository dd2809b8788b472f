"""The NATS API (CONTRACT section 3), for request/reply clients.

- `llm.generate` (queue group `gateway`): a chat or completions body (`messages` or
  `prompt`) plus an optional `request_id`. Not streamed: one reply, the HTTP body.
  Streamed: one message per SSE chunk to the reply subject; the last one has header
  `Spillway-Done: 1` and carries the finish_reason and the usage.
- Errors: one reply with the OpenAI error body and header `Spillway-Error: <status>`.
- `llm.abort` (every gateway: only the one running it knows the id): `{"request_id"}`.
- `llm.models` (queue group `gateway`): the /v1/models body.

Each generate message runs as its own task (a subscription's callbacks run one at a
time), tracked so that a shutdown can let them finish. No message, however malformed,
ends a handler without an answer: bad input gets a 400 reply, a bug a 500 reply and a
log line, and the subscription goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spillway.services.gateway.api import GatewayApi, Generation
from spillway.services.gateway.errors import ApiError, invalid
from spillway.services.gateway.json_body import parse_json_body
from spillway.services.gateway.validation import kind_of
from spillway.shared.bus import ERROR_HEADER, Bus
from spillway.shared.clock import Clock, MonotonicClock
from spillway.shared.log_safety import safe_text
from spillway.shared.subjects import ABORT, GATEWAY_QUEUE, GENERATE, MODELS
from spillway.shared.telemetry import inject

log = logging.getLogger(__name__)

DONE_HEADER = "Spillway-Done"
MAX_ID_LEN = 256
ClientId = Field(min_length=1, max_length=MAX_ID_LEN)


class AbortBody(BaseModel):
    """llm.abort: one id, or a list of them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    request_id: str | None = ClientId
    request_ids: list[str] | None = Field(None, min_length=1, max_length=1024)

    def ids(self) -> list[str]:
        return [self.request_id] if self.request_id is not None else list(self.request_ids or [])


ABORT_USAGE = 'the body must be {"request_id": "..."} or {"request_ids": ["...", ...]}'


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


class NatsApi:
    def __init__(
        self, bus: Bus, api: GatewayApi, tracer: trace.Tracer, clock: Clock | None = None
    ) -> None:
        self.bus = bus
        self.api = api
        self.tracer = tracer
        self.clock = clock or MonotonicClock()
        self._serving: list[Subscription] = []
        self._abort_sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        # The bodies are the external API's (OpenAI shapes, errors in the OpenAI format):
        # they come in as bytes and are validated here, as on HTTP.
        subscribe = self.bus.subscribe
        self._serving = [
            await subscribe(GENERATE, bytes, self._on_generate, queue=GATEWAY_QUEUE),
            await subscribe(MODELS, bytes, self._on_models, queue=GATEWAY_QUEUE),
        ]
        self._abort_sub = await subscribe(ABORT, bytes, self._on_abort)

    async def stop_accepting(self) -> None:
        """New requests go to other gateways of the queue group from now on."""
        for sub in self._serving:
            await sub.unsubscribe()
        self._serving = []

    async def drain(self, timeout: float) -> None:
        """Waits for the running requests, up to `timeout`; then cancels the rest."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._abort_sub is not None:
            await self._abort_sub.unsubscribe()
            self._abort_sub = None

    # --- handlers ----------------------------------------------------------------------

    async def _on_generate(self, _: bytes, ctx: Context, msg: Msg) -> None:
        if not msg.reply:
            log.warning("dropped an llm.generate message without a reply subject")
            return
        task = asyncio.ensure_future(self._generate(msg, ctx))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _generate(self, msg: Msg, parent: Context) -> None:
        arrival = self.clock.now()
        with self.tracer.start_as_current_span(
            GENERATE,
            context=parent,
            kind=SpanKind.SERVER,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            span.set_attribute("messaging.destination.name", msg.subject)
            try:
                await self._serve_generate(msg, span, arrival)
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                await self._reply_error(msg, e, span)
            except Exception:  # a bug: the client still gets an answer
                log.exception("llm.generate failed")
                await self._reply_error(msg, ApiError(500, "internal server error"), span)

    async def _serve_generate(self, msg: Msg, span: trace.Span, arrival: float) -> None:
        body = await asyncio.to_thread(parse_json_body, msg.data)
        request_id = body.pop("request_id", None)
        if request_id is not None and not (
            isinstance(request_id, str) and len(request_id) <= MAX_ID_LEN
        ):
            raise invalid(f"request_id must be a string of at most {MAX_ID_LEN}", "request_id")
        if request_id:
            span.set_attribute("spillway.client_request_id", request_id)
        generation = await self.api.open(
            kind_of(body), body, span, arrival, aliases=[request_id or ""]
        )
        try:
            if generation.prepared.stream:
                await self._stream(msg, generation, span)
            else:
                reply = await generation.collect()
                await self.bus.nc.publish(msg.reply, _json(reply), headers=_trace(span))
        finally:
            await generation.close()

    async def _stream(self, msg: Msg, generation: Generation, span: trace.Span) -> None:
        # One chunk is held back so that the last can be marked done when the run ends.
        held: dict[str, Any] | None = None
        async for chunk in generation.chunks(usage_in_last=True):
            if held is not None:
                await self.bus.nc.publish(msg.reply, _json(held), headers=_trace(span))
            held = chunk
        if held is not None:
            headers = {**_trace(span), DONE_HEADER: "1"}
            await self.bus.nc.publish(msg.reply, _json(held), headers=headers)

    async def _on_abort(self, data: bytes, ctx: Context, msg: Msg) -> None:
        try:
            body = AbortBody.model_validate(parse_json_body(data))
            if (body.request_id is None) == (body.request_ids is None):
                raise invalid(ABORT_USAGE, "request_id")
        except ValidationError as e:
            await self._refuse(msg, invalid(f"{ABORT_USAGE}: {e.errors()[0]['msg']}"))
            return
        except ApiError as e:
            await self._refuse(msg, e)
            return
        aborted = sum(self.api.engine.cancel_alias(i) for i in body.ids())
        if msg.reply:
            await self.bus.nc.publish(msg.reply, _json({"aborted": aborted}), headers=inject())

    async def _refuse(self, msg: Msg, error: ApiError) -> None:
        if msg.reply:
            await self._publish_error(msg.reply, error, {})
        else:
            log.warning("dropped a bad message on %s: %s", msg.subject, safe_text(error.message))

    async def _on_models(self, _: bytes, ctx: Context, msg: Msg) -> None:
        if msg.reply:
            headers = inject(ctx)
            await self.bus.nc.publish(msg.reply, _json(self.api.models()), headers=headers)

    async def _reply_error(self, msg: Msg, error: ApiError, span: trace.Span) -> None:
        span.set_attribute("error.type", error.code or error.error_type)
        if error.status >= 500:
            span.set_status(Status(StatusCode.ERROR, error.message))
        await self._publish_error(msg.reply, error, _trace(span))

    async def _publish_error(self, reply: str, error: ApiError, headers: dict[str, str]) -> None:
        headers = {**headers, **error.headers(), ERROR_HEADER: str(error.status)}
        await self.bus.nc.publish(reply, _json(error.body()), headers=headers)


def _trace(span: trace.Span) -> dict[str, str]:
    return inject(trace.set_span_in_context(span))

"""NATS helpers: connect with reconnect, typed request/reply with timeouts, served
subjects that answer malformed input with an error reply, and W3C trace context carried
in message headers.

The service shells are the only callers; the pure cores never see the bus.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry.context import Context
from pydantic import BaseModel, ValidationError

from shared.protocol import ErrorInfo, ErrorReply, decode, encode
from shared.subjects import Namespace
from shared.telemetry import extract, inject

log = logging.getLogger(__name__)

ERROR_HEADER = "Spillway-Error"
R = TypeVar("R", bound=BaseModel)
Handler = Callable[[Any, Context, Msg], Awaitable[BaseModel | None]]


class BusError(Exception):
    """A request that got no usable answer (timeout, no responders, an error reply)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


async def connect_nats(url: str, name: str, connect_timeout_s: float = 10.0) -> NatsClient:
    """Connects, retrying until `connect_timeout_s`; once connected it reconnects forever."""
    deadline = asyncio.get_running_loop().time() + connect_timeout_s
    last: Exception | None = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            return await nats.connect(
                url,
                name=name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                ping_interval=5,
                max_outstanding_pings=3,
            )
        except Exception as e:  # any failure before the first connection is retried
            last = e
            await asyncio.sleep(0.2)
    raise ConnectionError(f"could not connect to NATS at {_redact(url)}: {last}")


def _redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


async def settle(nc: NatsClient) -> None:
    """Returns once the server has applied every subscription made on `nc` so far.

    nats-py writes a flush's PING straight to the socket while SUB commands wait in its
    pending buffer for the flusher task, so one PONG can come back before the server
    has seen the SUB (a request sent then gets "no responders"). By the time the first
    PONG arrives the flusher has written the buffer, so a second round trip orders after
    every SUB.
    """
    await nc.flush()
    await nc.flush()


def error_headers(status: int, context: Context | None = None) -> dict[str, str]:
    return {ERROR_HEADER: str(status), **inject(context)}


class Bus:
    """A NATS connection with the system's namespace applied to every subject."""

    def __init__(self, nc: NatsClient, namespace: str = "") -> None:
        self.nc = nc
        self.ns = Namespace(namespace)

    @classmethod
    async def connect(cls, url: str, namespace: str, name: str) -> Bus:
        return cls(await connect_nats(url, name), namespace)

    def subject(self, subject: str) -> str:
        return self.ns.subject(subject)

    async def settle(self) -> None:
        """Returns once every subscription made so far is known to the server."""
        await settle(self.nc)

    async def publish(
        self,
        subject: str,
        msg: BaseModel | bytes,
        context: Context | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        body = msg if isinstance(msg, bytes) else encode(msg)
        await self.nc.publish(
            self.subject(subject), body, headers={**inject(context), **(headers or {})}
        )

    async def request(
        self,
        subject: str,
        msg: BaseModel,
        reply_model: type[R],
        timeout: float,
        context: Context | None = None,
    ) -> R:
        """Sends `msg` and decodes the reply; raises BusError on any failure."""
        try:
            reply = await self.nc.request(
                self.subject(subject), encode(msg), timeout=timeout, headers=inject(context)
            )
        except NoRespondersError as e:
            raise BusError(ErrorInfo(status=503, message=f"no service on {subject}")) from e
        except (TimeoutError, NatsTimeoutError) as e:
            raise BusError(
                ErrorInfo(status=504, message=f"{subject} did not answer in {timeout:.1f}s")
            ) from e
        if reply.headers and ERROR_HEADER in reply.headers:
            raise BusError(_error_of(reply.data, int(reply.headers[ERROR_HEADER])))
        try:
            return decode(reply_model, reply.data)
        except ValidationError as e:
            raise BusError(ErrorInfo(message=f"malformed reply on {subject}: {e}")) from e

    async def serve(
        self, subject: str, model: type[BaseModel], handler: Handler, queue: str = ""
    ) -> Subscription:
        """Serves `subject`: each message is validated as `model` and passed to `handler`
        with its trace context. A malformed message, or a handler that raises, gets an
        error reply (when it has a reply subject) and the service goes on."""

        async def on_message(raw: Msg) -> None:
            ctx = extract(raw.headers)
            try:
                parsed = decode(model, raw.data)
            except (ValidationError, ValueError) as e:
                await self._reply_error(raw, ErrorInfo(status=400, message=str(e)), ctx)
                return
            try:
                answer = await handler(parsed, ctx, raw)
            except BusError as e:
                await self._reply_error(raw, e.info, ctx)
                return
            except Exception as e:
                log.exception("handler for %s failed", subject)
                await self._reply_error(raw, ErrorInfo(message=f"{type(e).__name__}: {e}"), ctx)
                return
            if raw.reply and answer is not None:
                await self.nc.publish(raw.reply, encode(answer), headers=inject(ctx))

        sub = await self.nc.subscribe(self.subject(subject), queue=queue, cb=on_message)
        # Requests sent after serve() returns must find the subscription.
        await settle(self.nc)
        return sub

    async def _reply_error(self, raw: Msg, info: ErrorInfo, ctx: Context) -> None:
        if not raw.reply:
            log.warning("dropped a bad message on %s: %s", raw.subject, info.message)
            return
        await self.nc.publish(
            raw.reply, encode(ErrorReply(error=info)), headers=error_headers(info.status, ctx)
        )

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except Exception:  # already closing or disconnected: nothing left to flush
            await self.nc.close()


def _error_of(data: bytes, status: int) -> ErrorInfo:
    try:
        return decode(ErrorReply, data).error
    except (ValidationError, ValueError):
        return ErrorInfo(status=status, message=data.decode(errors="replace")[:500])

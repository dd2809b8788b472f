"""NATS helpers: connect with reconnect, typed request/reply with timeouts, one typed
subscription path (validated message in, trace context extracted and made current,
handler called, malformed input answered with an error), and W3C trace context carried
in the headers of every message sent (the given context, else the current one).

Each service connects as its own NATS user (where the server has users; see
services/cli/nats_auth.py) with an inbox prefix of its own, so that the server's
permissions can keep every other user off its replies. A bus may name its sender: every
message it sends then carries `Spillway-Sender`, which lets a worker take plans from its
own scheduler only and a gateway take a request's deltas from that request's scheduler
only.

The service shells are the only callers; the pure cores never see the bus.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry.context import Context, attach, detach
from pydantic import BaseModel, ValidationError

from spillway.shared.log_safety import error_text, safe_text
from spillway.shared.protocol import ErrorInfo, ErrorReply, decode, encode
from spillway.shared.subjects import Namespace
from spillway.shared.telemetry import extract, inject

if TYPE_CHECKING:
    from spillway.shared.config import Settings

log = logging.getLogger(__name__)

ERROR_HEADER = "Spillway-Error"
SENDER_HEADER = "Spillway-Sender"
R = TypeVar("R", bound=BaseModel)
Handler = Callable[[Any, Context, Msg], Awaitable[BaseModel | None]]
InvalidHandler = Callable[[Msg, Exception, Context], Awaitable[None]]
Listener = Callable[[], Any]


def inbox_prefix(service: str) -> str:
    """The reply subjects of one service's requests: `_INBOX_<service>.<random>`."""
    return f"_INBOX_{service}"


class ConnectionEvents:
    """Who to tell when the connection drops and when it is back. Messages published to
    us while we were away are lost (core NATS keeps nothing), so a listener of
    `reconnected` must assume that news it was waiting for may never come."""

    def __init__(self) -> None:
        self.disconnected: list[Listener] = []
        self.reconnected: list[Listener] = []
        self.is_connected = True
        self.closing = False  # we are closing it ourselves: nothing was lost

    async def _on_disconnected(self) -> None:
        if self.is_connected and not self.closing:
            log.warning("lost the connection to NATS; reconnecting")
        self.is_connected = False
        self._tell(self.disconnected)

    async def _on_reconnected(self) -> None:
        self.is_connected = True
        log.info("reconnected to NATS")
        self._tell(self.reconnected)

    @staticmethod
    def _tell(listeners: list[Listener]) -> None:
        for listener in listeners:
            try:
                listener()
            except Exception:  # one listener's bug must not stop the others
                log.exception("connection listener failed")


async def _on_error(e: Exception) -> None:
    # Permission violations and slow-consumer drops arrive here; the client goes on.
    log.warning("NATS: %s", e)


class BusError(Exception):
    """A request that got no usable answer (timeout, no responders, an error reply)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


async def connect_nats(
    url: str,
    name: str,
    connect_timeout_s: float = 10.0,
    *,
    user: str | None = None,
    password: str | None = None,
    inbox: str | None = None,
    events: ConnectionEvents | None = None,
) -> NatsClient:
    """Connects, retrying until `connect_timeout_s`; once connected it reconnects forever.
    `user`/`password`, when given, win over credentials in the URL."""
    deadline = asyncio.get_running_loop().time() + connect_timeout_s
    last: Exception | None = None
    options: dict[str, Any] = {}
    if user is not None and password is not None:
        options.update(user=user, password=password)
    if inbox:
        options["inbox_prefix"] = inbox
    if events is not None:
        options.update(
            disconnected_cb=events._on_disconnected, reconnected_cb=events._on_reconnected
        )
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
                error_cb=_on_error,
                **options,
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

    def __init__(
        self,
        nc: NatsClient,
        namespace: str = "",
        sender: str = "",
        events: ConnectionEvents | None = None,
    ) -> None:
        self.nc = nc
        self.ns = Namespace(namespace)
        self.sender = sender
        self.events = events or ConnectionEvents()

    @classmethod
    async def connect(
        cls,
        url: str,
        namespace: str,
        name: str,
        *,
        sender: str = "",
        service: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> Bus:
        """`service` names the inbox prefix its user may subscribe to."""
        events = ConnectionEvents()
        nc = await connect_nats(
            url,
            name,
            user=user,
            password=password,
            inbox=inbox_prefix(service) if service else None,
            events=events,
        )
        return cls(nc, namespace, sender, events)

    @classmethod
    async def for_service(
        cls, settings: Settings, service: str, name: str, sender: str = ""
    ) -> Bus:
        """A service's own connection: its NATS user, its inbox prefix."""
        return await cls.connect(
            settings.nats_url,
            settings.namespace,
            name,
            sender=sender,
            service=service,
            user=settings.nats_user,
            password=settings.nats_password,
        )

    @property
    def is_connected(self) -> bool:
        return self.events.is_connected and self.nc.is_connected

    def _headers(self, context: Context | None, extra: dict[str, str] | None = None):
        headers = {**inject(context), **(extra or {})}
        if self.sender:
            headers[SENDER_HEADER] = self.sender
        return headers

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
        await self.nc.publish(self.subject(subject), body, headers=self._headers(context, headers))

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
                self.subject(subject), encode(msg), timeout=timeout, headers=self._headers(context)
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

    async def subscribe(
        self,
        subject: str,
        model: type[BaseModel] | type[bytes],
        handler: Handler,
        queue: str = "",
        on_invalid: InvalidHandler | None = None,
        overlap: bool = False,
    ) -> Subscription:
        """The one way a service takes messages: each message on `subject` is validated
        as `model` (`bytes`: a body the handler validates itself, such as the external
        API's OpenAI bodies with their own error format) and passed to `handler` with its
        trace context, which is also the current context while the handler runs (so its
        spans and the messages it sends continue the sender's trace). What the handler
        returns is the reply, when the message has a reply subject.

        A malformed message goes to `on_invalid` when given; otherwise it gets an error
        reply (when it has a reply subject) or a log line. A handler that raises gets an
        error reply too, and the subscription goes on.

        Messages are handled one after another, unless `overlap`: then each handler runs as
        its own task, started in arrival order, and the next message is taken while it
        waits (a handler that hands its work to one FIFO, as the worker's steps go to its
        one thread, keeps the order and finds the next message already queued)."""

        async def handle(raw: Msg) -> None:
            ctx = extract(raw.headers)
            token = attach(ctx)
            try:
                await self._handle(raw, ctx, subject, model, handler, on_invalid)
            finally:
                detach(token)

        running: set[asyncio.Task[None]] = set()

        async def on_message(raw: Msg) -> None:
            if not overlap:
                await handle(raw)
                return
            task = asyncio.create_task(handle(raw))
            running.add(task)  # a strong reference until it ends
            task.add_done_callback(_forget_task(running))

        sub = await self.nc.subscribe(self.subject(subject), queue=queue, cb=on_message)
        # Requests sent after subscribe() returns must find the subscription.
        await settle(self.nc)
        return sub

    # Request/reply subjects read better as served; it is the same path.
    serve = subscribe

    async def _handle(
        self,
        raw: Msg,
        ctx: Context,
        subject: str,
        model: type[BaseModel] | type[bytes],
        handler: Handler,
        on_invalid: InvalidHandler | None,
    ) -> None:
        try:
            parsed: Any = (
                raw.data if model is bytes else decode(cast(type[BaseModel], model), raw.data)
            )
        except (ValidationError, ValueError) as e:
            if on_invalid is not None:
                await on_invalid(raw, e, ctx)
            else:
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
            await self.nc.publish(raw.reply, encode(answer), headers=self._headers(ctx))

    async def _reply_error(self, raw: Msg, info: ErrorInfo, ctx: Context) -> None:
        if not raw.reply:
            # The message may quote the bad input (a prompt): its text stays out of logs.
            log.warning("dropped a bad message on %s: %s", raw.subject, safe_text(info.message))
            return
        headers = self._headers(None, error_headers(info.status, ctx))
        await self.nc.publish(raw.reply, encode(ErrorReply(error=info)), headers=headers)

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        self.events.closing = True
        try:
            await self.nc.drain()
        except Exception:  # already closing or disconnected: nothing left to flush
            await self.nc.close()


def _forget_task(running: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    def forget(task: asyncio.Task[None]) -> None:
        running.discard(task)
        error = None if task.cancelled() else task.exception()  # taken: never "unretrieved"
        if error is not None:
            log.warning("a handler's task failed: %s", error_text(error))

    return forget


def sender_of(raw: Msg) -> str:
    """The sender a message names ("" when it names none)."""
    return (raw.headers or {}).get(SENDER_HEADER, "")


def _error_of(data: bytes, status: int) -> ErrorInfo:
    try:
        return decode(ErrorReply, data).error
    except (ValidationError, ValueError):
        return ErrorInfo(status=status, message=data.decode(errors="replace")[:500])

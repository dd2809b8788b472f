"""The HTTP API (CONTRACT section 2): OpenAI routes, /health, /metrics.

Two thin ASGI layers wrap the Starlette app: tracing outermost (every response, errors
and 500s included, carries a W3C `traceparent`; an incoming one parents the request's
root span), then the API key check for `/v1/` routes. A client that goes away, before
a reply or mid-stream, aborts its request at once.

Hostile clients: a body over max_request_bytes is a 413 before it is read (or as soon as
it grows past the limit), a body that does not arrive within the client timeout a 408,
and a stream whose reader stalls that long is cut and its request aborted (slow headers
are timed out by the protocol in http_server.py). 429 and 503 carry Retry-After.
/health is 200 while a live scheduler (by its lease) drives a worker, and 503 while the
gateway drains.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spillway.services.gateway.api import GatewayApi, Generation
from spillway.services.gateway.errors import ApiError
from spillway.services.gateway.json_body import parse_json_body
from spillway.services.gateway.metrics import GatewayMetrics, spill_health
from spillway.services.gateway.openai_responses import (
    ResponseShell,
    chat_body,
    renamed,
    response_body,
    response_events,
)
from spillway.services.gateway.openapi import openapi_document
from spillway.services.gateway.tokenize_api import detokenize, tokenize
from spillway.services.gateway.validation import Kind, RequestPreparer
from spillway.shared.clock import Clock, MonotonicClock
from spillway.shared.protocol import SchedulerLease
from spillway.shared.telemetry import extract, inject

log = logging.getLogger(__name__)

SPAN_KEY = "spillway.span"
HEALTH_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int = 4 << 20
    client_timeout_s: float = 30.0


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def create_app(
    api: GatewayApi,
    metrics: GatewayMetrics,
    tracer: trace.Tracer,
    api_key: str | None = None,
    clock: Clock | None = None,
    limits: HttpLimits | None = None,
    allowed_origins: list[str] | None = None,
) -> ASGIApp:
    """The gateway's ASGI app; `uvicorn` serves it (service.py). With `allowed_origins`
    (`--allowed-origins`), browsers on those origins may call it: CORS preflights are
    answered, outside the API key check, as a browser sends them without credentials."""
    clock = clock or MonotonicClock()
    limits = limits or HttpLimits()

    async def chat_completions(request: Request) -> Response:
        return await _generate(api, clock, limits, request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(api, clock, limits, request, "completion")

    async def responses(request: Request) -> Response:
        return await _respond(api, clock, limits, request)

    async def tokenize_route(request: Request) -> Response:
        return await _tokenizer_call(api, limits, request, tokenize)

    async def detokenize_route(request: Request) -> Response:
        return await _tokenizer_call(api, limits, request, detokenize)

    async def openapi(request: Request) -> Response:
        info = api.model
        return JSONResponse(openapi_document(info.model_id, info.context_length, info.vocab_size))

    async def list_models(request: Request) -> Response:
        return JSONResponse(api.models())

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        for entry in api.models()["data"]:
            if entry["id"] == name:
                return JSONResponse(entry)
        return error_response(
            ApiError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        )

    async def health(request: Request) -> Response:
        body = health_body(api)
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    async def prometheus(request: Request) -> Response:
        metrics.scheduler.update(await api.engine.scheduler_stats(HEALTH_TIMEOUT_S))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), error_type=error_type))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(ApiError(500, "internal server error"))

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/tokenize", tokenize_route, methods=["POST"]),
            Route("/detokenize", detokenize_route, methods=["POST"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    guarded: ASGIApp = ApiKeyMiddleware(app, api_key)
    if allowed_origins:
        guarded = CORSMiddleware(
            guarded, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    return TracingMiddleware(guarded, tracer)


async def _tokenizer_call(
    api: GatewayApi,
    limits: HttpLimits,
    request: Request,
    call: Callable[[RequestPreparer, dict[str, Any]], dict[str, Any]],
) -> Response:
    """/tokenize and /detokenize: a body in, an answer or an OpenAI error out; the
    tokenizer runs on a worker thread, so a big body never stalls the loop."""
    try:
        raw = await read_body(request, limits)
        body = await asyncio.to_thread(parse_json_body, raw)
        return JSONResponse(await asyncio.to_thread(call, api.preparer, body))
    except ApiError as e:
        return error_response(e)
    except ClientDisconnect:
        return Response(status_code=499)


def _driven(lease: SchedulerLease) -> list[str]:
    """The workers a scheduler drives (an older lease names only its first)."""
    if lease.worker_ids:
        return list(lease.worker_ids)
    return [lease.worker_id] if lease.worker_id else []


def health_body(api: GatewayApi) -> dict[str, Any]:
    """What /health says: "ok" while some live scheduler drives a worker, by the leases."""
    engine = api.engine
    leases = engine.schedulers.live()
    serving = [lease for lease in leases if lease.worker_id and not lease.draining]
    body: dict[str, Any] = {
        "status": "ok" if serving and not engine.draining else "unavailable",
        "workers": len({w for lease in serving for w in _driven(lease)}),
        "schedulers": [
            {
                "id": lease.scheduler_id,
                "worker": lease.worker_id,
                "workers": _driven(lease),
                "draining": lease.draining,
                "running": lease.num_running,
                "waiting": lease.num_waiting,
            }
            for lease in leases
        ],
        "running": sum(lease.num_running for lease in leases),
        "waiting": sum(lease.num_waiting for lease in leases),
        "kv_cache_usage": max((lease.kv_usage for lease in serving), default=0.0),
        "model": api.model.model_id,
        "spill": spill_health(serving),
    }
    if engine.draining:
        body["status"] = "draining"
        body["reason"] = "the gateway is shutting down"
    elif not engine.bus.is_connected:
        body["reason"] = "the gateway cannot reach NATS"
    elif not leases:
        body["reason"] = "no scheduler answers"
    elif not serving:
        body["reason"] = "no worker is registered"
    return body


async def _generate(
    api: GatewayApi, clock: Clock, limits: HttpLimits, request: Request, kind: Kind
) -> Response:
    arrival = clock.now()
    span: trace.Span = request.scope.get(SPAN_KEY) or trace.INVALID_SPAN
    try:
        raw = await read_body(request, limits)
        body = await asyncio.to_thread(parse_json_body, raw)
        generation = await api.open(kind, body, span, arrival)
    except ApiError as e:
        _record_error(span, e)
        return error_response(e)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is left to answer
    if generation.prepared.stream:
        return EventStreamResponse(generation, limits.client_timeout_s)
    return await _reply_when_done(generation, request.receive)


async def _respond(api: GatewayApi, clock: Clock, limits: HttpLimits, request: Request) -> Response:
    """/v1/responses: the request runs as a chat completion (openai_responses.py)."""
    arrival = clock.now()
    span: trace.Span = request.scope.get(SPAN_KEY) or trace.INVALID_SPAN
    try:
        raw = await read_body(request, limits)
        body = await asyncio.to_thread(parse_json_body, raw)
        generation = await api.open("chat", chat_body(body), span, arrival)
    except ApiError as e:
        error = renamed(e)
        _record_error(span, error)
        return error_response(error)
    except ClientDisconnect:
        return Response(status_code=499)
    shell = ResponseShell(body, generation.prepared.model)
    if generation.prepared.stream:
        events = response_events(shell, generation.chunks())
        return EventStreamResponse(generation, limits.client_timeout_s, events)
    return await _reply_when_done(generation, request.receive, partial(response_body, shell))


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The body, refused with 413 past max_request_bytes (unread when its declared length
    says so) and with 408 when it takes longer than the client timeout to arrive."""
    limit = limits.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        async with asyncio.timeout(limits.client_timeout_s):  # wait_for may lose a cancel
            return await read()
    except TimeoutError as e:
        raise ApiError(
            408,
            f"the request body did not arrive within {limits.client_timeout_s:g}s",
            code="request_timeout",
        ) from e


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size} bytes or more; at most {limit} are accepted",
        code="request_too_large",
    )


async def _reply_when_done(
    generation: Generation,
    receive: Receive,
    shape: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Response:
    collect = asyncio.ensure_future(generation.collect())
    gone = asyncio.ensure_future(_client_gone(receive))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            # Nobody will read the answer; close() below aborts the sequences now.
            return Response(status_code=499)
        try:
            body = collect.result()
            return JSONResponse(shape(body) if shape else body)
        except ApiError as e:
            _record_error(generation.span, e)
            return error_response(e)
    finally:
        for task in (collect, gone):
            task.cancel()
        await asyncio.gather(collect, gone, return_exceptions=True)
        await generation.close()


async def _client_gone(receive: Receive) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _record_error(span: trace.Span, error: ApiError) -> None:
    span.set_attribute("error.type", error.code or error.error_type)
    if error.status >= 500:
        span.set_status(Status(StatusCode.ERROR, error.message))


def sse_event(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class EventStreamResponse:
    """Server-Sent Events for one generation: a `data:` line per chunk, an error event if
    it fails midway, then `data: [DONE]`. Watches for the client leaving the whole time;
    a client that stops reading for `write_timeout_s` counts as gone.

    With `events` (the Responses API), each event is sent as `event: <type>` plus its
    `data:`, a failure as an `error` event, and no `[DONE]` follows (OpenAI's form)."""

    def __init__(
        self,
        generation: Generation,
        write_timeout_s: float = 30.0,
        events: AsyncIterator[dict[str, Any]] | None = None,
    ) -> None:
        self.generation = generation
        self.write_timeout_s = write_timeout_s
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            # Not asyncio.wait_for: in Python 3.11 it returns normally when the write ends
            # at the moment the pump is cancelled (the client left), and the pump then
            # streams on, unheard, to the generation's end before anything is aborted.
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError as e:
                raise OSError("the client stopped reading the stream") from e

        try:
            await self._stream(receive, send_in_time)
        except OSError:
            await self.generation.close()

    async def _stream(self, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        pump = asyncio.ensure_future(self._pump(send))
        gone = asyncio.ensure_future(_client_gone(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, gone):
                task.cancel()
            await asyncio.gather(pump, gone, return_exceptions=True)
            await self.generation.close()

    async def _pump(self, send: Send) -> None:
        async def body(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        named = self.events is not None
        try:
            async for chunk in self.events or self.generation.chunks():
                await body(_named_event(chunk) if named else sse_event(chunk))
        except ApiError as e:
            _record_error(self.generation.span, e)
            # The Responses API's error event carries OpenAI's fields flat and nested.
            flat = {"code": e.code, "message": e.message, "param": e.param}
            error = {"type": "error", **flat, **e.body()} if named else e.body()
            await body(_named_event(error) if named else sse_event(error))
        except OSError:  # the client went away while we wrote
            return
        try:
            if not named:
                await body(sse_event("[DONE]"))
            await body(b"", more=False)
        except OSError:
            return


def _named_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\n".encode() + sse_event(event)


class ApiKeyMiddleware:
    """With a key set, every /v1/ route needs `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = _header(scope, b"authorization") or ""
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                error = ApiError(
                    401,
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class TracingMiddleware:
    """A SERVER span per HTTP request, child of an incoming `traceparent`; its context is
    returned in the `traceparent` response header of every response."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = extract(headers)
        name = f"{scope['method']} {scope['path']}"
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
        span.set_attributes({"http.request.method": scope["method"], "url.path": scope["path"]})
        scope[SPAN_KEY] = span
        trace_headers = [
            (k.encode(), v.encode()) for k, v in inject(trace.set_span_in_context(span)).items()
        ]

        async def send_with_trace(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *trace_headers]}
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        try:
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                await self.app(scope, receive, send_with_trace)
        except Exception as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, str(e)))
            raise
        finally:
            span.end()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None

"""The gateway service: tokenizer + model limits, the bus, the HTTP server, the NATS API.

`serve(settings, stop)` is the service's whole life: it loads the tokenizer (converting a
GGUF's once into the cache), connects, subscribes its delta subject, starts uvicorn on
settings.host/port (port 0 picks a free one; the bound one is announced), announces
itself ready, and on `stop` drains:

    1. new requests get 503 with Retry-After (HTTP keeps listening, so clients hear why;
       llm.generate leaves the queue group, so other gateways take the NATS requests)
    2. running requests may finish, for up to drain_timeout_s
    3. the rest end with finish_reason "abort" (streams with their finish chunk and
       [DONE], NATS streams with their done message)
    4. the server closes and the service returns (exit code 0)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from spillway.services.gateway.api import GatewayApi
from spillway.services.gateway.app import HttpLimits, create_app
from spillway.services.gateway.engine import GatewayEngine
from spillway.services.gateway.http_server import guarded_protocol
from spillway.services.gateway.metrics import GatewayMetrics
from spillway.services.gateway.model_facts import load_model_facts
from spillway.services.gateway.nats_api import NatsApi
from spillway.services.gateway.sampling_fields import SamplingDefaults
from spillway.services.gateway.structured_output import GrammarBuilder
from spillway.services.gateway.tokenizer import ModelTokenizer, load_tokenizer
from spillway.services.gateway.tool_formats import tool_format
from spillway.services.gateway.validation import ModelInfo, RequestPreparer
from spillway.shared.bus import Bus
from spillway.shared.config import Settings
from spillway.shared.lifecycle import announce_ready
from spillway.shared.model_files import resolve_model
from spillway.shared.output_formats import detect_reasoning
from spillway.shared.regions import detect_markers
from spillway.shared.serving import chat_template_text, served_context_length, served_names
from spillway.shared.telemetry import Telemetry

log = logging.getLogger(__name__)

# After the drain: how long the aborted requests get to write their last words.
END_GRACE_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the service's `stop` event rules."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Gateway:
    """A running gateway; `url` is where its HTTP API listens."""

    settings: Settings
    gateway_id: str
    url: str
    bus: Bus
    engine: GatewayEngine
    nats_api: NatsApi
    server: _Server
    server_task: asyncio.Task[None]
    telemetry: Telemetry

    async def shutdown(self) -> None:
        drain_s = self.settings.drain_timeout_s
        self.engine.draining = True
        await self.nats_api.stop_accepting()
        if self.engine.num_active:
            log.info("draining %d requests (up to %gs)", self.engine.num_active, drain_s)
        if not await self.engine.wait_idle(drain_s):
            log.warning(
                "aborting %d requests still running after the drain", self.engine.num_active
            )
            self.engine.cancel_all()
            await self.engine.wait_idle(END_GRACE_S)
        await self.nats_api.drain(END_GRACE_S)
        # uvicorn stops listening, then waits for responses still being written (up to
        # its graceful timeout) and cancels what is left.
        self.server.should_exit = True
        await asyncio.wait({self.server_task}, timeout=END_GRACE_S + 3)
        if not self.server_task.done():
            self.server_task.cancel()
        await asyncio.gather(self.server_task, return_exceptions=True)
        await self.engine.stop()
        await self.bus.close()
        self.telemetry.shutdown()


def model_info(settings: Settings) -> tuple[ModelTokenizer, ModelInfo]:
    source = resolve_model(settings.model)
    tokenizer = load_tokenizer(
        source, settings.cache_dir, chat_template_text(settings.chat_template)
    )
    facts = load_model_facts(source, settings.cache_dir)
    template = tokenizer.chat_template.source if tokenizer.chat_template else None
    token_id = tokenizer.tokenizer.token_to_id
    tools, reasoning = settings.tool_call_parser, settings.reasoning_parser
    names = served_names(settings.served_model_name, source.model_id)
    # Without --served-model-name the model also answers to how it was given (a path).
    aliases = names[1:] if settings.served_model_name else [settings.model, str(source.path)]
    info = ModelInfo(
        model_id=names[0],
        context_length=served_context_length(facts.context_length, settings.max_model_len),
        vocab_size=facts.vocab_size,
        aliases=frozenset(aliases),
        listed=tuple(names),
        markers=detect_markers(token_id, template, settings.region_markers, tools, reasoning),
        tool_format=tool_format(tools, template),
        reasoning=detect_reasoning(token_id, template, reasoning),
    )
    log.info(
        "output formats: tool calls %s, reasoning %s",
        info.tool_format.name,
        info.reasoning.name if info.reasoning else "none",
    )
    return tokenizer, info


async def start_gateway(settings: Settings) -> Gateway:
    # Converting a GGUF tokenizer takes seconds the first time: keep the loop free.
    tokenizer, info = await asyncio.to_thread(model_info, settings)
    gateway_id = settings.service_id or f"gw{uuid.uuid4().hex[:10]}"
    telemetry = Telemetry("gateway", settings.otlp_endpoint, settings.trace_file)
    bus = await Bus.for_service(
        settings, "gateway", f"spillway-gateway-{gateway_id}", sender=gateway_id
    )
    metrics = GatewayMetrics(info.model_id)
    engine = GatewayEngine(
        bus,
        gateway_id,
        tokenizer,
        metrics,
        scheduler_timeout_s=settings.scheduler_timeout_s,
        resume_timeout_s=settings.resume_timeout_s,
        vocab_size=info.vocab_size,
        markers=info.markers,
    )
    await engine.start()
    preparer = RequestPreparer(
        tokenizer,
        info,
        random_seed=lambda: secrets.randbits(63),
        sampling_defaults=SamplingDefaults(settings.sampling_by_region, settings.region_sampling),
        grammars=GrammarBuilder(),  # loads xgrammar in the background from now on
    )
    api = GatewayApi(engine, preparer, info)
    limits = HttpLimits(settings.max_request_bytes, settings.http_client_timeout_s)
    app = create_app(
        api,
        metrics,
        telemetry.tracer,
        api_key=settings.api_key,
        limits=limits,
        allowed_origins=settings.allowed_origins,
    )
    server = _Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            http=guarded_protocol(settings.http_client_timeout_s),
            lifespan="off",
            log_level="warning",
            # uvicorn's records go through the service's own handler (text or JSON).
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(END_GRACE_S) + 1,
        )
    )
    server_task = asyncio.ensure_future(_run(server))
    while not server.started:
        if server_task.done():
            await bus.close()
            raise RuntimeError(
                f"the gateway could not listen on {settings.host}:{settings.port}"
            ) from _exception_of(server_task)
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    nats_api = NatsApi(bus, api, telemetry.tracer)
    await nats_api.start()
    url = f"http://{_url_host(settings.host)}:{port}"
    return Gateway(settings, gateway_id, url, bus, engine, nats_api, server, server_task, telemetry)


async def _run(server: _Server) -> None:
    try:
        await server.serve()
    except SystemExit as e:  # uvicorn exits the process when it cannot bind; we report
        raise RuntimeError("uvicorn failed to start") from e


def _exception_of(task: asyncio.Task[None]) -> BaseException | None:
    if task.cancelled():
        return None
    return task.exception()


def _url_host(configured: str) -> str:
    # A wildcard address is not one a client can dial: name the loopback instead.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(configured, configured)
    return f"[{host}]" if ":" in host else host


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    gateway = await start_gateway(settings)
    announce_ready("gateway", gateway.url)
    try:
        await stop.wait()
    finally:
        await gateway.shutdown()

"""A gateway started with `serve()` (port 0) against the scripted scheduler double, both
on the real NATS server, in a namespace of their own."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from unittest import mock

import httpx
import pytest
import pytest_asyncio

from spillway.services.gateway import service as gateway_service
from spillway.services.gateway.tokenizer import ModelTokenizer, load_tokenizer
from spillway.shared.bus import Bus
from spillway.shared.config import DEFAULT_MODEL, Settings
from spillway.shared.model_files import resolve_model
from tests.integration.gateway.scheduler_double import SchedulerDouble

MODEL = DEFAULT_MODEL


@pytest.fixture(scope="session")
def served_tokenizer() -> ModelTokenizer:
    """The tokenizer the gateway serves with (same cache folder, so converted at most once)."""
    return load_tokenizer(resolve_model(MODEL), Settings().cache_dir)


@dataclass
class RunningGateway:
    url: str
    settings: Settings
    stop: asyncio.Event
    task: asyncio.Task

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 30)


async def start_serving(settings: Settings) -> RunningGateway:
    """Runs `serve()` as the CLI would and returns once it announced its URL."""
    loop = asyncio.get_running_loop()
    announced: asyncio.Future[str] = loop.create_future()
    stop = asyncio.Event()

    def record(service: str, detail: str = "") -> None:
        announced.set_result(detail)

    with mock.patch.object(gateway_service, "announce_ready", record):
        task = asyncio.ensure_future(gateway_service.serve(settings, stop))
        done, _ = await asyncio.wait({task, announced}, timeout=60, return_when="FIRST_COMPLETED")
        if announced not in done:
            task.cancel()
            raise RuntimeError(f"the gateway did not start: {task}")
    return RunningGateway(announced.result(), settings, stop, task)


def gateway_settings(nats_url: str, namespace: str, **overrides) -> Settings:
    return Settings(
        **{
            "nats_url": nats_url,
            "namespace": namespace,
            "port": 0,
            "service_id": f"gw-{uuid.uuid4().hex[:6]}",
            "drain_timeout_s": 3.0,
            **overrides,
        }
    )


@contextlib.asynccontextmanager
async def serving_on_a_double(
    nats_url: str, tokenizer: ModelTokenizer, prefix: str, **overrides
) -> AsyncIterator[tuple[RunningGateway, SchedulerDouble]]:
    """A gateway (`gateway_settings` with `overrides`) and the scheduler double it serves
    with, in a namespace of their own (`prefix` and a random tail); on leaving, the gateway
    shuts down, then the double closes."""
    namespace = f"{prefix}{uuid.uuid4().hex[:8]}"
    double = SchedulerDouble(await Bus.connect(nats_url, namespace, "double"), tokenizer)
    await double.start()
    try:
        gateway = await start_serving(gateway_settings(nats_url, namespace, **overrides))
        try:
            yield gateway, double
        finally:
            await gateway.shutdown()
    finally:
        await double.close()


@dataclass
class System:
    gateway: RunningGateway
    scheduler: SchedulerDouble
    namespace: str
    client: httpx.AsyncClient

    @property
    def url(self) -> str:
        return self.gateway.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def system(nats_url, served_tokenizer):
    async with (
        serving_on_a_double(nats_url, served_tokenizer, "gw") as (gateway, double),
        httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
    ):
        yield System(gateway, double, gateway.settings.namespace, client)

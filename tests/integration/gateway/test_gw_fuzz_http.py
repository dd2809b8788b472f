"""schemathesis over the gateway's own OpenAPI document (GET /openapi.json): bodies that fit
the schema and bodies that break it, for every route. None may get a 5xx, and the gateway
serves on. The scheduler double answers each generation in one delta (burst), so valid
cases cost a round trip, not a generation.

Hypothesis runs derandomized: CI sees the same cases every run, and a failure names the
body that caused it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from spillway.shared.bus import Bus
from tests.integration.gateway.conftest import gateway_settings, start_serving
from tests.integration.gateway.scheduler_double import SchedulerDouble

EXAMPLES = {"POST": 180, "GET": 25}  # per operation and generation mode
MIN_CASES = 700


class GatewayThread:
    """A gateway and a scheduler double on an event loop of their own, so that a
    synchronous client (schemathesis uses requests) can drive them."""

    def __init__(self, nats_url: str, tokenizer) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url, self._down = self._run(self._up(nats_url, tokenizer))

    def _run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _up(self, nats_url: str, tokenizer):
        namespace = f"fuzz{uuid.uuid4().hex[:8]}"
        bus = await Bus.connect(nats_url, namespace, "double")
        double = SchedulerDouble(bus, tokenizer, burst=True)
        await double.start()
        gateway = await start_serving(gateway_settings(nats_url, namespace))

        async def down() -> None:
            await gateway.shutdown()
            await double.close()

        return gateway.url, down

    def close(self) -> None:
        self._run(self._down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def gateway_thread(nats_url, served_tokenizer):
    g = GatewayThread(nats_url, served_tokenizer)
    yield g
    g.close()


def test_no_generated_request_gets_a_server_error(gateway_thread):
    url = gateway_thread.url
    session = requests.Session()
    for _ in range(100):  # the gateway has heard the double's lease
        if session.get(f"{url}/health", timeout=10).status_code == 200:
            break
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @settings(
                max_examples=EXAMPLES[operation.method.upper()],
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(mode), data=st.data())
            def call(case, data) -> None:
                response = case.call(base_url=url, session=session, timeout=30)
                statuses[response.status_code] += 1
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.path} {case.body!r:.300}: {response.text}"
                    )

            call()
    assert not failures, failures[:5]
    total = sum(statuses.values())
    print(f"{total} cases: {dict(sorted(statuses.items()))}")
    assert total >= MIN_CASES
    # Both sides were exercised: accepted generations and refused bodies.
    assert statuses[200] > 80 and statuses[400] > 300
    assert session.get(f"{url}/health", timeout=10).status_code == 200

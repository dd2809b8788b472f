"""The NATS helper against a real nats-server."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from spillway.shared.bus import Bus, BusError
from spillway.shared.protocol import AbortRequest, SubmitReply
from spillway.shared.telemetry import Telemetry


async def test_request_reply_roundtrip_carries_trace_context(nats_url):
    tel = Telemetry("test", None)
    server = await Bus.connect(nats_url, "ns1", "server")
    client = await Bus.connect(nats_url, "ns1", "client")
    seen = {}

    async def handle(msg: AbortRequest, ctx, raw):
        seen["subject"] = raw.subject
        seen["trace_id"] = trace.get_current_span(ctx).get_span_context().trace_id
        return SubmitReply(ok=len(msg.request_ids) == 2)

    await server.serve("t.echo", AbortRequest, handle)
    with tel.tracer.start_as_current_span("caller") as span:
        reply = await client.request("t.echo", AbortRequest(request_ids=["a", "b"]), SubmitReply, 2)
    assert reply.ok
    assert seen["subject"] == "ns1.t.echo"
    assert seen["trace_id"] == span.get_span_context().trace_id
    await server.close()
    await client.close()


async def test_malformed_body_gets_error_reply_and_service_goes_on(nats_url):
    server = await Bus.connect(nats_url, "", "server")
    client = await Bus.connect(nats_url, "", "client")

    async def handle(msg, ctx, raw):
        return SubmitReply(ok=True)

    await server.serve("t.strict", AbortRequest, handle)
    raw = await client.nc.request("t.strict", b"{not json", timeout=2)
    assert raw.headers["Spillway-Error"] == "400"
    with pytest.raises(BusError) as err:
        await client.request("t.strict", SubmitReply(ok=True), SubmitReply, 2)
    assert err.value.info.status == 400
    ok = await client.request("t.strict", AbortRequest(request_ids=[]), SubmitReply, 2)
    assert ok.ok
    await server.close()
    await client.close()


async def test_closing_on_purpose_warns_of_no_lost_connection(nats_url, caplog):
    bus = await Bus.connect(nats_url, "", "client")
    with caplog.at_level("INFO", logger="spillway.shared.bus"):
        await bus.close()
    assert bus.nc.is_closed and not bus.events.is_connected  # the callback did run
    assert not [r for r in caplog.records if "lost the connection" in r.getMessage()]


async def test_request_without_responders_is_503(nats_url):
    client = await Bus.connect(nats_url, "", "client")
    with pytest.raises(BusError) as err:
        await client.request("t.nobody", AbortRequest(request_ids=[]), SubmitReply, 1)
    assert err.value.info.status == 503
    await client.close()


async def test_a_request_right_after_serve_always_finds_the_service(nats_url):
    # nats-py can answer a flush before its SUB leaves the client; serve() must not.
    async def handle(msg, ctx, raw):
        return SubmitReply(ok=True)

    for _ in range(100):
        server = await Bus.connect(nats_url, "ns-settle", "server")
        client = await Bus.connect(nats_url, "ns-settle", "client")
        await server.serve("t.fresh", AbortRequest, handle)
        reply = await client.request("t.fresh", AbortRequest(request_ids=[]), SubmitReply, 2)
        assert reply.ok
        await server.close()
        await client.close()


async def test_overlapping_handlers_take_the_next_message_while_one_waits(nats_url):
    """Handled one after another, a waiting handler holds back the next message; with
    overlap the next one starts (in arrival order) and both replies come."""
    import asyncio

    server = await Bus.connect(nats_url, "", "server")
    client = await Bus.connect(nats_url, "", "client")
    release = asyncio.Event()
    started: list[str] = []

    async def handle(msg: AbortRequest, ctx, raw):
        started.append(msg.request_ids[0])
        if msg.request_ids[0] == "first":
            await release.wait()
        return SubmitReply(ok=True)

    await server.serve("t.serial", AbortRequest, handle)
    await server.serve("t.overlap", AbortRequest, handle, overlap=True)
    for subject in ("t.serial", "t.overlap"):
        started.clear()
        release.clear()
        ask = [
            asyncio.create_task(
                client.request(subject, AbortRequest(request_ids=[i]), SubmitReply, 5)
            )
            for i in ("first", "second")
        ]
        await asyncio.sleep(0.3)
        assert started == (["first"] if subject == "t.serial" else ["first", "second"])
        release.set()
        assert all(r.ok for r in await asyncio.gather(*ask))
        assert started == ["first", "second"]
    await server.close()
    await client.close()

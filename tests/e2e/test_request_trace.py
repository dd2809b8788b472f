"""One trace per request through every service, on a tiny system whose KV cache holds
only one of two concurrent requests to the end: one is preempted by spill and swapped
back in. Its trace holds the gateway's, scheduler's, worker's and spill store's spans,
every parent inside the trace, phases in the seeds' order tick by tick; the step spans
that served both requests link to both."""

from __future__ import annotations

import concurrent.futures as cf
import os

import httpx
import pytest

from spillway.services.cli.launcher import System, wait_until
from spillway.services.scheduler.tracing import SEED_PHASES
from tests.e2e.otlp_sink import OtlpSink, ReceivedSpan

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 20
NEW_TOKENS = 60  # 80 tokens = 5 blocks of 16 each: two requests need 10 of the 8
SERVICES = {"spillway-gateway", "spillway-scheduler", "spillway-worker", "spillway-spillstore"}


@pytest.fixture(scope="module")
def traced(tiny_model_dir, nats_url, redis_url):
    sink = OtlpSink()
    s = System(
        "--model", str(tiny_model_dir),
        "--namespace", "traced",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "8",
        "--block-size", "16",
        "--max-batch", "2",
        "--dtype", "float32",
        "--preemption-mode", "spill",
        "--otlp-endpoint", sink.url,
    )  # fmt: skip
    try:
        # Spilling starts once the scheduler has heard from a healthy spill store.
        assert wait_until(lambda: _health(s.url)["spill"]["status"] == "ok", timeout=30)
        yield s, sink
    finally:
        s.stop()
        sink.close()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def _generate(url: str, first_token: int, trace_id: str) -> dict:
    body = {
        "prompt": [first_token + i for i in range(PROMPT_TOKENS)],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(sink: OtlpSink, trace_id: str, spilled: bool) -> bool:
    """Every parent has arrived, the request is retired, every row span has the worker's
    (and for the spilled one, every service's spans are in, its spill dropped)."""
    spans = sink.trace(trace_id)
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_span_id not in ids]
    names = {s.name for s in spans}
    rows = {s.span_id for s in spans if s.name in ("scheduler.prefill", "scheduler.decode")}
    # The worker sends a run's span once the run is over (it may wait for an idle moment).
    computed = {s.parent_span_id for s in spans if s.name == "worker.forward"}
    return (
        len(roots) == 1
        and "scheduler.retire" in names
        and rows <= computed
        and (not spilled or ({s.service for s in spans} >= SERVICES and "spillstore.drop" in names))
    )


def test_a_spilled_request_has_one_trace_through_every_service(traced):
    system, sink = traced
    trace_ids = [os.urandom(16).hex() for _ in range(2)]
    with cf.ThreadPoolExecutor(2) as pool:
        bodies = list(pool.map(_generate, [system.url] * 2, [1000, 2000], trace_ids))

    def spilled(trace_id: str) -> bool:
        return any(
            s.name == "scheduler.preempt" and s.attributes["spillway.preemption.mode"] == "spill"
            for s in sink.trace(trace_id)
        )

    assert wait_until(lambda: any(spilled(t) for t in trace_ids), timeout=20), system.tail()
    victim = next(t for t in trace_ids if spilled(t))
    other = next(t for t in trace_ids if t != victim)
    assert wait_until(
        lambda: all(_complete(sink, t, t == victim) for t in trace_ids), timeout=20
    ), "\n\n".join("\n".join(_summary(sink.trace(t))) for t in trace_ids)
    spans = sink.trace(victim)
    by_id = {s.span_id: s for s in spans}
    names = {s.name for s in spans}

    # One root, the gateway's request span; every other span's parent is in the trace.
    (root,) = [s for s in spans if s.parent_span_id not in by_id]
    assert root.service == "spillway-gateway"
    request_id = root.attributes["spillway.request.id"]
    for s in spans:
        assert s is root or s.parent_span_id in by_id, f"{s.service}/{s.name}"
        assert s.attributes.get("spillway.request.id") == request_id, f"{s.service}/{s.name}"
    usage = bodies[trace_ids.index(victim)]["usage"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert root.attributes["gen_ai.request.max_tokens"] == NEW_TOKENS

    # The scheduler's story of it: queued, admitted with its cached tokens, prefilled,
    # decoded (aggregated: far fewer spans than tokens), preempted by spill, swapped in,
    # retired with its finish reason.
    (request,) = [s for s in spans if s.name == "scheduler.request"]
    assert tuple(request.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert request.attributes["gen_ai.usage.input_tokens"] == PROMPT_TOKENS
    assert {"scheduler.queue", "scheduler.prefill", "scheduler.restore"} <= names
    (admitted,) = [s for s in spans if s.attributes.get("spillway.event") == "admitted"]
    assert admitted.name == "scheduler.admit"
    assert admitted.attributes["spillway.request.cached_tokens"] == 0
    decode = [s for s in spans if s.name == "scheduler.decode"]
    assert 2 <= len(decode) <= 4  # before the preemption, after the swap-in
    assert sum(s.attributes["spillway.decode.tokens"] for s in decode) == NEW_TOKENS - 1
    (retired,) = [s for s in spans if s.name == "scheduler.retire"]
    assert tuple(retired.attributes["gen_ai.response.finish_reasons"]) == ("length",)

    # The spill: its mode, then its bytes on the scheduler, the worker and the store.
    preempt = [s for s in spans if s.name == "scheduler.preempt"]
    assert {s.attributes["spillway.preemption.mode"] for s in preempt} == {"spill"}
    # On a slow machine the pressure may last long enough to spill the victim twice: each
    # spill is followed on its own, and the drops must free what the spills wrote, once.
    spills = [s for s in spans if s.name == "scheduler.spill"]
    assert spills
    for spill in spills:
        assert by_id[spill.parent_span_id].name == "scheduler.preempt"
        spill_bytes = spill.attributes["spillway.kv.bytes"]
        assert spill_bytes > 0 and spill.attributes["spillway.kv.ok"]
        (worker_spill,) = [s for s in spans if s.parent_span_id == spill.span_id]
        assert worker_spill.name == "worker.kv.spill"
        assert worker_spill.attributes["spillway.kv.bytes"] == spill_bytes
        assert worker_spill.attributes["spillway.kv.seconds"] > 0
        (record,) = [s for s in spans if s.parent_span_id == worker_spill.span_id]
        assert (record.service, record.name) == ("spillway-spillstore", "spillstore.record")
        assert record.attributes["spillway.kv.bytes"] == spill_bytes

    # The swap-in: read back on the worker (bytes, time), the spill dropped in the store.
    restore = [s for s in spans if s.name == "scheduler.restore"][-1]
    assert restore.attributes["spillway.kv.bytes"] > 0
    (worker_restore,) = [s for s in spans if s.parent_span_id == restore.span_id]
    assert worker_restore.name == "worker.kv.restore"
    assert worker_restore.attributes["spillway.kv.bytes"] == restore.attributes["spillway.kv.bytes"]
    assert worker_restore.attributes["spillway.kv.seconds"] > 0
    drops = [s for s in spans if s.name == "spillstore.drop"]
    assert len(drops) == len(spills)
    spilled_bytes = sum(s.attributes["spillway.kv.bytes"] for s in spills)
    assert sum(s.attributes["spillway.kv.bytes"] for s in drops) == spilled_bytes
    swapped_in = [s for s in spans if s.attributes.get("spillway.event") == "swapped_in"]
    assert swapped_in and {s.name for s in swapped_in} == {"scheduler.swap_in"}

    # Phases tick by tick in the seeds' order; the swap-in after the preemption.
    phases = sorted(
        (s for s in spans if s.attributes.get("spillway.phase")),
        key=lambda s: (s.attributes["spillway.tick"], s.start_ns, _seed(s)),
    )
    assert {s.attributes["spillway.phase"] for s in phases} >= {
        "admit",
        "step",
        "swap_in",
        "retire",
    }
    by_tick: dict[int, list[str]] = {}
    for s in phases:
        by_tick.setdefault(s.attributes["spillway.tick"], []).append(s.attributes["spillway.phase"])
    for tick, order in by_tick.items():
        assert order == sorted(order, key=SEED_PHASES.index), (tick, order)
    events = [s.attributes.get("spillway.event") for s in phases]
    assert events.index("preempted") < events.index("swapped_in") < events.index("retired")

    # The worker's forward of this request, aggregated per run of decode steps.
    worker_runs = [s for s in spans if s.name == "worker.forward"]
    decode_runs = {s.span_id for s in decode}
    worker_decode = [s for s in worker_runs if s.parent_span_id in decode_runs]
    assert len(worker_decode) >= len(decode)
    assert all(
        by_id[s.parent_span_id].name == "scheduler.prefill"
        for s in worker_runs
        if s not in worker_decode
    )
    # Each token decoded once, unless a step was voided by the preemption and run again.
    decoded = sum(s.attributes["spillway.tokens"] for s in worker_decode)
    assert NEW_TOKENS - 1 <= decoded <= NEW_TOKENS + 1

    # A batched step served both requests: its spans link to each (scheduler and worker).
    def linked_traces(span: ReceivedSpan) -> set[str]:
        return {trace_id for trace_id, _ in span.links}

    steps = [s for s in sink.spans if s.name in ("scheduler.batch", "worker.batch")]
    both = [s for s in steps if {victim, other} <= linked_traces(s)]
    assert {s.name for s in both} == {"scheduler.batch", "worker.batch"}
    for s in both:
        assert s.trace_id not in (victim, other)  # a step belongs to no one request


def _seed(span: ReceivedSpan) -> int:
    return SEED_PHASES.index(span.attributes["spillway.phase"])


def _summary(spans: list[ReceivedSpan]) -> list[str]:
    ids = {s.span_id for s in spans}
    return sorted(
        f"{s.service} {s.name}{' (root)' if s.parent_span_id not in ids else ''}" for s in spans
    )

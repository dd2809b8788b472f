"""The worker registry (heartbeats, expiry, generations), the per-tick delta merge, and
the purity of the core modules."""

from __future__ import annotations

import ast
from pathlib import Path

import spillway.services.scheduler as package
from spillway.services.scheduler.deltas import merge_deltas
from spillway.services.scheduler.registry import WorkerRegistry
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import ErrorInfo, Heartbeat, RequestDelta, SampledLogprobs
from tests.unit.scheduler.harness import worker_info


def test_silent_workers_expire_and_a_heartbeat_registers_an_unknown_worker():
    clock = FakeClock()
    registry = WorkerRegistry(clock, timeout_s=2.0)
    registry.register(worker_info(worker_id="w1"))
    assert registry.heartbeat(Heartbeat(info=worker_info(worker_id="w2")))
    clock.advance(1.5)
    assert not registry.heartbeat(Heartbeat(info=worker_info(worker_id="w2")))
    clock.advance(1.0)
    assert [w.worker_id for w in registry.expire()] == ["w1"]
    assert len(registry) == 1
    assert [w.info.worker_id for w in registry.workers()] == ["w2"]


def test_registering_again_is_a_new_generation_of_the_active_worker():
    registry = WorkerRegistry(FakeClock(), timeout_s=2.0)
    first = registry.register(worker_info(worker_id="w1")).key
    registry.register(worker_info(worker_id="w2"))
    again = registry.register(worker_info(worker_id="w1")).key
    assert first[0] == again[0] and first != again
    assert [w.info.worker_id for w in registry.workers()] == ["w2", "w1"]  # w1 anew


def test_merge_keeps_one_delta_per_request_in_first_seen_order():
    lp = SampledLogprobs(token_id=7, logprob=-1.0)
    error = ErrorInfo(message="boom")
    merged = merge_deltas(
        [
            RequestDelta(request_id="a", token_ids=[7], logprobs=[lp], num_prompt_tokens=3),
            RequestDelta(request_id="b", finish_reason="abort", num_prompt_tokens=2),
            RequestDelta(request_id="a", token_ids=[8], logprobs=[lp]),
            RequestDelta(request_id="a", finish_reason="error", error=error),
        ]
    )
    assert [d.request_id for d in merged] == ["a", "b"]
    a = merged[0]
    assert a.token_ids == [7, 8] and a.logprobs == [lp, lp]
    assert (a.num_prompt_tokens, a.finish_reason, a.error) == (3, "error", error)


def test_the_core_modules_stay_pure():
    shell = {"service.py", "lane.py", "tracing.py"}
    forbidden = {"asyncio", "nats", "redis", "torch", "opentelemetry"}
    folder = Path(package.__file__).parent
    for path in sorted(folder.glob("*.py")):
        if path.name in shell:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"

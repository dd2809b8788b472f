"""A MoE worker's step counters summed by the scheduler and exported by the gateway."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from spillway.services.gateway.metrics import SchedulerStatsCollector
from spillway.services.scheduler.moe_stats import MoEStats
from spillway.shared.protocol import SchedulerStats, StepResult, WorkerLoad


def test_steps_add_up_per_expert_and_exchange():
    stats = MoEStats()
    stats.observe(StepResult(step_id=1))  # a dense worker's step: nothing
    assert stats.expert_tokens == [] and stats.exchange_seconds() is None
    stats.observe(StepResult(step_id=2, expert_tokens=[3, 0, 1, 4]))  # one process
    assert stats.exchange_seconds() is None
    stats.observe(
        StepResult(
            step_id=3, expert_tokens=[1, 1, 0, 0], ep_exchange_bytes=1000, ep_exchange_s=0.002
        )
    )
    assert stats.expert_tokens == [4, 1, 1, 4]
    assert stats.exchange_bytes == 1000
    hist = stats.exchange_seconds()
    assert hist is not None and sum(hist.counts) == 1 and hist.sum == 0.002


def test_gateway_exports_expert_load_and_exchange_per_worker():
    moe = MoEStats()
    moe.observe(
        StepResult(step_id=1, expert_tokens=[2, 5], ep_exchange_bytes=64, ep_exchange_s=0.5)
    )
    load = WorkerLoad(
        worker_id="w1",
        expert_tokens=moe.expert_tokens,
        ep_exchange_bytes=moe.exchange_bytes,
        ep_exchange_seconds=moe.exchange_seconds(),
    )
    collector = SchedulerStatsCollector()
    collector.update(
        {"s1": SchedulerStats(num_workers=1, num_running=0, num_waiting=0, workers=[load])}
    )
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'spillway_moe_expert_tokens_total{expert="1",scheduler="s1",worker="w1"} 5.0' in text
    assert 'spillway_ep_exchange_bytes_total{scheduler="s1",worker="w1"} 64.0' in text
    assert 'spillway_ep_exchange_seconds_count{scheduler="s1",worker="w1"} 1.0' in text
    assert 'spillway_ep_exchange_seconds_bucket{le="0.5",scheduler="s1",worker="w1"} 1.0' in text

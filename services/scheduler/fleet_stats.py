"""What a scheduler says of its workers together: the pooled KV usage and each worker's
load (pure)."""

from __future__ import annotations

from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.pipeline import Pipeline
from spillway.shared.protocol import WorkerLoad


def pooled_kv(cores: list[SchedulerCore]) -> tuple[int, float]:
    """Every worker's KV blocks together, and the fraction of them in use."""
    attached = [c.blocks for c in cores if c.blocks is not None]
    total = sum(b.num_blocks for b in attached)
    used = sum(b.usage * b.num_blocks for b in attached)
    return total, used / total if total else 0.0


def load_of(lane: Pipeline) -> WorkerLoad:
    core = lane.core
    return WorkerLoad(
        worker_id=lane.worker_id,
        num_running=core.num_running,
        num_waiting=core.num_waiting,
        num_live=core.num_live,
        kv_usage=core.kv_usage,
        num_kv_blocks=core.blocks.num_blocks if core.blocks is not None else 0,
        prefix_cache_hit_tokens=core.stats.prefix_hit_tokens,
        migrations=core.stats.migrations,
        num_steps=core.stats.num_steps,
        draining=not lane.accepting,
        expert_tokens=list(core.moe.expert_tokens),
        ep_exchange_bytes=core.moe.exchange_bytes,
        ep_exchange_seconds=core.moe.exchange_seconds(),
    )

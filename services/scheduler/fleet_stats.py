"""What a scheduler says of its workers together: the counters of lanes that ended (so
that totals never go back), the pooled KV usage and each worker's load (pure)."""

from __future__ import annotations

from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.pipeline import Pipeline
from spillway.shared.protocol import WorkerLoad


class EndedLanes:
    """The counters of cores whose worker left, kept in the scheduler's totals."""

    def __init__(self) -> None:
        self.preemptions: dict[str, int] = {}
        self.migrations = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.steps = 0
        self.spill_failures = 0
        self.swap_ins = 0

    def add(self, core: SchedulerCore) -> None:
        for mode, n in core.preemptions.items():
            self.preemptions[mode] = self.preemptions.get(mode, 0) + n
        self.migrations += core.migrations
        self.hit_tokens += core.prefix_hit_tokens
        self.query_tokens += core.prefix_query_tokens
        self.steps += core.num_steps
        self.spill_failures += core.spill_failures
        self.swap_ins += core.swap_ins


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
        prefix_cache_hit_tokens=core.prefix_hit_tokens,
        migrations=core.migrations,
        num_steps=core.num_steps,
        draining=not lane.accepting,
        expert_tokens=list(core.moe.expert_tokens),
        ep_exchange_bytes=core.moe.exchange_bytes,
        ep_exchange_seconds=core.moe.exchange_seconds(),
    )

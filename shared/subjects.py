"""Every NATS subject the system uses, in one place, with the namespace applied.

With namespace "NS" every subject, public and internal, becomes "NS.<subject>", so several
systems share one NATS without cross-talk (CONTRACT section 1, `--namespace`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Public (CONTRACT section 3).
GENERATE = "llm.generate"
ABORT = "llm.abort"
MODELS = "llm.models"
GATEWAY_QUEUE = "gateway"
SCHEDULER_QUEUE = "scheduler"  # sched.submit and worker.register reach one scheduler each

# Internal.
SCHED_SUBMIT = "sched.submit"  # request/reply: SubmitRequest -> SubmitReply
SCHED_ABORT = "sched.abort"  # publish: AbortRequest
SCHED_STATS = "sched.stats"  # request/reply: StatsRequest -> SchedulerStats
SCHED_HEARTBEAT = "sched.heartbeat"  # publish: SchedulerLease, watched by gateways and workers
GATEWAY_HEARTBEAT = "gateway.heartbeat"  # publish: GatewayBeat, watched by schedulers
WORKER_REGISTER = "worker.register"  # request/reply: WorkerInfo -> RegisterReply (queue)
WORKER_HEARTBEAT = "worker.heartbeat"  # publish: Heartbeat
# publish by a (re)started scheduler: workers without a live scheduler register now
WORKER_DISCOVER = "worker.discover"
SPILL_STATS = "spill.stats"  # request/reply: StatsRequest -> SpillStats
SPILL_RECORDED = "spill.recorded"  # publish, worker -> spill store: SpillRecord
SPILL_DROP = "spill.drop"  # publish, scheduler -> spill store: SpillDrop
SPILL_PREFIX_LOOKUP = "spill.prefix_lookup"  # request/reply: PrefixLookup -> PrefixLookupReply


def is_token(name: str, max_len: int = 64) -> bool:
    """Whether `name` can be one token of a subject (service ids are): 1 to max_len ASCII
    letters, digits, '-' or '_'. Ids heard from the bus are checked before use."""
    allowed = all(c.isascii() and (c.isalnum() or c in "-_") for c in name)
    return 0 < len(name) <= max_len and allowed


def worker_step(worker_id: str) -> str:
    """request/reply: StepPlan -> StepResult."""
    return f"worker.{worker_id}.step"


def sched_submit(scheduler_id: str) -> str:
    """request/reply: SubmitRequest -> SubmitReply, to one chosen scheduler."""
    return f"sched.{scheduler_id}.submit"


def sched_stats(scheduler_id: str) -> str:
    """request/reply: StatsRequest -> SchedulerStats, from one scheduler (a gateway's
    /metrics asks every live one)."""
    return f"sched.{scheduler_id}.stats"


def sched_register(scheduler_id: str) -> str:
    """request/reply: WorkerInfo -> RegisterReply, to one chosen scheduler."""
    return f"sched.{scheduler_id}.register"


def sched_tick(scheduler_id: str) -> str:
    """publish, scheduler -> anyone allowed (`spillway top`): one TickReport per tick."""
    return f"sched.{scheduler_id}.tick"


def gateway_deltas(gateway_id: str) -> str:
    """publish, scheduler -> gateway: one DeltaBatch per tick per gateway."""
    return f"gateway.{gateway_id}.deltas"


@dataclass(frozen=True)
class Namespace:
    """Applies a namespace prefix to subjects ("." separated) and Redis keys (":" separated)."""

    name: str = ""

    def subject(self, subject: str) -> str:
        return f"{self.name}.{subject}" if self.name else subject

    def redis_key(self, key: str) -> str:
        return f"{self.name}:{key}" if self.name else key

"""What a scheduler says of itself and its workers together (pure): the lease it
publishes and the reply to sched.stats, from its live lanes' counts and KV pooled, the
counters of lanes that ended (so that totals never go back), the step timings and tick
phases it measured, and the spill store's last report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.lane import Lane
from spillway.services.scheduler.phase_stats import PhaseStats
from spillway.services.scheduler.preemption import RecentSpillFailures, spill_reason, spill_status
from spillway.services.scheduler.speculation import merged as merged_speculation
from spillway.services.scheduler.stats import CoreStats
from spillway.services.scheduler.step_timing import StepTimings
from spillway.shared.clock import Clock
from spillway.shared.protocol import SchedulerLease, SchedulerStats, SpillStats
from spillway.shared.spill_keys import spill_name

# A lease lists its spills up to this many (beyond, the store relies on the drops alone).
MAX_LISTED_SPILLS = 4096


@dataclass(frozen=True)
class Pooled:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preempted: int
    num_kv_blocks: int
    num_cached_blocks: int
    kv_usage: float  # of every worker's blocks together
    max_model_len: int  # the longest any worker takes
    totals: CoreStats  # live and ended lanes' counters
    last_spill_error: str  # a live worker's words for its last failed spill


def pooled(lanes: Iterable[Lane], ended: CoreStats) -> Pooled:
    cores = [lane.core for lane in lanes]
    attached = [c.blocks for c in cores if c.blocks is not None]
    num_blocks = sum(b.num_blocks for b in attached)
    used = sum(b.usage * b.num_blocks for b in attached)
    return Pooled(
        num_running=sum(c.num_running for c in cores),
        num_waiting=sum(c.num_waiting for c in cores),
        num_swapped=sum(c.num_swapped for c in cores),
        num_preempted=sum(c.num_preempted for c in cores),
        num_kv_blocks=num_blocks,
        num_cached_blocks=sum(b.num_cached_blocks for b in attached),
        kv_usage=used / num_blocks if num_blocks else 0.0,
        max_model_len=max((c.worker.max_model_len for c in cores if c.worker), default=0),
        totals=CoreStats.total([ended, *(c.stats for c in cores)]),
        last_spill_error=next(
            (c.stats.last_spill_error for c in cores if c.stats.last_spill_error), ""
        ),
    )


def held_spills(lanes: Iterable[Lane]) -> list[str] | None:
    names = [spill_name(r, s) for lane in lanes for r, s in lane.held_spills()]
    return names if len(names) <= MAX_LISTED_SPILLS else None


@dataclass(eq=False)
class FleetStats:
    clock: Clock
    config: SchedulerConfig
    scheduler_id: str
    boot_id: str
    lease_interval_s: float
    timings: StepTimings = field(default_factory=StepTimings)  # every lane's steps
    phases: PhaseStats = field(default_factory=PhaseStats)  # tick phases timed in-process
    # The counters of cores whose worker left.
    ended: CoreStats = field(default_factory=CoreStats.empty)
    spill_store: SpillStats | None = None  # its last report
    _recent_spill_failures: RecentSpillFailures = field(default_factory=RecentSpillFailures)

    def lease(self, lanes: list[Lane], worker_ids: list[str], draining: bool) -> SchedulerLease:
        pool = pooled(lanes, self.ended)
        workers_draining = bool(lanes) and not any(lane.accepting for lane in lanes)
        now = self.clock.now()
        self._recent_spill_failures.observe(pool.totals.spill_failures, pool.last_spill_error, now)
        failing = self._recent_spill_failures.failing(now)
        mode = self.config.preemption_mode
        return SchedulerLease(
            scheduler_id=self.scheduler_id,
            interval_s=self.lease_interval_s,
            boot_id=self.boot_id,
            worker_id=lanes[0].worker_id if lanes else None,
            worker_ids=worker_ids,
            num_running=pool.num_running,
            num_waiting=pool.num_waiting,
            kv_usage=pool.kv_usage,
            draining=draining or workers_draining,
            spill_status=spill_status(mode, self.spill_store, failing),
            spill_reason=spill_reason(mode, self.spill_store, failing),
            preemption_mode=mode,
            spills=held_spills(lanes),
        )

    def stats(self, lanes: list[Lane], num_workers: int) -> SchedulerStats:
        pool = pooled(lanes, self.ended)
        total = pool.totals
        spec, spec_phases = merged_speculation([la.spec for la in lanes if la.spec is not None])
        timings = self.timings
        return SchedulerStats(
            num_workers=num_workers,
            num_running=pool.num_running,
            num_waiting=pool.num_waiting,
            num_swapped=pool.num_swapped,
            num_preempted=pool.num_preempted,
            kv_usage=pool.kv_usage,
            num_kv_blocks=pool.num_kv_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            max_model_len=pool.max_model_len,
            preemptions=total.preemptions,
            spill_failures=total.spill_failures,
            swap_ins=total.swap_ins,
            migrations=total.migrations,
            prefix_cache_hit_tokens=total.prefix_hit_tokens,
            prefix_cache_query_tokens=total.prefix_query_tokens,
            num_steps=total.num_steps,
            step_bookkeeping_s=timings.bookkeeping_s.median(),
            step_bus_s=timings.bus_s.median(),
            step_forward_s=timings.forward_s.median(),
            step_overhead_s=timings.overhead_s.median(),
            step_prepare_s=timings.prepare_s.median(),
            step_sample_s=timings.sample_s.median(),
            step_kv_io_share=timings.kv_io_share,
            preemption_mode=self.config.preemption_mode,
            run_ahead=self.config.run_ahead,
            phases=self.phases.snapshot(),
            spill_store=self.spill_store,
            scheduler_id=self.scheduler_id,
            worker_id=lanes[0].worker_id if lanes else None,
            workers=[lane.load() for lane in lanes],
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=spec.accepted_per_position,
            spec_phases=spec_phases,
        )

    def spill_room(self) -> tuple[bool, int]:
        """Whether the spill store is up, and its free bytes, as it last said."""
        stats = self.spill_store
        if stats is None:
            return False, 0
        return stats.redis_ok, max(0, stats.capacity_bytes - stats.used_bytes)

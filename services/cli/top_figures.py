"""The figures `spillway top` shows, from the schedulers' tick reports: per scheduler and
worker the latest counts (running, waiting, swapped, KV use) and, over a sliding window,
spills, swap-ins, ticks and tokens per second and each phase's mean time per tick.

Pure: reports come in through `add`, time from the injected clock (when each report
arrived; the reports' own `time` is another machine's clock). A rate over the window is
what arrived after the window's first report divided by the time since it, so a lane
that stops ticking decays to zero instead of keeping its last rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from spillway.shared.clock import Clock
from spillway.shared.protocol import TICK_PHASES, TickReport

DEFAULT_WINDOW_S = 5.0
# A lane with no report for this long is shown as stale (its scheduler or worker may be
# gone, or it idles: an idle lane ticks only when woken).
DEFAULT_STALE_S = 10.0


@dataclass(frozen=True)
class _Sample:
    at: float
    spills: int
    swap_ins: int
    preemptions: int
    sampled: int
    tokens: int
    phase_s: tuple[float, ...]  # TICK_PHASES order


@dataclass
class LaneFigures:
    """One row of the view: one worker driven by one scheduler."""

    scheduler: str
    worker: str
    tick: int = 0
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_cache_usage: float = 0.0
    ticks_per_s: float = 0.0
    spills_per_s: float = 0.0
    swap_ins_per_s: float = 0.0
    preemptions_per_s: float = 0.0
    tokens_per_s: float = 0.0  # generated
    computed_tokens_per_s: float = 0.0  # prefill and decode
    # Mean seconds per tick of each phase over the window (TICK_PHASES keys).
    phase_s: dict[str, float] = field(default_factory=dict)
    age_s: float = 0.0  # since its last report
    stale: bool = False


@dataclass
class _Lane:
    latest: TickReport
    last_at: float
    samples: deque[_Sample] = field(default_factory=deque)


class TopFigures:
    def __init__(
        self, clock: Clock, window_s: float = DEFAULT_WINDOW_S, stale_s: float = DEFAULT_STALE_S
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.clock = clock
        self.window_s = window_s
        self.stale_s = stale_s
        self._lanes: dict[tuple[str, str], _Lane] = {}
        self.num_reports = 0

    def add(self, report: TickReport) -> None:
        now = self.clock.now()
        phases = {p.name: p for p in report.phases}
        sample = _Sample(
            at=now,
            spills=sum(1 for p in report.phases for x in p.preempted if x.mode == "spill"),
            swap_ins=sum(len(p.swapped_in) for p in report.phases),
            preemptions=sum(len(p.preempted) for p in report.phases),
            sampled=sum(p.sampled for p in report.phases),
            tokens=sum(p.tokens for p in report.phases),
            phase_s=tuple(phases[n].seconds if n in phases else 0.0 for n in TICK_PHASES),
        )
        key = (report.scheduler, report.worker)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(report, now)
        # One publisher's messages arrive in order: the last one is the latest.
        lane.latest, lane.last_at = report, now
        lane.samples.append(sample)
        self.num_reports += 1

    def figures(self) -> list[LaneFigures]:
        """Every lane heard from, by scheduler then worker."""
        now = self.clock.now()
        out = []
        for key in sorted(self._lanes):
            lane = self._lanes[key]
            self._prune(lane, now)
            out.append(self._figures(lane, now))
        return out

    def forget_stale(self, older_than_s: float) -> None:
        """Drops lanes silent for longer than `older_than_s` (gone schedulers)."""
        now = self.clock.now()
        for key in [k for k, lane in self._lanes.items() if now - lane.last_at > older_than_s]:
            del self._lanes[key]

    def _prune(self, lane: _Lane, now: float) -> None:
        while lane.samples and lane.samples[0].at < now - self.window_s:
            lane.samples.popleft()

    def _figures(self, lane: _Lane, now: float) -> LaneFigures:
        r = lane.latest
        f = LaneFigures(
            scheduler=r.scheduler,
            worker=r.worker,
            tick=r.tick,
            running=r.running,
            waiting=r.waiting,
            swapped=r.swapped,
            kv_cache_usage=r.kv_cache_usage,
            age_s=now - lane.last_at,
            stale=now - lane.last_at > self.stale_s,
        )
        samples = list(lane.samples)
        if samples:
            f.phase_s = {
                name: sum(s.phase_s[i] for s in samples) / len(samples)
                for i, name in enumerate(TICK_PHASES)
            }
        # Rates: what came after the window's first report, over the time since it.
        span = now - samples[0].at if samples else 0.0
        if span > 0:
            after = samples[1:]
            f.ticks_per_s = len(after) / span
            f.spills_per_s = sum(s.spills for s in after) / span
            f.swap_ins_per_s = sum(s.swap_ins for s in after) / span
            f.preemptions_per_s = sum(s.preemptions for s in after) / span
            f.tokens_per_s = sum(s.sampled for s in after) / span
            f.computed_tokens_per_s = sum(s.tokens for s in after) / span
        return f

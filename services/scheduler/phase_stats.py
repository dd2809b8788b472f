"""Tick phases timed in-process: one histogram per phase, exported through sched.stats so
/metrics shows them whether or not traces are exported."""

from __future__ import annotations

from bisect import bisect_left

from spillway.shared.protocol import PhaseHistogram

# Phases range from microseconds (a retire) to seconds (a drain behind a long step).
PHASE_BUCKETS = (
    1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


class PhaseStats:
    def __init__(self, bounds: tuple[float, ...] = PHASE_BUCKETS) -> None:
        self.bounds = bounds
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}

    def observe(self, phase: str, seconds: float) -> None:
        counts = self._counts.setdefault(phase, [0] * (len(self.bounds) + 1))
        counts[bisect_left(self.bounds, seconds)] += 1
        self._sums[phase] = self._sums.get(phase, 0.0) + seconds

    def snapshot(self) -> dict[str, PhaseHistogram]:
        return {
            phase: PhaseHistogram(bounds=list(self.bounds), counts=list(c), sum=self._sums[phase])
            for phase, c in self._counts.items()
        }

"""Where a step's time goes, as rolling medians: the scheduler's bookkeeping, the bus, and
the worker's forward pass."""

from __future__ import annotations

import statistics
from collections import deque


class RollingMedian:
    def __init__(self, window: int = 256) -> None:
        self._values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._values.append(value)

    def median(self) -> float | None:
        return statistics.median(self._values) if self._values else None


class StepTimings:
    def __init__(self, window: int = 256) -> None:
        self.bookkeeping_s = RollingMedian(window)
        self.bus_s = RollingMedian(window)
        self.forward_s = RollingMedian(window)
        # Between two results of back-to-back steps, the time the worker was not
        # computing (bus, codec, scheduler bookkeeping): what run-ahead hides.
        self.overhead_s = RollingMedian(window)
        # The worker's phases as it reports them (StepResult.prepare_s, sample_s).
        self.prepare_s = RollingMedian(window)
        self.sample_s = RollingMedian(window)

        # Totals over every step: the share of the steps' time the workers spent moving
        # KV to and from the spill store (spills, swap-ins, prefix-tier reads and writes).
        self.kv_io_total_s = 0.0
        self.step_total_s = 0.0

    @property
    def kv_io_share(self) -> float | None:
        return self.kv_io_total_s / self.step_total_s if self.step_total_s else None

    def add(
        self,
        bookkeeping_s: float,
        round_trip_s: float,
        forward_s: float,
        kv_io_s: float = 0.0,
        prepare_s: float | None = None,
        sample_s: float | None = None,
    ) -> None:
        if prepare_s is not None:
            self.prepare_s.add(prepare_s)
        if sample_s is not None:
            self.sample_s.add(sample_s)
        self.kv_io_total_s += kv_io_s
        self.step_total_s += bookkeeping_s + round_trip_s
        self.bookkeeping_s.add(bookkeeping_s)
        self.bus_s.add(max(0.0, round_trip_s - forward_s - kv_io_s))
        self.forward_s.add(forward_s)

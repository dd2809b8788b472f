"""Which way a few-row decode step's threads run: each projection in its own OpenMP region
(the others asleep in between, as the worker's passive wait policy has them), or the whole
step in one region whose threads wait for each other spinning (`decode_layers.c`).

On a quiet machine the one region is much faster: measured on a 2-core EPYC (AVX-512 VNNI),
a SmolLM2-135M `--quantize int8` step at one row took 6.4 ms against 10.4 (per projection,
the second thread woke for the lm_head alone: waking it for every projection cost more than
it saved). On a shared machine a thread of the region is taken off its core now and then;
with fixed shares the others waited for it (the same step then took 30-150 ms against
10-28), and since the region's threads take each projection's rows in chunks and compute a
chunk another has not finished (`decode_layers.c`) it loses much less, but what is fastest
still depends on the machine. So the choice is made by measuring, per row count: both
ways are timed at the start, the faster is kept, and the other is tried again now and then
(after `probe_every` steps, twice as long after each try that lost, up to `longest`), so
that a machine that becomes busy, or quiet again, changes the choice while a try of the
slower way costs little; the other way is taken only when it is faster by a margin (5%),
so that two ways within noise of each other do not swap every few steps. A pure core: the
caller times the steps and reports them.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Rows:
    """What is known of steps of one row count."""

    times: dict[bool, deque[int]]
    interval: int  # steps from one try of the way not chosen to the next
    until_probe: int
    probing: int = 0  # steps left of a try of the way not chosen
    choice: bool | None = None  # the way taken (None: still timing both at the start)


@dataclass
class StepThreads:
    """Chooses per step whether to run it together (one region) or per projection."""

    window: int = 8  # the latest timings of each way that the choice reads (medians)
    probe_every: int = 128  # steps between two tries of the way not chosen
    longest: int = 4096  # ... at most, however often the tries lost
    probe_steps: int = 3  # steps a try lasts
    # The other way is taken only when its median is this much below the chosen one's:
    # two ways within noise of each other (a shared machine's) would otherwise swap every
    # few steps.
    margin: float = 0.05
    _rows: dict[int, _Rows] = field(default_factory=dict)

    def together(self, rows: int) -> bool:
        state = self._state(rows)
        for way in (True, False):  # each way timed a few times before any choice
            if len(state.times[way]) < self.probe_steps:
                return way
        assert state.choice is not None  # (a try clears its way's timings: the loop runs it)
        return state.choice

    def record(self, rows: int, together: bool, nanoseconds: int) -> None:
        """A step of this many rows ran that way in this long."""
        state = self._state(rows)
        state.times[together].append(nanoseconds)
        timed = all(len(t) >= self.probe_steps for t in state.times.values())
        if state.probing:
            state.probing -= 1
            if not state.probing:  # the try is over: did the way not chosen win?
                self._decide(state)
                lost = state.choice != together
                state.interval = min(2 * state.interval, self.longest) if lost else self.probe_every
                state.until_probe = state.interval
            return
        if not timed:  # the start's steps count towards no try
            return
        starting = state.choice is None
        self._decide(state)
        if starting:
            return
        state.until_probe -= 1
        if state.until_probe <= 0:
            assert state.choice is not None
            state.probing = self.probe_steps
            state.times[not state.choice].clear()  # the try is judged on its own

    def chosen(self, rows: int) -> bool | None:
        """The way steps of this many rows take now (None: still timing both)."""
        state = self._rows.get(rows)
        return None if state is None else state.choice

    def medians(self, rows: int) -> str:
        """The latest timings' medians of both ways, for a log line."""
        state = self._state(rows)
        ms = {
            way: statistics.median(t) / 1e6 if t else float("nan") for way, t in state.times.items()
        }
        return f"{ms[True]:.2f} ms in one region, {ms[False]:.2f} ms per projection"

    def _decide(self, state: _Rows) -> None:
        median = {way: statistics.median(t) for way, t in state.times.items()}
        if state.choice is None:
            state.choice = median[True] <= median[False]
        elif median[not state.choice] < (1 - self.margin) * median[state.choice]:
            state.choice = not state.choice

    def _state(self, rows: int) -> _Rows:
        state = self._rows.get(rows)
        if state is None:
            times = {way: deque[int](maxlen=self.window) for way in (True, False)}
            state = self._rows[rows] = _Rows(times, self.probe_every, self.probe_every)
        return state

"""What one tick of a core did, phase by phase: the data of its TickReport.

The core writes into its TickLog as its phases run (swept, retired, swapped in, resumed,
admitted, preempted; the seconds of each phase it times); the lane adds the step and
drain times, which only it sees; at the end of the tick the core turns the log into a
TickReport and starts a new one. Everything here is plain bookkeeping on the core's
thread: a few list appends per event, one report per tick.
"""

from __future__ import annotations

from spillway.shared.protocol import (
    TICK_PHASES,
    AdmittedRequest,
    FinishReason,
    PreemptedRequest,
    RetiredRequest,
    SwappedInRequest,
    TickPhase,
    TickPhaseName,
    TickReport,
)


class TickLog:
    def __init__(self) -> None:
        self.num_ticks = 0
        self._phases: dict[str, TickPhase] = {}
        # The phase a preemption belongs to: admission (making room for the step's rows)
        # unless a step's result is being applied (a worker out of memory).
        self.current: TickPhaseName = "admit"
        self._start()

    def _start(self) -> None:
        self._phases = {name: TickPhase(name=name) for name in TICK_PHASES}
        self.current = "admit"

    def timed(self, name: TickPhaseName, seconds: float) -> None:
        self._phases[name].seconds += seconds

    def swept(self, request_id: str) -> None:
        self._phases["deadline_sweep"].swept.append(request_id)

    def retired(self, request_id: str, finish_reason: FinishReason) -> None:
        self._phases["retire"].retired.append(
            RetiredRequest(request_id=request_id, finish_reason=finish_reason)
        )

    def swapped_in(self, request_id: str, num_bytes: int) -> None:
        self._phases["swap_in"].swapped_in.append(
            SwappedInRequest(request_id=request_id, bytes=num_bytes)
        )

    def resumed(self, request_id: str) -> None:
        self._phases["resume"].resumed.append(request_id)

    def admitted(self, request_id: str, cached_tokens: int) -> None:
        self._phases["admit"].admitted.append(
            AdmittedRequest(request_id=request_id, cached_tokens=cached_tokens)
        )

    def preempted(self, request_id: str, mode: str, num_bytes: int) -> None:
        self._phases[self.current].preempted.append(
            PreemptedRequest(request_id=request_id, mode=mode, bytes=num_bytes)  # type: ignore[arg-type]
        )

    def stepped(self, rows: int, tokens: int, sampled: int) -> None:
        step = self._phases["step"]
        step.rows += rows
        step.tokens += tokens
        step.sampled += sampled

    def take(
        self,
        scheduler: str,
        worker: str,
        time: float,
        running: int,
        waiting: int,
        swapped: int,
        kv_cache_usage: float,
    ) -> TickReport:
        """The tick's report (its phases in TICK_PHASES order); the next tick starts."""
        self.num_ticks += 1
        report = TickReport(
            scheduler=scheduler,
            worker=worker,
            tick=self.num_ticks,
            time=time,
            phases=[self._phases[name] for name in TICK_PHASES],
            running=running,
            waiting=waiting,
            swapped=swapped,
            kv_cache_usage=kv_cache_usage,
        )
        self._start()
        return report

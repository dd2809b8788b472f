"""A MoE worker's per-step counters as its step results report them, summed for /metrics:
routed (token, expert) pairs per expert (load balance) and, with expert parallel, the
bytes and time of the experts' exchange between the worker's ranks (pure: no I/O)."""

from __future__ import annotations

from spillway.services.scheduler.phase_stats import PhaseStats
from spillway.shared.protocol import PhaseHistogram, StepResult

# An exchange ranges from tens of microseconds (a decode step on one machine) to seconds.
EXCHANGE_BUCKETS = (
    1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


class MoEStats:
    def __init__(self) -> None:
        self.expert_tokens: list[int] = []
        self.exchange_bytes = 0
        self._exchange = PhaseStats(EXCHANGE_BUCKETS)

    def observe(self, result: StepResult) -> None:
        if not result.expert_tokens:
            return  # a dense model, or a step that ran no forward
        if len(self.expert_tokens) < len(result.expert_tokens):
            self.expert_tokens += [0] * (len(result.expert_tokens) - len(self.expert_tokens))
        for e, n in enumerate(result.expert_tokens):
            self.expert_tokens[e] += n
        if result.ep_exchange_bytes or result.ep_exchange_s:
            self.exchange_bytes += result.ep_exchange_bytes
            self._exchange.observe("exchange", result.ep_exchange_s)

    def exchange_seconds(self) -> PhaseHistogram | None:
        return self._exchange.snapshot().get("exchange")

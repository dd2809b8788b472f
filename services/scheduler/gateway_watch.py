"""Which gateways holding requests here have died (pure: clock injected).

Every gateway publishes a `GatewayBeat` on gateway.heartbeat. A gateway heard once and
then silent for longer than the timeout has died (SIGKILL, a lost machine): nobody will
read its requests' output, so the scheduler aborts them at once, freeing their KV and
batch rows, instead of generating to their end. A gateway never heard (one that does
not beat) is never declared dead. After our own silence (our connection was down, our
process stalled) everyone gets a fresh timeout: it says nothing about them.
"""

from __future__ import annotations

from collections.abc import Iterable

from spillway.shared.clock import Clock


class GatewayWatch:
    def __init__(self, clock: Clock, timeout_s: float) -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        self._heard: dict[str, float] = {}

    def heard(self, gateway_id: str) -> None:
        self._heard[gateway_id] = self.clock.now()

    def renew_all(self) -> None:
        now = self.clock.now()
        for gateway_id in self._heard:
            self._heard[gateway_id] = now

    def dead(self, holding: Iterable[str]) -> list[str]:
        """Of the gateways in `holding` (those with requests here), the ones heard and then
        silent past the timeout; they are forgotten (a beat brings one back)."""
        now = self.clock.now()
        gone = sorted(
            {
                gateway_id
                for gateway_id in holding
                if gateway_id in self._heard and now - self._heard[gateway_id] > self.timeout_s
            }
        )
        for gateway_id in gone:
            del self._heard[gateway_id]
        return gone

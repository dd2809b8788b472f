"""Which gateways holding requests here are suspected, and which have died (pure: clock
injected).

Every gateway publishes a `GatewayBeat` on gateway.heartbeat, and every submit it sends
says the same. A gateway heard once and then silent for longer than the timeout is
*suspected*: its event loop may only be stalled (a long garbage collection, a slow
tokenizer call, a busy host), and a stalled gateway reads its streams' deltas from its
socket once it runs again, so its requests keep running. Only one silent past the grace
time has died (SIGKILL, a lost machine): nobody will read its requests' output, so the
scheduler aborts them, freeing their KV and batch rows, instead of generating to their
end. Requests' own deadlines bound them meanwhile as always. A gateway never heard (one
that does not beat) is never declared dead. After our own silence (our connection was
down, our process stalled) everyone gets a fresh start: it says nothing about them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from spillway.shared.clock import Clock


@dataclass
class GatewayNews:
    """What one check found: gateways newly suspected, back from suspicion, and dead."""

    suspected: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)


class GatewayWatch:
    def __init__(self, clock: Clock, timeout_s: float, grace_s: float) -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        # Never shorter than the timeout: a gateway is suspected before it is dead.
        self.grace_s = max(grace_s, timeout_s)
        self._heard: dict[str, float] = {}
        self._suspected: set[str] = set()
        self._back: set[str] = set()

    def heard(self, gateway_id: str) -> None:
        self._heard[gateway_id] = self.clock.now()
        if gateway_id in self._suspected:
            self._suspected.discard(gateway_id)
            self._back.add(gateway_id)

    def renew_all(self) -> None:
        now = self.clock.now()
        for gateway_id in self._heard:
            self._heard[gateway_id] = now

    @property
    def suspected(self) -> frozenset[str]:
        return frozenset(self._suspected)

    def check(self, holding: Iterable[str]) -> GatewayNews:
        """Of the gateways in `holding` (those with requests here): the ones newly silent
        past the timeout, the suspected ones heard again, and the ones silent past the
        grace (forgotten: a beat brings one back)."""
        now = self.clock.now()
        news = GatewayNews(recovered=sorted(self._back))
        self._back.clear()
        for gateway_id in sorted(set(holding)):
            last = self._heard.get(gateway_id)
            if last is None:
                continue
            silent = now - last
            if silent > self.grace_s:
                news.dead.append(gateway_id)
                del self._heard[gateway_id]
                self._suspected.discard(gateway_id)
            elif silent > self.timeout_s and gateway_id not in self._suspected:
                self._suspected.add(gateway_id)
                news.suspected.append(gateway_id)
        return news

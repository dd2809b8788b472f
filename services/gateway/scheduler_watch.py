"""The gateway's view of the schedulers: their leases on sched.heartbeat, and what to do
when one goes quiet.

    pick(prompt)           where a new request goes: among the live schedulers that drive
                           a worker and are not draining, the one that took a prompt
                           sharing the longest prefix with this one, unless it is much
                           busier than the least busy (affinity.py); else the least busy;
                           loads count what we sent since each lease (recent_sends.py);
                           the choice is remembered for the prompt's prefixes at once
    note(id, prompt)       a scheduler took one of our requests (its lease may not have
                           reached us yet: it is watched from now on all the same)
    on_gone(id, reason)    called once when a scheduler holding our requests may have
                           lost them for us:
        LOST               its lease lapsed (killed, hung, cut off): nothing more will
                           come from it
        RESTARTED          it came back as a new process under the same id: it lives,
                           but knows none of our requests
        INTERRUPTED        our own connection to NATS was down, and its first lease since
                           has arrived: it lives, but news it sent meanwhile never reached
                           us (core NATS keeps nothing for an absent subscriber)

While our own connection is down, or right after our own process stalled, nothing
lapses: the silence is ours, not theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Literal

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from spillway.services.gateway.affinity import PrefixAffinity
from spillway.services.gateway.recent_sends import RecentSends
from spillway.shared.bus import Bus
from spillway.shared.clock import Clock
from spillway.shared.leases import LeaseBook, StallGuard
from spillway.shared.protocol import SchedulerLease
from spillway.shared.subjects import SCHED_HEARTBEAT

log = logging.getLogger(__name__)

GoneReason = Literal["lost", "restarted", "interrupted"]
CHECK_INTERVAL_S = 0.25


class SchedulerWatch:
    def __init__(
        self,
        bus: Bus,
        clock: Clock,
        timeout_s: float,
        on_gone: Callable[[str, GoneReason], None],
    ) -> None:
        self.bus = bus
        self.book = LeaseBook(clock, timeout_s)
        self.affinity = PrefixAffinity(rng=self.book.rng)
        self.recent = RecentSends()
        self._on_gone = on_gone
        self._watched: set[str] = set()  # schedulers that hold (or held) our requests
        self._unconfirmed: set[str] = set()  # watched, not heard since our reconnect
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(SCHED_HEARTBEAT, SchedulerLease, self._on_lease)
        self.bus.events.reconnected.append(self._on_reconnected)
        self._task = asyncio.create_task(self._check_forever(), name="gateway-scheduler-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    # --- queries -----------------------------------------------------------------------

    def pick(self, exclude: frozenset[str] = frozenset(), prompt: Sequence[int] = ()) -> str | None:
        # Among the schedulers the watch has not found gone, not those heard within the
        # timeout: after our own stall (a loaded machine) their leases wait unread in our
        # queue, and a request handled first would find none live, go to whichever the
        # queue group picks and move its prefix's home there. The watch's check forgets
        # a silent scheduler within CHECK_INTERVAL_S of its timeout, unless we stalled.
        leases = self.recent.adjusted(self.book.ready_for_request(exclude, by_age=False))
        lease = self.affinity.choose(prompt, leases)
        if lease is None:
            return None
        self.recent.sent(lease.scheduler_id)
        # Remembered now, not when the scheduler's reply comes: a prompt sharing this
        # prefix picked before that reply (a burst, or a slow reply on a loaded machine)
        # goes to the same scheduler rather than by load alone. The reply's note() then
        # records the one that really took it (another, should the chosen one refuse).
        self.affinity.record(prompt, lease.scheduler_id)
        return lease.scheduler_id

    def live(self) -> list[SchedulerLease]:
        """The schedulers heard within the timeout (none while we cannot reach NATS)."""
        return self.book.live() if self.bus.is_connected else []

    def note(self, scheduler_id: str, prompt: Sequence[int] = ()) -> None:
        if scheduler_id:
            self.affinity.record(prompt, scheduler_id)
        if scheduler_id and scheduler_id not in self._watched:
            self._watched.add(scheduler_id)
            self.book.expect(scheduler_id)

    # --- events ------------------------------------------------------------------------

    async def _on_lease(self, lease: SchedulerLease, ctx: Context, msg: Msg) -> None:
        sid = lease.scheduler_id
        previous = self.book.get(sid)
        self.book.observe(lease)
        self.recent.lease_heard(sid)
        if previous is not None and previous.boot_id != lease.boot_id and sid in self._watched:
            self._unconfirmed.discard(sid)
            self._gone(sid, "restarted")  # our requests died with the old process
            return
        if lease.scheduler_id in self._unconfirmed:
            self._unconfirmed.discard(lease.scheduler_id)
            self._gone(lease.scheduler_id, "interrupted")

    def _on_reconnected(self) -> None:
        self.book.renew_all()
        self._unconfirmed = set(self._watched)

    async def _check_forever(self) -> None:
        guard = StallGuard(self.book.clock, CHECK_INTERVAL_S)
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            if guard.stalled():
                self.book.renew_all()  # leases may wait unread in our own queue
                continue
            if not self.bus.is_connected:
                continue
            for scheduler_id in self.book.lapse():
                self._unconfirmed.discard(scheduler_id)
                if scheduler_id in self._watched:
                    self._watched.discard(scheduler_id)
                    self._gone(scheduler_id, "lost")

    def _gone(self, scheduler_id: str, reason: GoneReason) -> None:
        if reason != "interrupted":
            self.affinity.forget(scheduler_id)
            self.recent.forget(scheduler_id)  # its prefix cache went with it
        try:
            self._on_gone(scheduler_id, reason)
        except Exception:  # the watch must outlive any bug in a listener
            log.exception("handling scheduler %s (%s) failed", scheduler_id, reason)

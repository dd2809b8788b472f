"""Prefix affinity: which scheduler to send a prompt to so that its prefix cache is hit.

A scheduler (with its worker) keeps the KV of the prompts it served in its prefix cache,
so a prompt that shares a long prefix with one served before runs fastest where that one
ran. The gateway remembers, for windows of a prompt's leading tokens (hashes chained
window by window, as the scheduler's prefix cache keys its blocks), the scheduler it was
last sent to (recorded when chosen, then as the scheduler's reply names it), and sends a
new prompt to the one holding its longest remembered prefix, unless that scheduler is
busier than the least busy by more than `slack` requests (then load wins: a hot prefix
must not pile every request onto one worker). Prompts with no
remembered prefix go to the least busy.

Pure: the leases are handed in (each with its load), the choice among equals is the
injected random generator's.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from spillway.shared.leases import least, load_of
from spillway.shared.protocol import SchedulerLease

WINDOW_TOKENS = 32  # the granularity of a remembered prefix
MAX_WINDOWS = 64  # prefixes longer than 2,048 tokens are told apart by their first 2,048
CAPACITY = 8192  # windows remembered, least recently used forgotten first
SLACK = 8  # requests: how much busier the affine scheduler may be than the least busy


class PrefixAffinity:
    def __init__(
        self,
        window: int = WINDOW_TOKENS,
        max_windows: int = MAX_WINDOWS,
        capacity: int = CAPACITY,
        slack: int = SLACK,
        rng: random.Random | None = None,
    ) -> None:
        self.window = window
        self.max_windows = max_windows
        self.capacity = capacity
        self.slack = slack
        self.rng = rng or random.Random()
        self._owner: OrderedDict[int, str] = OrderedDict()  # window hash -> scheduler id
        self.hits = 0  # choices made by a remembered prefix

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the prompt's full windows (at least one token left over: a
        prompt's last token is always computed, so it is never part of a cache hit)."""
        out: list[int] = []
        h = 0
        full = min((len(token_ids) - 1) // self.window, self.max_windows)
        for i in range(full):
            h = hash((h, tuple(token_ids[i * self.window : (i + 1) * self.window])))
            out.append(h)
        return out

    def choose(
        self, token_ids: Sequence[int], leases: Sequence[SchedulerLease]
    ) -> SchedulerLease | None:
        """The scheduler for this prompt among `leases` (those that may take it)."""
        fallback = least(leases, load_of, self.rng)
        if fallback is None:
            return None
        by_id = {lease.scheduler_id: lease for lease in leases}
        for key in reversed(self.keys(token_ids)):
            owner = by_id.get(self._owner.get(key, ""))
            if owner is not None and load_of(owner) <= load_of(fallback) + self.slack:
                self.hits += 1
                return owner
        return fallback

    def record(self, token_ids: Sequence[int], scheduler_id: str) -> None:
        """`scheduler_id` took this prompt: its prefixes are found there from now on."""
        for key in self.keys(token_ids):
            self._owner[key] = scheduler_id
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, scheduler_id: str) -> None:
        """A scheduler that is gone (or came back empty) holds no prefix of ours."""
        for key in [k for k, owner in self._owner.items() if owner == scheduler_id]:
            del self._owner[key]

"""The soak's faults: which comes when, how long each is held, and whether a moment of
the run (an error a client got, an ERROR log line) falls in a fault's window.

Pure: times are seconds from the start of the soak's traffic; bench/soak.py injects.
"""

from __future__ import annotations

from dataclasses import dataclass

# In turn, as the soak injects them (then round again).
FAULTS = (
    "worker_kill",  # SIGKILL one worker; the supervisor restarts it
    "scheduler_kill",  # SIGKILL a scheduler; its lease lapses, the other takes over
    "nats_restart",  # SIGKILL the nats-server, start it again on the same port
    "redis_restart",  # SIGKILL the redis-server (its data goes), start it again
    "redis_refuses_writes",  # maxmemory 1 with noeviction, then lifted
    "gateway_stop",  # SIGSTOP the gateway, SIGCONT it later
)
FULL_INTERVAL_S = 150.0  # a fault every 2.5 minutes in a long soak
# How long each fault is held before it is lifted (a kill is not held: the supervisor
# restarts the process at its own pace).
HOLD_S = {
    "worker_kill": 0.0,
    "scheduler_kill": 0.0,
    "nats_restart": 2.0,
    "redis_restart": 1.0,
    "redis_refuses_writes": 30.0,
    "gateway_stop": 3.0,
}
# A fault's consequences (an error reply, an ERROR line written when the reconnect or the
# restart completes) may trail its recovery a little.
WINDOW_MARGIN_S = 10.0


@dataclass(frozen=True)
class Planned:
    at_s: float
    fault: str
    hold_s: float


def interval_for(duration_s: float, faults: tuple[str, ...] = FAULTS) -> float:
    """2.5 minutes apart in a long soak; a short one fits every fault once, evenly, with a
    fault-free stretch after the last (so the idle check follows a recovery)."""
    return min(FULL_INTERVAL_S, duration_s / (len(faults) + 1))


def schedule(
    duration_s: float, faults: tuple[str, ...] = FAULTS, interval_s: float | None = None
) -> list[Planned]:
    """The faults of a soak of `duration_s` seconds: one every interval, in turn, the
    last at least one interval before the end. Holds scale down with the interval (never
    more than half of it), except the gateway's 3 s stop, which is the case it tests.
    `faults` picks some of FAULTS (to study one, say), and `interval_s` spaces them."""
    unknown = set(faults) - set(FAULTS)
    if unknown or not faults:
        raise ValueError(f"faults must be some of {', '.join(FAULTS)}; got {sorted(unknown)}")
    interval = interval_s or interval_for(duration_s, faults)
    out: list[Planned] = []
    at = interval
    while at <= duration_s - interval + 1e-9:
        fault = faults[len(out) % len(faults)]
        hold = HOLD_S[fault]
        if fault != "gateway_stop":
            hold = min(hold, interval / 2)
        out.append(Planned(round(at, 3), fault, hold))
        at += interval
    return out


@dataclass
class Injected:
    """A fault as it happened: when (seconds from the start), when it was lifted, and
    when the system served again (None: it never did within the soak's patience)."""

    fault: str
    at_s: float
    lifted_s: float
    recovered_s: float | None = None

    @property
    def recovery_s(self) -> float | None:
        """From the fault's lifting until the system served again."""
        return None if self.recovered_s is None else self.recovered_s - self.lifted_s

    def window(self, end_s: float) -> tuple[float, float]:
        last = self.recovered_s if self.recovered_s is not None else end_s
        return self.at_s, last + WINDOW_MARGIN_S


def fault_at(injected: list[Injected], t_s: float, end_s: float) -> Injected | None:
    """The fault whose window holds moment `t_s` (the latest one, if windows overlap)."""
    found = None
    for f in injected:
        lo, hi = f.window(end_s)
        if lo <= t_s <= hi:
            found = f
    return found


def fault_during(
    injected: list[Injected], start_s: float, stop_s: float, end_s: float, kinds=None
) -> Injected | None:
    """The latest fault (of `kinds`, if given) whose window overlaps [start_s, stop_s]:
    a request's life."""
    found = None
    for f in injected:
        lo, hi = f.window(end_s)
        if lo <= stop_s and start_s <= hi and (kinds is None or f.fault in kinds):
            found = f
    return found

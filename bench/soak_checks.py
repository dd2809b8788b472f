"""The soak's invariants, pure: each takes what the soak recorded and returns a `Verdict`
(holds or not, and the first few counterexamples).

- every request ended exactly once (a finish reason per choice and one end-of-stream
  mark, nothing after it), or got an error while a fault was in effect;
- every greedy stream equals its fault-free reference token for token (a difference only
  where both runs' top two tokens were a near tie); a stream cut short (its deadline, the
  client leaving) is a start of it;
- no token lost or repeated: the tokens a stream brought are the count its usage reports;
- at idle no KV block is held and no spill key is left;
- the gateway's counters moved by what the clients counted;
- worker and scheduler RSS grew less than 5% after their warm-up;
- no ERROR log line but in the window of an injected fault.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from bench.soak_faults import Injected, fault_during
from bench.soak_traffic import Outcome

TIE_MARGIN = 1e-3  # as the e2e greedy comparisons: below this the top two are a tie
RSS_GROWTH_LIMIT = 0.05
SHOWN = 5  # counterexamples shown per invariant


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str = ""
    examples: list[str] = field(default_factory=list)


def _verdict(name: str, bad: list[str], detail: str) -> Verdict:
    return Verdict(name, not bad, detail if not bad else f"{len(bad)} bad; {detail}", bad[:SHOWN])


def ended_once(outcomes: list[Outcome], injected: list[Injected], end_s: float) -> Verdict:
    """Each request ended exactly once: every choice one finish reason and (streams) one
    end mark with nothing after it; or it got one error while it overlapped a fault's
    window; or the client left it (a disconnect)."""
    bad: list[str] = []
    errors = 0
    for o in outcomes:
        label = f"{o.kind} at {o.started_s:.1f}s"
        if o.after_done:
            bad.append(f"{label}: {o.after_done} messages after the end")
        if o.disconnected and o.error is None:
            continue
        if o.error is not None:
            errors += 1
            if o.finish is not None:
                bad.append(f"{label}: an error after finishing ({o.error})")
            if fault_during(injected, o.started_s, o.ended_s, end_s) is None:
                bad.append(f"{label}: error outside any fault's window: {o.error}")
            continue
        for i in range(o.choices):
            reasons = o.finishes.get(i, [])
            if len(reasons) != 1:
                bad.append(f"{label}: choice {i} finished {len(reasons)} times {reasons}")
        if o.done_marks > 1:
            bad.append(f"{label}: {o.done_marks} end marks")
    return _verdict(
        "every request ended exactly once",
        bad,
        f"{len(outcomes)} requests, {errors} ended with an error during a fault",
    )


def greedy_difference(
    got: list[int], got_gaps: list[float], want: list[int], want_gaps: list[float]
) -> tuple[int, str] | None:
    """Where a greedy run `got` parts from `want` beyond a near tie: (position, why);
    None when it is `want` or a start of it (up to a tie, after which both may differ)."""
    if len(got) > len(want):
        return len(want), f"{len(got)} tokens, the reference has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g == w:
            continue
        gap = min(
            got_gaps[i] if i < len(got_gaps) else float("inf"),
            want_gaps[i] if i < len(want_gaps) else float("inf"),
        )
        if gap < TIE_MARGIN:
            return None
        return i, f"token {g} != {w} (top-2 gap {gap:.2e})"
    return None


# Core NATS delivers at most once: a message the gateway publishes to a NATS client's
# reply subject while that client is not yet subscribed again after a NATS restart is
# gone, and neither side can tell. A NATS-API stream in flight across the restart may
# therefore miss chunks; it still ends once (or its client gives up), and is left out of
# the token-by-token checks, counted apart.
NATS_KINDS = ("nats", "nats_stream")


def across_bus_restart(o: Outcome, injected: list[Injected], end_s: float) -> bool:
    return o.kind in NATS_KINDS and (
        fault_during(injected, o.started_s, o.ended_s, end_s, {"nats_restart"}) is not None
    )


def greedy_equal(
    outcomes: list[Outcome],
    references: dict[str, tuple[list[int], list[float]]],
    injected: list[Injected],
    end_s: float,
) -> Verdict:
    """Each greedy outcome's tokens equal its reference's start: all of the length it
    asked for when it finished by length; any start when cut short."""
    bad: list[str] = []
    compared = ties = crossed = 0
    for o in outcomes:
        if o.reference is None or o.error is not None:
            continue
        if across_bus_restart(o, injected, end_s):
            crossed += 1
            continue
        want, want_gaps = references[o.reference]
        got, gaps = o.tokens.get(0, []), o.gaps.get(0, [])
        compared += 1
        label = f"{o.kind} at {o.started_s:.1f}s ({o.reference!r})"
        found = greedy_difference(got, gaps, want, want_gaps)
        if found is not None:
            bad.append(f"{label}: at {found[0]}: {found[1]}")
            continue
        if got != want[: len(got)]:
            ties += 1
        elif o.finish == "length" and o.usage_completion not in (None, len(got)):
            bad.append(f"{label}: usage says {o.usage_completion} tokens, {len(got)} came")
    return _verdict(
        "every greedy stream equals its fault-free run",
        bad,
        f"{compared} compared, {ties} parted at a near tie, {crossed} NATS-API clients "
        "across a NATS restart not compared",
    )


def tokens_whole(outcomes: list[Outcome], injected: list[Injected], end_s: float) -> Verdict:
    """A finished stream brought, over all its choices, the tokens its usage counts: one
    lost or repeated shows as a difference."""
    bad: list[str] = []
    checked = crossed = 0
    for o in outcomes:
        if o.error is not None or o.disconnected or o.usage_completion is None:
            continue
        if across_bus_restart(o, injected, end_s):
            crossed += 1
            continue
        if not o.tokens:
            continue  # a chat stream: no token ids to count
        came = sum(len(t) for t in o.tokens.values())
        checked += 1
        if came != o.usage_completion:
            bad.append(f"{o.kind} at {o.started_s:.1f}s: {came} tokens came, usage says "
                       f"{o.usage_completion}")  # fmt: skip
    detail = f"{checked} counted, {crossed} NATS-API clients across a NATS restart not counted"
    return _verdict("no token lost or repeated", bad, detail)


def idle(gauges: dict[str, float], spill_keys: list[str]) -> Verdict:
    """At idle: nothing running, waiting or swapped, no KV block in use, no spill held."""
    bad = [f"{k} = {v:g}" for k, v in gauges.items() if v]
    if spill_keys:
        bad.append(f"{len(spill_keys)} spill keys in Redis: {', '.join(spill_keys[:5])}")
    return _verdict("KV blocks and spill keys back to zero at idle", bad, "all zero")


CLIENT_SIDE_ERRORS = ("client_timeout", "client_error")  # the soak's own, not a reply


def metrics_match(outcomes: list[Outcome], finished: dict[str, float], generated: float) -> Verdict:
    """The gateway's counters against the clients'. Each choice is counted once: a
    finished one by its reason; a request ended by an error reply once as `error` (or not
    at all, when it was refused before it ran); one whose client left after its first
    chunks could have ended either way (`abort`, or its own reason when it finished before
    the gateway noticed), so it may fall under any reason but the total is exact. One the
    soak's own client gave up on (a timeout, a client error) may also never have reached a
    gateway (a NATS-API request published while NATS restarted is lost, as core NATS
    loses it): counted under any reason, or not at all. Generated tokens: at least what
    the usages told, and beyond it at most what the requests whose count no client heard
    could have made."""
    exact: Counter[str] = Counter()
    loose = maybe = errors = told = unheard = 0
    for o in outcomes:
        if o.disconnected:
            loose += o.choices
            unheard += o.max_tokens * o.choices
        elif o.error is not None and o.error.get("code") in CLIENT_SIDE_ERRORS:
            maybe += o.choices
            unheard += o.max_tokens * o.choices
        elif o.error is not None:
            # An error reply ends a request once as `error`, whatever its n; refused
            # before it was placed (a submit unanswered), it never counted as running.
            errors += 1
            unheard += o.max_tokens * o.choices
        else:
            for i in range(o.choices):
                exact.update(o.finishes.get(i, [])[-1:])
            told += o.usage_completion or 0
    bad: list[str] = []
    for reason in sorted(set(exact) | {r for r, v in finished.items() if v} | {"error"}):
        got = round(finished.get(reason, 0.0))
        room = loose + maybe + (errors if reason == "error" else 0)
        if not exact[reason] <= got <= exact[reason] + room:
            extra = f" (+ up to {room} left, given up or refused)" if room else ""
            bad.append(f"finish_reason={reason}: metrics {got}, clients {exact[reason]}{extra}")
    total = round(sum(finished.values()))
    least = sum(exact.values()) + loose
    if not least <= total <= least + maybe + errors:
        shown = f"{least}" + (f" (+ up to {errors} errors)" if errors else "")
        shown += f" (+ up to {maybe} given up by the client)" if maybe else ""
        bad.append(f"choices finished: metrics {total}, clients {shown}")
    if not told <= generated <= told + unheard:
        bad.append(f"generation tokens: metrics {generated:g}, clients {told} "
                   f"(+ at most {unheard} unheard)")  # fmt: skip
    detail = f"{total} choices, {generated:g} tokens ({told} told to clients)"
    return _verdict("metrics equal what the clients counted", bad, detail)


@dataclass(frozen=True)
class RssSample:
    t_s: float
    role: str  # "worker", "scheduler", ...
    pid: int
    rss: int  # bytes


def rss_growth(
    samples: list[RssSample], warmup_s: float, end_s: float
) -> dict[int, tuple[str, float, float, float] | None]:
    """Per process: (role, baseline RSS, last RSS, growth) from the first sample past its
    warm-up (`warmup_s` into the run, and no earlier than a third of its own life past
    its first sample) to its last; None for one with too few samples after it."""
    by_pid: dict[int, list[RssSample]] = {}
    for s in sorted(samples, key=lambda s: s.t_s):
        by_pid.setdefault(s.pid, []).append(s)
    out: dict[int, tuple[str, float, float, float] | None] = {}
    for pid, series in by_pid.items():
        first, last = series[0].t_s, series[-1].t_s
        start = max(warmup_s, first + min(warmup_s, (last - first) / 3))
        after = [s for s in series if s.t_s >= start]
        if len(after) < 3:
            out[pid] = None
            continue
        base, final = after[0].rss, after[-1].rss
        out[pid] = (series[0].role, base, final, final / base - 1)
    return out


def rss_bounded(samples: list[RssSample], warmup_s: float, end_s: float) -> Verdict:
    bad, measured = [], 0
    for pid, found in rss_growth(samples, warmup_s, end_s).items():
        if found is None:
            continue
        role, base, final, growth = found
        if role not in ("worker", "scheduler"):
            continue
        measured += 1
        if growth >= RSS_GROWTH_LIMIT:
            bad.append(f"{role} {pid}: {base / 2**20:.1f} -> {final / 2**20:.1f} MiB "
                       f"(+{growth:.1%})")  # fmt: skip
    return _verdict(
        f"worker and scheduler RSS grew < {RSS_GROWTH_LIMIT:.0%} after {warmup_s:.0f}s",
        bad,
        f"{measured} processes measured",
    )


LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ (ERROR|CRITICAL) ")


def error_lines(log: str, wall_start: float) -> list[tuple[float, str]]:
    """(seconds from the start, line) of every ERROR or CRITICAL line of a service log
    (`%(asctime)s <service> %(levelname)s ...`, local time)."""
    out = []
    for line in log.splitlines():
        m = LOG_LINE.match(line)
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((stamp - wall_start, line))
    return out


# What an ERROR line caused by each fault names (case-insensitive).
FAULT_WORDS = {
    "worker_kill": r"worker",
    "scheduler_kill": r"scheduler|lease",
    "nats_restart": r"nats|bus|connect",
    "redis_restart": r"redis|spill|prefix tier|connect",
    "redis_refuses_writes": r"redis|spill|prefix tier|memory|write",
    "gateway_stop": r"gateway",
}


def names_fault(line: str, t_s: float, injected: list[Injected], end_s: float) -> bool:
    """Whether the line falls in the window of a fault it names."""
    for f in injected:
        lo, hi = f.window(end_s)
        if lo <= t_s <= hi and re.search(FAULT_WORDS[f.fault], line, re.IGNORECASE):
            return True
    return False


def errors_logged_for_faults(
    lines: list[tuple[float, str]], injected: list[Injected], end_s: float
) -> Verdict:
    bad = [
        f"{t:.1f}s: {line[:240]}" for t, line in lines if not names_fault(line, t, injected, end_s)
    ]
    return _verdict(
        "no ERROR line but those naming an injected fault",
        bad,
        f"{len(lines) - len(bad)} ERROR lines naming a fault in its window",
    )

"""The soak's tables, pure: requests by kind, faults with their recovery, RSS over time,
and the invariants' verdicts."""

from __future__ import annotations

from collections import Counter

from bench.failover import table
from bench.soak_checks import RssSample, Verdict
from bench.soak_faults import Injected
from bench.soak_traffic import KINDS, Outcome

RSS_COLUMNS = 6  # moments of the run shown in the RSS table


def requests_table(outcomes: list[Outcome]) -> str:
    header = ["kind", "sent", "finished", "by reason", "errors", "left by client"]
    rows = []
    for kind in KINDS:
        mine = [o for o in outcomes if o.kind == kind]
        finished = [o for o in mine if o.error is None and not o.disconnected]
        reasons = Counter(r for o in finished for rs in o.finishes.values() for r in rs[-1:])
        errors = Counter(str(o.error.get("code") or o.status) for o in mine if o.error)
        rows.append([
            kind,
            str(len(mine)),
            str(len(finished)),
            " ".join(f"{r}:{n}" for r, n in sorted(reasons.items())) or "-",
            " ".join(f"{c}:{n}" for c, n in sorted(errors.items())) or "0",
            str(sum(o.disconnected for o in mine)),
        ])  # fmt: skip
    total = [o for o in outcomes]
    rows.append(["all", str(len(total)),
                 str(sum(o.error is None and not o.disconnected for o in total)), "",
                 str(sum(o.error is not None for o in total)),
                 str(sum(o.disconnected for o in total))])  # fmt: skip
    return table(header, rows)


def faults_table(injected: list[Injected]) -> str:
    header = ["#", "at s", "fault", "held s", "serving again s after"]
    rows = [
        [
            str(n),
            f"{f.at_s:.1f}",
            f.fault,
            f"{f.lifted_s - f.at_s:.1f}",
            f"{f.recovery_s:.1f}" if f.recovery_s is not None else "never",
        ]
        for n, f in enumerate(injected, start=1)
    ]
    return table(header, rows) if rows else "(no fault injected)"


def rss_table(samples: list[RssSample], columns: int = RSS_COLUMNS) -> str:
    """RSS in MiB of each process (role and pid) at evenly spread moments of the run; `-`
    where it was not running then."""
    if not samples:
        return "(no RSS sample)"
    times = sorted({s.t_s for s in samples})
    picks = [times[round(k * (len(times) - 1) / max(1, columns - 1))] for k in range(columns)]
    picks = sorted(set(picks))
    by_pid: dict[int, dict[float, RssSample]] = {}
    for s in samples:
        by_pid.setdefault(s.pid, {})[s.t_s] = s
    header = ["process", "pid", *(f"{t:.0f}s" for t in picks)]
    rows = []
    for pid, series in sorted(by_pid.items(), key=lambda kv: (next(iter(kv[1].values())).role,
                                                             min(kv[1]))):  # fmt: skip
        role = next(iter(series.values())).role
        cells = []
        for t in picks:
            s = series.get(t)
            cells.append(f"{s.rss / 2**20:.0f}" if s else "-")
        rows.append([role, str(pid), *cells])
    return table(header, rows)


def verdicts_table(verdicts: list[Verdict]) -> str:
    lines = []
    for v in verdicts:
        lines.append(f"[{'ok' if v.ok else 'FAIL'}] {v.name}: {v.detail}")
        lines += [f"       {e}" for e in v.examples]
    return "\n".join(lines)


def report(
    outcomes: list[Outcome],
    injected: list[Injected],
    samples: list[RssSample],
    verdicts: list[Verdict],
    figures: dict[str, float],
) -> str:
    return "\n\n".join([
        "requests by kind\n" + requests_table(outcomes),
        "what the system did (its metrics)\n"
        + table(["figure", "count"], [[k, f"{v:g}"] for k, v in figures.items()]),
        "faults injected\n" + faults_table(injected),
        "RSS over time (MiB)\n" + rss_table(samples),
        "invariants\n" + verdicts_table(verdicts),
    ])  # fmt: skip

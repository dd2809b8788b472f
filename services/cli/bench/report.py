"""The result table (stdout) and the JSON file of one `spillway bench` run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from spillway.services.cli.bench.metrics import Stats, Summary
from spillway.services.cli.bench.peers import PeerResult


def _stats_line(name: str, stats: Stats | None) -> str:
    if stats is None:
        return f"{name:<34} {'-':>10} {'-':>10} {'-':>10}"
    return f"{name:<34} {stats.mean:10.1f} {stats.median:10.1f} {stats.p99:10.1f}"


def summary_table(title: str, s: Summary) -> str:
    rule = "=" * 68
    lines = [
        f"{f' {title} ':=^68}",
        f"{'successful requests':<34} {s.completed:>10}",
        f"{'failed requests':<34} {s.failed:>10}",
        f"{'duration (s)':<34} {s.duration_s:10.2f}",
        f"{'prompt tokens':<34} {s.input_tokens:>10}",
        f"{'generated tokens':<34} {s.output_tokens:>10}",
        f"{'request throughput (req/s)':<34} {s.request_throughput:10.2f}",
        f"{'prompt token throughput (tok/s)':<34} {s.input_throughput:10.1f}",
        f"{'output token throughput (tok/s)':<34} {s.output_throughput:10.1f}",
        f"{'':<34} {'mean':>10} {'median':>10} {'p99':>10}",
        _stats_line("time to first token (ms)", s.ttft_ms),
        _stats_line("inter-token latency (ms)", s.itl_ms),
        _stats_line("time per output token (ms)", s.tpot_ms),
        _stats_line("end-to-end latency (ms)", s.e2el_ms),
    ]
    lines += [f"error: {e}" for e in s.errors]
    lines.append(rule)
    return "\n".join(lines)


def comparison_table(
    ours_name: str,
    ours: Summary,
    peers: list[PeerResult],
    agreements: dict[str, tuple[int, float]],
    bound_tok_s: float | None,
) -> str:
    """Each system's generated tokens per second, and ours over each."""
    header = f"{'system (same workload, same run)':<44} {'tok/s':>8} {'ours/it':>8}  notes"
    lines = [header, "-" * len(header)]
    lines.append(f"{ours_name:<44} {ours.output_throughput:8.1f} {1.0:8.2f}")
    for p in peers:
        if p.error:
            lines.append(f"{p.name:<44} {'-':>8} {'-':>8}  failed: {p.error}")
            continue
        ratio = ours.output_throughput / p.output_throughput if p.output_throughput else 0.0
        notes = [p.note] if p.note else []
        if p.name in agreements:
            same, prefix = agreements[p.name]
            notes.append(f"identical outputs {same}/{ours.completed}, agreeing {100 * prefix:.0f}%")
        lines.append(f"{p.name:<44} {p.output_throughput:8.1f} {ratio:8.2f}  {'; '.join(notes)}")
    if bound_tok_s:
        frac = ours.output_throughput / bound_tok_s
        lines.append(
            f"{'float32 bound':<44} {bound_tok_s:8.1f} {frac:8.2f}  "
            "products at the best GFLOP/s, attention's KV reads at the best GB/s"
        )
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(report), indent=2) + "\n")

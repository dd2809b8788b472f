"""What one run measured, summarised as `vllm bench serve` reports it (pure).

Per request the client records when it was sent, when each chunk carrying text arrived,
and the token counts from the final usage chunk:

    TTFT   first text chunk - sent
    ITL    the gaps between consecutive text chunks (all requests pooled)
    TPOT   (last chunk - first chunk) / (output tokens - 1), per request of 2+ tokens
    E2EL   last chunk - sent
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    index: int
    sent_s: float  # perf_counter when the request left
    chunk_s: list[float] = field(default_factory=list)  # arrivals of chunks carrying text
    end_s: float = 0.0  # when the stream ended ([DONE] or the failure)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_s)


@dataclass(frozen=True)
class Stats:
    """Milliseconds (or plain values): mean, median and 99th percentile."""

    mean: float
    median: float
    p99: float

    @staticmethod
    def of(values: Sequence[float], scale: float = 1.0) -> Stats | None:
        if not values:
            return None
        a = np.asarray(values, dtype=np.float64) * scale
        return Stats(float(a.mean()), float(np.median(a)), float(np.percentile(a, 99)))


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # requests / s
    input_throughput: float  # prompt tokens / s
    output_throughput: float  # generated tokens / s
    ttft_ms: Stats | None
    itl_ms: Stats | None
    tpot_ms: Stats | None
    e2el_ms: Stats | None
    errors: tuple[str, ...] = ()


def summarise(records: Sequence[RequestRecord]) -> Summary:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    if records:
        start = min(r.sent_s for r in records)
        end = max(r.end_s for r in records)
        duration = max(end - start, 1e-9)
    else:
        duration = 1e-9
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.chunk_s[0] - r.sent_s for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:], strict=False)]
    tpot = [
        (r.chunk_s[-1] - r.chunk_s[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
    ]
    e2el = [r.chunk_s[-1] - r.sent_s for r in ok]
    return Summary(
        completed=len(ok),
        failed=len(failed),
        duration_s=duration,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        input_throughput=input_tokens / duration,
        output_throughput=output_tokens / duration,
        ttft_ms=Stats.of(ttft, 1e3),
        itl_ms=Stats.of(itl, 1e3),
        tpot_ms=Stats.of(tpot, 1e3),
        e2el_ms=Stats.of(e2el, 1e3),
        errors=tuple(sorted({r.error or "no tokens" for r in failed})),
    )

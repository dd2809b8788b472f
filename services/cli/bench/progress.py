"""A one-line progress bar on stderr, redrawn at most a few times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from spillway.services.cli.bench.metrics import RequestRecord


class ProgressBar:
    def __init__(
        self, total: int, enabled: bool = True, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.done = self.failed = self.tokens = 0
        self._start = time.perf_counter()
        self._drawn = 0.0

    def __call__(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += 0 if record.ok else 1
        self.tokens += record.output_tokens if record.ok else 0
        now = time.perf_counter()
        if self.enabled and (now - self._drawn > 0.2 or self.done == self.total):
            self._drawn = now
            self.stream.write("\r" + self.line(now - self._start))
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()

    def line(self, elapsed_s: float) -> str:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        failed = f", {self.failed} failed" if self.failed else ""
        return (
            f"[{bar}] {self.done}/{self.total} requests{failed}, {self.tokens} tokens, "
            f"{elapsed_s:.1f} s"
        )

"""Reasoning split from content, for models with reasoning markers (vLLM's
`reasoning_content`; the formats are in shared/output_formats.py).

The text is split where the markers' text is (`<think>`/`</think>`, or Granite's "Here is
my thought process:" / "Here is my response:", which span several tokens); the markers
themselves are neither side. A block opens where its start marker is written (for Granite
only before any content), or at once when the generation prompt left the output in one
(Qwen3 thinking, DeepSeek-R1). A start marker inside a block is dropped (R1 may repeat
the one its prompt wrote).

Reasoning tokens are counted by region, as the worker tracks it (`shared.regions`): a
token generated inside a block, or one that opens or closes it, is a reasoning token.
"""

from __future__ import annotations

from spillway.shared.protocol import RegionName
from spillway.shared.regions import RegionMarkers, RegionTracker, TokenBytes


class ReasoningText:
    """Splits decoded text, piece by piece, into (reasoning, content)."""

    def __init__(
        self,
        starts: tuple[str, ...],
        ends: tuple[str, ...],
        inside: bool = False,
        anywhere: bool = True,
    ) -> None:
        self._starts, self._ends = starts, ends
        self.inside = inside
        self._anywhere = anywhere
        self._may_open = True  # without `anywhere`: until content or a block came
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._pending + text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._split(self._pending, final=True)

    def _split(self, data: str, final: bool) -> tuple[str, str]:
        self._pending = ""
        reasoning = content = ""
        while data:
            if self.inside:
                at, marker, closes = _first(
                    data, [(m, True) for m in self._ends] + [(m, False) for m in self._starts]
                )
                if marker is None:
                    keep = 0 if final else _held(data, self._ends + self._starts)
                    reasoning += data[: len(data) - keep]
                    self._pending = data[len(data) - keep :]
                    break
                reasoning += data[:at]
                data = data[at + len(marker) :]
                self.inside = not closes
                continue
            if not self._may_open:
                content += data
                break
            at, marker, _ = _first(data, [(m, True) for m in self._starts])
            before = data[: len(data) if marker is None else at]
            if not self._anywhere and before.strip():
                # Granite's block opens only before any content: unless the text so far
                # may still become its start marker, none will come.
                if marker is None and any(m.startswith(data.lstrip()) for m in self._starts):
                    self._pending = "" if final else data
                    content += data if final else ""
                    break
                self._may_open = False
                content += data
                break
            if marker is not None:
                content += before
                data = data[at + len(marker) :]
                self.inside = True
                self._may_open = self._anywhere
                continue
            keep = 0 if final else _held(data, self._starts)
            content += data[: len(data) - keep]
            self._pending = data[len(data) - keep :]
            break
        return reasoning, content


def _first(data: str, markers: list[tuple[str, bool]]) -> tuple[int, str | None, bool]:
    best: tuple[int, str | None, bool] = (len(data), None, False)
    for marker, flag in markers:
        at = data.find(marker)
        if at >= 0 and (at < best[0] or best[1] is None):
            best = (at, marker, flag)
    return best


def _held(data: str, markers: tuple[str, ...]) -> int:
    """The longest tail of `data` that may begin one of the markers."""
    for length in range(min(max(map(len, markers), default=1) - 1, len(data)), 0, -1):
        tail = data[len(data) - length :]
        if any(m.startswith(tail) for m in markers):
            return length
    return 0


class ReasoningTokens:
    """Counts the tokens of think blocks, following the region the worker tracks."""

    def __init__(self, markers: RegionMarkers, token_bytes: TokenBytes, initial: RegionName):
        self._tracker = RegionTracker(markers, token_bytes, initial)
        self.count = 0

    def advance(self, token_id: int) -> None:
        before = self._tracker.region
        after = self._tracker.advance(token_id)
        if before == "think" or after == "think":
            self.count += 1


def splits_reasoning(markers: RegionMarkers) -> bool:
    return markers.thinks

"""Stop strings matched on the generated text, across token boundaries.

Text arrives in pieces; a stop string may begin in one piece and end in a later one. The
matcher releases text only once it cannot be part of a stop string: the longest tail of
the unreleased text that is a prefix of some stop string is held back until the next
piece tells whether it completes one. On a match the output ends just before the
earliest stop string, which is left out, as OpenAI servers do.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # releasable now
    matched: str | None = None  # the stop string that ended the output, if one did


class StopStringMatcher:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._pending = ""
        self.matched: str | None = None

    def feed(self, piece: str) -> StopCheck:
        if self.matched is not None:
            return StopCheck("", self.matched)
        if not self.stop:
            return StopCheck(piece)
        text = self._pending + piece
        earliest = self._earliest_match(text)
        if earliest is not None:
            at, stop = earliest
            self._pending = ""
            self.matched = stop
            return StopCheck(text[:at], stop)
        held = self._held_tail_length(text)
        cut = len(text) - held
        self._pending = text[cut:]
        return StopCheck(text[:cut])

    def flush(self) -> str:
        """The output ended without a match: the held tail is plain text after all."""
        held, self._pending = self._pending, ""
        return "" if self.matched is not None else held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _held_tail_length(self, text: str) -> int:
        """The longest suffix of `text` that starts some stop string (shorter than it)."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - length :]):
                    longest = length
                    break
        return longest

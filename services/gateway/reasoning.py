"""Reasoning split from content, for models with think markers (vLLM's `reasoning_content`).

Each generated token goes to one side by the region it was generated in: tokens inside a
think block are reasoning, the rest content, and the think markers themselves neither
(they count as reasoning tokens). The region follows `shared.regions`, from the region the
generation prompt leaves the output in, exactly as the worker tracks it.
"""

from __future__ import annotations

from typing import Literal

from spillway.shared.protocol import RegionName
from spillway.shared.regions import RegionMarkers, RegionTracker, TokenBytes

Channel = Literal["reasoning", "content", "marker"]


class ReasoningSplit:
    def __init__(self, markers: RegionMarkers, token_bytes: TokenBytes, initial: RegionName):
        self._tracker = RegionTracker(markers, token_bytes, initial)
        self._think_ids = markers.think_ids
        self.num_reasoning_tokens = 0

    def route(self, token_id: int) -> Channel:
        before = self._tracker.region
        after = self._tracker.advance(token_id)
        inside = before == "think" or after == "think"
        if inside:
            self.num_reasoning_tokens += 1
        if token_id in self._think_ids and before != after:
            return "marker"
        return "reasoning" if before == "think" else "content"


def splits_reasoning(markers: RegionMarkers) -> bool:
    """Reasoning is split by token: both think markers must be single tokens."""
    return markers.thinks and len(markers.think_ids) == 2

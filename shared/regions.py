"""Where a sequence is in its output: plain text, a think block, a code fence, a tool call.

The worker tracks it to sample adaptively by region, the gateway to split reasoning from
content. Both take the same markers from the model's output formats (its reasoning and
tool-call formats, named or found in its tokenizer and chat template: output_formats.py),
or from the model-profile setting `region_markers`:

    plain --think_start------> think     --think_end------> plain
    plain --code_fence-------> code      --code_fence-----> plain
    plain --tool_call_start--> tool_call --tool_call_end--> plain

Inside a region only its own end marker counts (a fence inside a think block or a tool
call's JSON is text). A marker that is one token of the vocabulary is matched by its id; one
that is not (the code fence, which hides inside tokens like "```\\n", the fallback
tool-call tag spelled in several tokens, Granite's "Here is my thought process:") by its
text, across token boundaries; a marker may have other spellings (Granite's "Here's").
A tool-call format whose calls run to the end of the output (Mistral's, Llama's) has no
end marker: its region lasts to the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spillway.shared.output_formats import (
    TOOL_CALL_SYNTAX,
    ReasoningParserName,
    ToolCallParserName,
    detect_reasoning,
    detect_tool_call_parser,
)
from spillway.shared.protocol import RegionName

MARKER_NAMES = ("think_start", "think_end", "code_fence", "tool_call_start", "tool_call_end")
CODE_FENCE = "```"
# The Hermes pair: the fallback prompt's format, tracked unless another format is chosen.
TOOL_CALL_PAIRS = (("<tool_call>", "</tool_call>"),)

TokenBytes = Callable[[int], bytes]
TokenId = Callable[[str], "int | None"]


@dataclass(frozen=True)
class Marker:
    text: str
    token_id: int | None = None  # set when the text is exactly one token
    also: tuple[str, ...] = ()  # other spellings that count as this marker (by text)

    @property
    def texts(self) -> tuple[str, ...]:
        return (self.text, *self.also)


@dataclass(frozen=True)
class RegionMarkers:
    think_start: Marker | None = None
    think_end: Marker | None = None
    code_fence: Marker | None = Marker(CODE_FENCE)
    tool_call_start: Marker | None = Marker(TOOL_CALL_PAIRS[0][0])
    tool_call_end: Marker | None = Marker(TOOL_CALL_PAIRS[0][1])
    # Other single-token markers the output formats write ([ARGS], <｜tool▁sep｜>, ...): no
    # region of their own, but kept wherever the region markers are (grammars, text).
    words: tuple[Marker, ...] = ()
    _exits: dict[RegionName, tuple[tuple[Marker, RegionName], ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        pairs: dict[RegionName, list[tuple[Marker | None, RegionName]]] = {
            "plain": [
                (self.think_start, "think"),
                (self.tool_call_start, "tool_call"),
                (self.code_fence, "code"),
            ],
            "think": [(self.think_end, "plain")],
            "code": [(self.code_fence, "plain")],
            "tool_call": [(self.tool_call_end, "plain")],
        }
        exits = {r: tuple((m, to) for m, to in p if m is not None) for r, p in pairs.items()}
        object.__setattr__(self, "_exits", exits)

    @property
    def thinks(self) -> bool:
        """Both think markers are known (the model has think blocks)."""
        return self.think_start is not None and self.think_end is not None

    @property
    def think_ids(self) -> frozenset[int]:
        return frozenset(
            m.token_id for m in (self.think_start, self.think_end) if m and m.token_id is not None
        )

    def exits(self, region: RegionName) -> tuple[tuple[Marker, RegionName], ...]:
        """The markers that end `region`, with the region each leads to."""
        return self._exits[region]

    def longest_text(self) -> int:
        markers = [getattr(self, name) for name in MARKER_NAMES]
        texts = [t for m in markers if m is not None for t in m.texts]
        return max((len(t.encode()) for t in texts), default=0)


def marker_ids(markers: RegionMarkers) -> list[int]:
    """The token ids of the markers (and format words) that are single tokens."""
    found = [*(getattr(markers, name) for name in MARKER_NAMES), *markers.words]
    return sorted({m.token_id for m in found if m is not None and m.token_id is not None})


def detect_markers(
    token_id: TokenId,
    chat_template: str | None,
    overrides: Mapping[Any, str] | None = None,
    tool_call_parser: ToolCallParserName | None = None,
    reasoning_parser: ReasoningParserName | None = None,
) -> RegionMarkers:
    """The markers of a model: those of its reasoning and tool-call formats (named, or
    found from its vocabulary and chat template: shared.output_formats); `overrides`
    (name -> text, "" = off) win."""
    reasoning = detect_reasoning(token_id, chat_template, reasoning_parser)
    syntax = TOOL_CALL_SYNTAX[tool_call_parser or detect_tool_call_parser(chat_template)]
    texts: dict[str, str] = {"code_fence": CODE_FENCE, "tool_call_start": syntax.start}
    if syntax.end is not None:
        texts["tool_call_end"] = syntax.end
    also: dict[str, tuple[str, ...]] = {}
    if reasoning is not None:
        texts["think_start"], texts["think_end"] = reasoning.starts[0], reasoning.ends[0]
        also = {"think_start": reasoning.starts[1:], "think_end": reasoning.ends[1:]}
    texts.update(overrides or {})

    def marker(name: str) -> Marker | None:
        text = texts.get(name) or ""
        if not text:
            return None
        # A fence is matched as text whatever the vocabulary: it hides inside other tokens.
        return Marker(text, None if name == "code_fence" else token_id(text), also.get(name, ()))

    named = {name: marker(name) for name in MARKER_NAMES}
    taken = {m.text for m in named.values() if m is not None}
    words = tuple(
        Marker(w, token_id(w)) for w in syntax.words if w not in taken and token_id(w) is not None
    )
    return RegionMarkers(**named, words=words)


class RegionTracker:
    """The region of one sequence's output, advanced token by token."""

    def __init__(
        self, markers: RegionMarkers, token_bytes: TokenBytes, region: RegionName = "plain"
    ) -> None:
        self.markers = markers
        self.token_bytes = token_bytes
        self.region: RegionName = region
        self._keep = max(markers.longest_text() - 1, 0)
        self._tail = b""  # text since the last transition that may start a text marker

    def advance(self, token_id: int) -> RegionName:
        """Moves past one generated token; returns the region after it."""
        for marker, to in self.markers.exits(self.region):
            if marker.token_id == token_id:
                self.region, self._tail = to, b""
                return to
        data = self._tail + self.token_bytes(token_id)
        self.region, rest = _scan(self.markers, self.region, data, by_text_only=True)
        self._tail = rest[-self._keep :] if self._keep else b""
        return self.region


def region_after_text(
    markers: RegionMarkers, text: str, region: RegionName = "plain"
) -> RegionName:
    """The region after `text` (for example a generation prompt), every marker by its text."""
    return _scan(markers, region, text.encode(), by_text_only=False)[0]


def _scan(
    markers: RegionMarkers, region: RegionName, data: bytes, by_text_only: bool
) -> tuple[RegionName, bytes]:
    """Follows the text markers in `data` from `region`; returns the region reached and the
    bytes after its last transition. `by_text_only`: markers with a token id are skipped
    (they are matched by id)."""
    while True:
        best: tuple[int, int, RegionName] | None = None
        for marker, to in markers.exits(region):
            for text in marker.texts:
                if by_text_only and marker.token_id is not None and text == marker.text:
                    continue
                encoded = text.encode()
                at = data.find(encoded)
                if at >= 0 and (best is None or at < best[0]):
                    best = (at, at + len(encoded), to)
        if best is None:
            return region, data
        region, data = best[2], data[best[1] :]

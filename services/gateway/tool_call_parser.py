"""Tool calls read out of generated text as it streams, in any format (tool_formats/).

Text outside call sections is content; each call becomes an OpenAI tool call. As vLLM
and SGLang stream them, a call's first delta carries its index, id and name, and later
ones carry fragments of its arguments, which join to exactly the arguments of the whole
call (the non-streamed response holds the same text). The format reads a section again
from its start on each new piece, so the outcome does not depend on how the text was cut.

Whitespace right before a call or after the last one is dropped, so that a response made
only of calls has no content. A section that is not calls (bad JSON, no name) is
content, unless a call's name was already streamed: then that call stands with what was
streamed of it, and the rest of the section is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spillway.services.gateway.tool_formats.base import PartialCall, Schemas, ToolFormat


@dataclass
class ToolCallDelta:
    """One streamed piece of call number `index`: the header (id and name) or arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class _Sent:
    """What was streamed of one call."""

    id: str | None = None
    name: str | None = None
    arguments: str = ""
    index: int = -1
    skipped: bool = False  # a call beyond the first when parallel calls are off


class ToolCallParser:
    def __init__(
        self,
        fmt: ToolFormat,
        schemas: Schemas | None = None,
        new_id: Callable[[], str] | None = None,
        parallel: bool = True,
    ) -> None:
        self.fmt = fmt
        self.schemas = schemas or {}
        self.new_id = new_id or fmt.new_id
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._pending = ""  # outside a section: text not released yet
        self._section: str | None = None  # inside one: its text so far
        self._opener = ""  # what opened it (given back if it is not calls)
        self._space_before = ""  # dropped before it; given back likewise
        self._sent: list[_Sent] = []  # per call of the section
        self._cache: dict[int, Any] = {}  # the section's JSON scans so far
        self._dead = False  # a broken section after a streamed call: the rest is dropped
        self._at_start = True  # nothing released yet (Llama's calls are the whole output)
        self._announced = 0  # calls whose header was streamed

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content released by this text, and the call deltas it completes."""
        return self._run(text, final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: a call cut off keeps what was streamed of it."""
        content, deltas = self._run("", final=True)
        pending, self._pending = self._pending, ""
        if not (self.calls and not pending.strip()):
            content += pending
        return content, deltas

    def _run(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", list[ToolCallDelta]()
        if self._dead:
            return "", deltas
        while True:
            if self._section is None:
                rest, released = self._outside(text, final)
            else:
                rest, released = self._inside(text, final, deltas)
            content += released
            if rest is None or self._dead:
                return content, deltas
            text = rest

    # --- outside a section --------------------------------------------------------

    def _outside(self, text: str, final: bool) -> tuple[str | None, str]:
        """Returns (text left for a section just opened, or None; content released)."""
        data = self._pending + text
        self._pending = ""
        if self._at_start:
            opening = self.fmt.opening(data)
            if opening is None and not final:
                self._pending = data
                return None, ""
            if isinstance(opening, tuple):
                at, length = opening
                return self._open(data, at, length), ""
        found = [(data.find(s), s) for s in self.fmt.starts if s in data]
        if found:
            at, start = min(found)
            released = data[:at].rstrip()
            self._at_start = self._at_start and not released
            return self._open(data, at, len(start)), released
        keep = max((_partial_tail(data, s) for s in self.fmt.starts), default=0)
        # Whitespace waits: it is dropped if a call follows or the calls were the end.
        stripped = data[: len(data) - keep].rstrip()
        self._pending = data[len(stripped) :]
        if stripped:
            self._at_start = False
        return None, stripped

    def _open(self, data: str, at: int, length: int) -> str:
        before = data[:at]
        self._space_before = before[len(before.rstrip()) :]
        self._opener = data[at : at + length]
        self._section, self._sent, self._cache = "", [], {}
        return data[at + length :]

    # --- inside a section ---------------------------------------------------------

    def _inside(
        self, text: str, final: bool, deltas: list[ToolCallDelta]
    ) -> tuple[str | None, str]:
        assert self._section is not None
        self._section += text
        section = self._section
        scan = self.fmt.scan(section, final, self.schemas, self._cache)
        streamed = any(s.id is not None for s in self._sent)
        if scan.bad and not streamed:
            # Not calls: the opener is content, and what follows is read again outside.
            self._section = None
            self._at_start = False
            return section, self._space_before + self._opener
        self._stream(scan.calls, deltas)
        if scan.bad:
            self._close(scan.calls)
            self._dead = True
            return None, ""
        if scan.end is not None:
            self._close(scan.calls)
            self._at_start = False
            return section[scan.end :], ""
        if final:
            if not streamed and not any(c.name for c in scan.calls):
                self._section = None
                return section, self._space_before + self._opener
            self._close(scan.calls)
        return None, ""

    def _stream(self, calls: list[PartialCall], deltas: list[ToolCallDelta]) -> None:
        while len(self._sent) < len(calls):
            self._sent.append(_Sent())
        for call, sent in zip(calls, self._sent, strict=False):
            if call.name is None or sent.skipped:
                continue
            if sent.id is None:
                if not self.parallel and self._announced:
                    sent.skipped = True
                    continue
                sent.id, sent.name, sent.index = self.new_id(), call.name, self._announced
                self._announced += 1
                deltas.append(ToolCallDelta(sent.index, id=sent.id, name=call.name))
            args = call.arguments
            if len(args) > len(sent.arguments) and args.startswith(sent.arguments):
                deltas.append(ToolCallDelta(sent.index, arguments=args[len(sent.arguments) :]))
                sent.arguments = args

    def _close(self, calls: list[PartialCall]) -> None:
        """Ends the section: its announced calls stand, with all their arguments when
        whole, else with what was streamed of them."""
        for call, sent in zip(calls, self._sent, strict=False):
            if sent.id is None or sent.name is None:
                continue
            whole = call.done and call.arguments.startswith(sent.arguments)
            arguments = call.arguments if whole else sent.arguments
            self.calls.append(ToolCall(sent.id, sent.name, arguments))
        self._section = None
        self._sent = []


def _partial_tail(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that begins `marker` (shorter than it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[len(text) - length :]):
            return length
    return 0

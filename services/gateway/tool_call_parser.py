"""Tool calls in generated text, Hermes style, parsed as the text streams:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content; each tagged JSON object becomes an OpenAI tool call. As
vLLM and SGLang stream them, a call's first delta carries its index, id and name, and later
ones carry fragments of its arguments, which join to exactly the arguments' JSON text as
the model wrote it (the non-streamed response holds the same text). Arguments given as a
JSON string (some models encode them) are sent decoded, whole.

Whitespace right before a call or after the last one is dropped, so that a response made
only of calls has no content. A tagged body that is not a call (bad JSON, no name) stays
content, unless its name was already streamed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


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
class _Call:
    """The call being generated: its body so far and what was streamed of it."""

    index: int
    id: str
    body: str = ""
    name: str | None = None
    args_start: int | None = None  # where the arguments' value starts in body
    args_sent: int = 0  # characters of the value streamed
    args: _ValueScan | None = None
    space_before: str = ""  # dropped before the tag; given back if this is not a call


class ToolCallParser:
    def __init__(
        self, start: str, end: str, new_id: Callable[[], str], parallel: bool = True
    ) -> None:
        self.start = start
        self.end = end
        self.new_id = new_id
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._pending = ""  # outside a call: text not released yet
        self._call: _Call | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content released by this text, and the call deltas it completes."""
        content, deltas = "", list[ToolCallDelta]()
        while text:
            if self._call is None:
                text, released = self._outside(text)
                content += released
            else:
                text, released = self._inside(text, deltas)
                content += released
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: a call without its end tag still counts when its JSON is whole."""
        deltas: list[ToolCallDelta] = []
        content = ""
        if self._call is not None:
            content = self._close(self._call, deltas)
            self._call = None
        pending, self._pending = self._pending, ""
        if not (self.calls and not pending.strip()):
            content += pending
        return content, deltas

    # --- outside a call ------------------------------------------------------------

    def _outside(self, text: str) -> tuple[str, str]:
        """Returns (text left for a call, content released)."""
        data = self._pending + text
        at = data.find(self.start)
        if at >= 0:
            before, self._pending = data[:at], ""
            released = before.rstrip()  # whitespace right before a call is dropped
            self._open(before[len(released) :])
            return data[at + len(self.start) :], released
        keep = _partial_tail(data, self.start)
        cut = len(data) - keep
        # Whitespace waits: it is dropped if a call follows or the calls were the end.
        stripped = data[:cut].rstrip()
        if not stripped:
            self._pending = data
            return "", ""
        self._pending = data[len(stripped) :]
        return "", stripped

    def _open(self, space_before: str) -> None:
        self._call = _Call(index=len(self.calls), id=self.new_id(), space_before=space_before)

    # --- inside a call --------------------------------------------------------------

    def _inside(self, text: str, deltas: list[ToolCallDelta]) -> tuple[str, str]:
        """Consumes text of the current call; returns what follows its end tag and the
        content to release (the tagged text, when it was not a call)."""
        call = self._call
        assert call is not None
        call.body += text
        at = call.body.find(self.end)
        rest = ""
        if at >= 0:
            rest = call.body[at + len(self.end) :]
            call.body = call.body[:at]
        self._stream(call, deltas)
        if at < 0:
            return "", ""
        self._call = None
        return rest, self._close(call, deltas)

    def _wanted(self, call: _Call) -> bool:
        return self.parallel or call.index == 0

    def _stream(self, call: _Call, deltas: list[ToolCallDelta]) -> None:
        if not self._wanted(call):
            return
        if call.name is None:
            match = _NAME.search(call.body)
            if match is None:
                return
            try:
                call.name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                return
            deltas.append(ToolCallDelta(call.index, id=call.id, name=call.name))
        if call.args_start is None:
            match = _ARGUMENTS.search(call.body)
            if match is None:
                return
            call.args_start = match.end()
            call.args = _ValueScan()
        assert call.args is not None
        value = call.body[call.args_start :]
        call.args.scan(value)
        if call.args.kind in ("object", "array"):
            upto = call.args.end if call.args.end is not None else call.args.scanned
            if upto > call.args_sent:
                deltas.append(ToolCallDelta(call.index, arguments=value[call.args_sent : upto]))
                call.args_sent = upto

    def _close(self, call: _Call, deltas: list[ToolCallDelta]) -> str:
        """Ends the call; returns content to release (a body that was not a call)."""
        parsed = _parse_call(call.body)
        if not self._wanted(call):
            return ""
        if parsed is None:
            if call.name is not None:  # already streamed: it stays a (broken) call
                self.calls.append(ToolCall(call.id, call.name, _streamed_args(call)))
                return ""
            return call.space_before + self.start + call.body + self.end
        name, arguments = parsed
        if call.name is None:
            call.name = name
            deltas.append(ToolCallDelta(call.index, id=call.id, name=name))
        streamed = _streamed_args(call)
        if arguments.startswith(streamed) and len(arguments) > len(streamed):
            deltas.append(ToolCallDelta(call.index, arguments=arguments[len(streamed) :]))
        elif not arguments.startswith(streamed):  # cannot happen with a clean scan
            arguments = streamed
        self.calls.append(ToolCall(call.id, name, arguments))
        return ""


def _streamed_args(call: _Call) -> str:
    if call.args_start is None:
        return ""
    return call.body[call.args_start : call.args_start + call.args_sent]


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a whole call body, or None when it is not one. The
    arguments are the model's own text of the value (a JSON string value is decoded)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return obj["name"], "{}"
    value = obj[key]
    if isinstance(value, str):
        return obj["name"], value
    match = _ARGUMENTS.search(body)
    if match is not None:
        scan = _ValueScan()
        scan.scan(body[match.end() :])
        if scan.end is not None and scan.kind in ("object", "array"):
            return obj["name"], body[match.end() : match.end() + scan.end]
    return obj["name"], json.dumps(value, ensure_ascii=False)


@dataclass
class _ValueScan:
    """Scans a JSON value's text incrementally: its kind, and where it ends once known."""

    kind: str | None = None  # object, array, string, other
    scanned: int = 0
    end: int | None = None
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _stack: list[str] = field(default_factory=list)

    def scan(self, text: str) -> None:
        while self.end is None and self.scanned < len(text):
            ch = text[self.scanned]
            self.scanned += 1
            if self.kind is None:
                self.kind = {"{": "object", "[": "array", '"': "string"}.get(ch, "other")
                if self.kind == "string":
                    self._in_string = True
                elif self.kind in ("object", "array"):
                    self._depth = 1
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self.kind == "string":
                        self.end = self.scanned
                continue
            if self.kind == "other":
                if ch in ",}] \n\r\t":
                    self.end = self.scanned - 1
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = self.scanned


def _partial_tail(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that begins `marker` (shorter than it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[len(text) - length :]):
            return length
    return 0

"""JSON read as it streams: where a value ends, an object's top-level fields, and the
call objects (`{"name": ..., "arguments": ...}`) most tool-call formats write.

Everything here is a pure function of the text so far: a format scans its whole call
section again on each new piece, and a value's text only ever grows, so what was streamed
of it stays a prefix of what follows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from spillway.services.gateway.tool_formats.base import PartialCall, SectionScan

_WHITESPACE = " \t\r\n"


# Where a scan must look again: a string's quote or escape; a container's quotes and
# brackets; the end of a number or literal. Runs between them are skipped at C speed, so
# reading a long argument again on each new piece stays cheap.
_IN_STRING = re.compile(r'["\\]')
_IN_CONTAINER = re.compile(r'["{}\[\]]')
_AFTER_LITERAL = re.compile(r"[,}\]\s]")


@dataclass
class ValueScan:
    """Scans one JSON value's text: its kind, and where it ends once known."""

    kind: str | None = None  # object, array, string, other
    scanned: int = 0
    end: int | None = None
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def scan(self, text: str) -> ValueScan:
        while self.end is None and self.scanned < len(text):
            if self.kind is None:
                ch = text[self.scanned]
                self.scanned += 1
                self.kind = {"{": "object", "[": "array", '"': "string"}.get(ch, "other")
                self._in_string = self.kind == "string"
                self._depth = 1 if self.kind in ("object", "array") else 0
                continue
            if self._escaped:
                self._escaped = False
                self.scanned += 1
                continue
            pattern = (
                _IN_STRING
                if self._in_string
                else _AFTER_LITERAL
                if self.kind == "other"
                else _IN_CONTAINER
            )
            found = pattern.search(text, self.scanned)
            if found is None:
                self.scanned = len(text)
                return self
            self.scanned = found.end()
            self._step(found.group(), found.start())
        return self

    def _step(self, ch: str, at: int) -> None:
        if self.kind == "other" and not self._in_string:
            self.end = at
        elif self._in_string:
            if ch == "\\":
                self._escaped = True
            else:
                self._in_string = False
                if self.kind == "string":
                    self.end = self.scanned
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        else:
            self._depth -= 1
            if self._depth == 0:
                self.end = self.scanned


Cache = dict[int, ValueScan]  # value start -> its scan so far, for text that only grows


def value_at(text: str, start: int, final: bool, cache: Cache | None = None) -> ValueScan:
    """The scan of the value starting at `start`; at the end of the output (`final`) a
    number or literal ends with the text. With a `cache` (the text only grew since the
    last call), the scan goes on from where it stopped."""
    scan = cache.setdefault(start, ValueScan()) if cache is not None else ValueScan()
    scan.scan(text[start:])
    if scan.end is None and final and scan.kind == "other":
        return ValueScan(scan.kind, scan.scanned, scan.scanned)
    return scan


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


@dataclass
class ObjectScan:
    """A JSON object's top-level fields as far as they go: name -> (value start, scan)."""

    fields: dict[str, tuple[int, ValueScan]]
    end: int | None = None  # just past the closing brace
    bad: bool = False  # not a JSON object (whatever follows)


def scan_object(
    text: str, start: int, final: bool = False, cache: Cache | None = None
) -> ObjectScan:
    """Walks the object whose `{` is at `start`."""
    out = ObjectScan({})
    at = start + 1
    while True:
        at = skip_space(text, at)
        if at >= len(text):
            return out
        ch = text[at]
        if ch == "}":
            out.end = at + 1
            return out
        if ch == ",":
            at += 1
            continue
        if ch != '"':
            out.bad = True
            return out
        key = ValueScan().scan(text[at:])
        if key.end is None:
            return out
        try:
            name = json.loads(text[at : at + key.end])
        except json.JSONDecodeError:
            out.bad = True
            return out
        at = skip_space(text, at + key.end)
        if at >= len(text):
            return out
        if text[at] != ":":
            out.bad = True
            return out
        at = skip_space(text, at + 1)
        if at >= len(text):
            return out
        value = value_at(text, at, final, cache)
        out.fields[name] = (at, value)
        if value.end is None:
            return out
        at += value.end


def scan_call_object(
    text: str,
    start: int,
    final: bool,
    cache: Cache | None = None,
    args_keys: tuple[str, ...] = ("arguments", "parameters"),
) -> tuple[PartialCall, int | None, bool]:
    """The call written as a JSON object at `start`: (the call so far, where the object
    ends, whether it is not a call). Arguments are the model's own text of the value (a
    JSON string value is decoded, some models encode them); none given is `{}`."""
    obj = scan_object(text, start, final, cache)
    call = PartialCall()
    name_field = obj.fields.get("name")
    if name_field is not None:
        at, scan = name_field
        if scan.kind != "string":
            return call, None, True
        if scan.end is not None:
            try:
                call.name = json.loads(text[at : at + scan.end])
            except json.JSONDecodeError:
                return call, None, True
    key = next((k for k in args_keys if k in obj.fields), None)
    if key is not None:
        at, scan = obj.fields[key]
        if scan.kind in ("object", "array"):
            call.arguments = text[at : at + (scan.end or scan.scanned)]
    if obj.bad:
        return call, None, True
    if obj.end is None:
        return call, None, False
    if call.name is None:
        return call, obj.end, True
    call.done = True
    if key is None:
        call.arguments = "{}"
    else:
        at, scan = obj.fields[key]
        raw = text[at : at + (scan.end or 0)]
        if scan.kind == "string":
            call.arguments = json.loads(raw)
        elif scan.kind not in ("object", "array"):
            call.arguments = raw
    return call, obj.end, False


def scan_call_array(
    text: str, start: int, final: bool, cache: Cache | None = None
) -> tuple[list[PartialCall], int | None, bool]:
    """A JSON list of call objects whose `[` is at `start` (Mistral, Granite): (the calls
    so far, where the list ends, whether it is not a list of calls)."""
    calls: list[PartialCall] = []
    at = start + 1
    while True:
        at = skip_space(text, at)
        if at >= len(text):
            return calls, None, False
        ch = text[at]
        if ch == "]":
            return calls, at + 1, not calls
        if ch == "," and calls:
            at += 1
            continue
        if ch != "{":
            return calls, None, True
        call, end, bad = scan_call_object(text, at, final, cache)
        if bad:
            return calls, None, True
        calls.append(call)
        if end is None:
            return calls, None, False
        at = end


def calls_in_list(section: str, start: int, final: bool, cache: Cache | None = None) -> SectionScan:
    """A list of call objects from `start` on (a lone object counts as a list of one)."""
    at = skip_space(section, start)
    if at >= len(section):
        return SectionScan(bad=final)
    if section[at] == "{":
        call, end, bad = scan_call_object(section, at, final, cache)
        return SectionScan([call], end=end, bad=bad)
    if section[at] != "[":
        return SectionScan(bad=True)
    calls, end, bad = scan_call_array(section, at, final, cache)
    return SectionScan(calls, end=end, bad=bad)

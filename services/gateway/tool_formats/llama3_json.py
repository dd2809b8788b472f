"""Llama 3.1 / 3.2 / 3.3 JSON calls (vLLM's `llama3_json`): an output that starts with a
JSON object (or `<|python_tag|>`) is calls, `; ` between them.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from __future__ import annotations

from spillway.services.gateway.tool_formats.base import CallShape, Schemas, SectionScan, ToolFormat
from spillway.services.gateway.tool_formats.json_scan import Cache, scan_call_object, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    starts = ()  # the calls are the output itself: see opening()
    shape = CallShape(
        open="",
        begin='{"name": "{name}", "parameters": ',
        close="}",
        separator="; ",
        finish="",
        trigger='{"name": ',
    )

    def opening(self, text: str) -> tuple[int, int] | bool | None:
        at = skip_space(text, 0)
        if at >= len(text):
            return None
        if text[at] == "{":
            return at, 0
        if text.startswith(PYTHON_TAG, at):
            return at, len(PYTHON_TAG)
        return None if PYTHON_TAG.startswith(text[at:]) else False

    def scan(
        self, section: str, final: bool, schemas: Schemas, cache: Cache | None = None
    ) -> SectionScan:
        out = SectionScan()
        at = skip_space(section, 0)
        while True:
            if at >= len(section):
                out.bad = final and not out.calls
                out.end = len(section) if final and out.calls else None
                return out
            if section[at] != "{":
                out.bad, out.end = not out.calls, at
                return out
            call, end, bad = scan_call_object(section, at, final, cache)
            if bad:
                out.bad, out.end = not out.calls, at
                return out
            out.calls.append(call)
            if end is None:
                return out
            after = skip_space(section, end)
            if after < len(section) and section[after] == ";":
                at = skip_space(section, after + 1)
                continue
            if after >= len(section) and not final:
                return out  # a `;` and another call may follow
            out.end = end
            return out

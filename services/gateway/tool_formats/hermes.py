"""Hermes (Qwen2.5, Qwen3, Granite 4, Hermes, and the fallback prompt's format): each call
a JSON object in its own tags.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from spillway.services.gateway.tool_formats.base import CallShape, Schemas, SectionScan, ToolFormat
from spillway.services.gateway.tool_formats.json_scan import Cache, scan_call_object, skip_space

START, END = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    starts = (START,)
    shape = CallShape(
        open="",
        begin=START + '\n{"name": "{name}", "arguments": ',
        close="}\n" + END,
        separator="\n",
        finish="",
        trigger=START,
    )

    def scan(
        self, section: str, final: bool, schemas: Schemas, cache: Cache | None = None
    ) -> SectionScan:
        at = skip_space(section, 0)
        if at >= len(section):
            return SectionScan(bad=final)
        if section[at] != "{":
            return SectionScan(bad=True)
        call, end, bad = scan_call_object(section, at, final, cache)
        if bad or end is None:
            return SectionScan([call], bad=bad)
        closing = section.find(END, end)
        if closing >= 0:
            return SectionScan([call], end=closing + len(END))
        # The output ended without the end tag: a whole call still counts.
        return SectionScan([call], end=len(section) if final else None)

"""Granite 3.x calls (vLLM's `granite`): a JSON list of call objects after `<|tool_call|>`.

<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

from spillway.services.gateway.tool_formats.base import Schemas, SectionScan, ToolFormat, list_shape
from spillway.services.gateway.tool_formats.json_scan import Cache, calls_in_list

START = "<|tool_call|>"


class Granite(ToolFormat):
    name = "granite"
    starts = (START,)
    shape = list_shape(START)

    def scan(
        self, section: str, final: bool, schemas: Schemas, cache: Cache | None = None
    ) -> SectionScan:
        return calls_in_list(section, 0, final, cache)

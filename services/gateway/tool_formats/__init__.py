"""The tool-call formats by vLLM's parser names; `tool_format` picks the one a server
uses (its template decides between a format's variants)."""

from __future__ import annotations

from spillway.services.gateway.tool_formats.base import ToolFormat
from spillway.services.gateway.tool_formats.deepseek_v3 import DeepSeekV3
from spillway.services.gateway.tool_formats.granite import Granite
from spillway.services.gateway.tool_formats.hermes import Hermes
from spillway.services.gateway.tool_formats.llama3_json import Llama3Json
from spillway.services.gateway.tool_formats.mistral import Mistral
from spillway.services.gateway.tool_formats.qwen3_xml import Qwen3Xml
from spillway.shared.output_formats import ToolCallParserName, detect_tool_call_parser

# DeepSeek-V3.1's template writes the arguments right after the separator.
_V31_MARK = "tool▁sep｜>' + tool['function']['arguments']"


def tool_format(name: ToolCallParserName | None, template: str | None) -> ToolFormat:
    """The format `name` (None: the one the template shows), in the template's variant."""
    text = template or ""
    chosen = name or detect_tool_call_parser(template)
    if chosen == "mistral":
        return Mistral(named="[ARGS]" in text)
    if chosen == "deepseek_v3":
        return DeepSeekV3(v31=_V31_MARK in text)
    formats: dict[str, type[ToolFormat]] = {
        "hermes": Hermes,
        "llama3_json": Llama3Json,
        "qwen3_xml": Qwen3Xml,
        "granite": Granite,
    }
    return formats[chosen]()


__all__ = ["ToolFormat", "tool_format"]

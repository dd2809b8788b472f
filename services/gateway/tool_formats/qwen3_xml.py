"""Qwen3-Coder calls (vLLM's `qwen3_xml`): XML, each argument a `<parameter=...>` block
holding its value as text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A value is typed by the function's schema, as vLLM does: a string stays text (less the
line breaks that frame it), numbers, booleans, null, objects and lists are read as JSON,
and a value that does not read as its type stays text. The arguments are streamed as a
JSON object, one parameter at a time.
"""

from __future__ import annotations

import json
from typing import Any

from spillway.services.gateway.tool_formats.base import (
    CallShape,
    PartialCall,
    Schemas,
    SectionScan,
    ToolFormat,
    dumps,
)
from spillway.services.gateway.tool_formats.json_scan import Cache, skip_space

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3Xml(ToolFormat):
    name = "qwen3_xml"
    starts = (START,)
    shape = CallShape(
        open="",
        begin=START + "\n" + FUNCTION + "{name}>\n",
        close=FUNCTION_END + "\n" + END,
        separator="\n",
        finish="",
        trigger=START,
        xml=True,
    )

    def write_arguments(self, arguments: dict[str, Any]) -> str:
        return "".join(
            f"{PARAMETER}{k}>\n{v if isinstance(v, str) else dumps(v)}\n{PARAMETER_END}\n"
            for k, v in arguments.items()
        )

    def scan(
        self, section: str, final: bool, schemas: Schemas, cache: Cache | None = None
    ) -> SectionScan:
        at = skip_space(section, 0)
        opened = _expect(section, at, FUNCTION, final)
        if opened is not True:
            return SectionScan(bad=opened is False)
        at += len(FUNCTION)
        close = section.find(">", at)
        if close < 0:
            return SectionScan([PartialCall()], bad=final)
        call = PartialCall(name=section[at:close])
        properties = (schemas.get(call.name) or {}).get("properties") or {}
        fields: list[str] = []
        at = close + 1
        while True:
            call.arguments = "{" + ", ".join(fields)
            at = skip_space(section, at)
            if section.startswith(PARAMETER, at):
                name_end = section.find(">", at)
                value_end = section.find(PARAMETER_END, max(name_end, at))
                if name_end < 0 or value_end < 0:
                    return SectionScan([call], bad=final)
                key = section[at + len(PARAMETER) : name_end]
                value = _value(section[name_end + 1 : value_end], properties.get(key))
                fields.append(f"{dumps(key)}: {dumps(value)}")
                at = value_end + len(PARAMETER_END)
                continue
            ended = _expect(section, at, FUNCTION_END, final)
            if ended is not True:
                bad = ended is False or final
                return SectionScan([call], bad=bad and not _unsettled(section, at, final))
            call.arguments += "}"
            call.done = True
            at = skip_space(section, at + len(FUNCTION_END))
            if section.startswith(END, at):
                return SectionScan([call], end=at + len(END))
            if (at >= len(section) or END.startswith(section[at:])) and not final:
                return SectionScan([call])
            return SectionScan([call], end=at)


def _expect(text: str, at: int, literal: str, final: bool) -> bool | None:
    """Whether `literal` is at `at` (None: the text ends in a part of it)."""
    if text.startswith(literal, at):
        return True
    if literal.startswith(text[at:]) and not final:
        return None
    return False


def _unsettled(text: str, at: int, final: bool) -> bool:
    return not final and PARAMETER.startswith(text[at:])


def _value(text: str, schema: Any) -> Any:
    """A parameter's value by its schema (vLLM's rules): the line breaks that frame it
    are not part of it; whitespace around a value that is not a string never is."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    schema = schema if isinstance(schema, dict) else {}
    bare = text.strip()
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(choices, list):
        if bare in choices:
            return bare
        parsed = _json(bare)
        return parsed if parsed is not _NOT_JSON and parsed in choices else text
    types = schema.get("type")
    names = set(types if isinstance(types, list) else [types] if types else [])
    if names and names <= {"string"}:
        return text
    value = _json(bare)
    if value is _NOT_JSON:
        return text
    if not names or any(_KINDS.get(n, _never)(value) for n in names):
        return value
    return text if "string" in names else value


_NOT_JSON = object()


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return _NOT_JSON


def _never(value: Any) -> bool:
    return False


_KINDS = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}

"""Mistral calls (vLLM's `mistral`), after `[TOOL_CALLS]`: a JSON list of call objects
(v3 and Tekken tokenizers: Mistral 7B v0.3, Nemo), or the name and its arguments (v11 and
later: Mistral Small 3.1+, Devstral, Magistral), a call id possibly between them:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

Both are read; the grammar writes the one the chat template shows. Call ids are nine
letters and digits: Mistral's templates refuse any other when the calls come back.
"""

from __future__ import annotations

import re
import secrets
import string

from spillway.services.gateway.tool_formats.base import (
    CallShape,
    PartialCall,
    Schemas,
    SectionScan,
    ToolFormat,
    list_shape,
)
from spillway.services.gateway.tool_formats.json_scan import (
    Cache,
    calls_in_list,
    skip_space,
    value_at,
)

START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID = re.compile(r"[A-Za-z0-9]*")
_ALPHANUMERIC = string.ascii_letters + string.digits

LIST_SHAPE = list_shape(START)
NAMED_SHAPE = CallShape(
    open="", begin=START + "{name}" + ARGS, close="", separator="", finish="", trigger=START
)


class Mistral(ToolFormat):
    name = "mistral"
    starts = (START,)

    def __init__(self, named: bool = False) -> None:
        self.shape = NAMED_SHAPE if named else LIST_SHAPE

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def scan(
        self, section: str, final: bool, schemas: Schemas, cache: Cache | None = None
    ) -> SectionScan:
        at = skip_space(section, 0)
        if at < len(section) and section[at] in "[{":
            return calls_in_list(section, at, final, cache)
        return _named_call(section, at, final, cache)


def _named_call(section: str, at: int, final: bool, cache: Cache | None) -> SectionScan:
    """`name[CALL_ID]id[ARGS]{...}`, the id and the [ARGS] marker optional."""
    name = _NAME.match(section, at)
    if name is None:
        return SectionScan(bad=at < len(section) or final)
    call = PartialCall()
    at = name.end()
    if at < len(section) and section.startswith(CALL_ID, at):
        at = _ID.match(section, at + len(CALL_ID)).end()  # type: ignore[union-attr]
    elif _unsettled(section, at, (CALL_ID, ARGS)):
        return SectionScan([call], bad=final)
    if section.startswith(ARGS, at):
        at += len(ARGS)
    elif _unsettled(section, at, (ARGS,)):
        return SectionScan([call], bad=final)
    at = skip_space(section, at)
    if at >= len(section):
        return SectionScan([call], bad=final)
    if section[at] != "{":
        return SectionScan(bad=True)
    call.name = name.group()  # named once its arguments begin: a call for sure
    value = value_at(section, at, final, cache)
    call.arguments = section[at : at + (value.end or value.scanned)]
    if value.end is None:
        return SectionScan([call])
    call.done = True
    return SectionScan([call], end=at + value.end)


def _unsettled(text: str, at: int, markers: tuple[str, ...]) -> bool:
    """The text ends in what may still become one of the markers."""
    rest = text[at:]
    return any(m.startswith(rest) for m in markers) and len(rest) < max(map(len, markers))

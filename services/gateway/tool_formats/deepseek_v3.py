"""DeepSeek-V3 / R1 calls (vLLM's `deepseek_v3`), and V3.1's, which drop the type and the
code fence:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>     (one line)

Both are read; the grammar writes the one the chat template shows.
"""

from __future__ import annotations

from spillway.services.gateway.tool_formats.base import (
    CallShape,
    PartialCall,
    Schemas,
    SectionScan,
    ToolFormat,
)
from spillway.services.gateway.tool_formats.json_scan import Cache, skip_space, value_at
from spillway.shared.output_formats import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
)

FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"
V3_SHAPE = CallShape(
    open=DS_CALLS_BEGIN,
    begin=DS_CALL_BEGIN + "function" + DS_SEP + "{name}" + FENCE_OPEN,
    close=FENCE_CLOSE + DS_CALL_END,
    separator="\n",
    finish=DS_CALLS_END,
    trigger=DS_CALLS_BEGIN,
)
V31_SHAPE = CallShape(
    open=DS_CALLS_BEGIN,
    begin=DS_CALL_BEGIN + "{name}" + DS_SEP,
    close=DS_CALL_END,
    separator="",
    finish=DS_CALLS_END,
    trigger=DS_CALLS_BEGIN,
)


class DeepSeekV3(ToolFormat):
    name = "deepseek_v3"
    starts = (DS_CALLS_BEGIN,)

    def __init__(self, v31: bool = False) -> None:
        self.shape = V31_SHAPE if v31 else V3_SHAPE

    def scan(
        self, section: str, final: bool, schemas: Schemas, cache: Cache | None = None
    ) -> SectionScan:
        out = SectionScan()
        at = 0
        while True:
            at = skip_space(section, at)
            rest = section[at:]
            if rest.startswith(DS_CALLS_END):
                out.end, out.bad = at + len(DS_CALLS_END), not out.calls
                return out
            if not rest.startswith(DS_CALL_BEGIN):
                if (DS_CALLS_END.startswith(rest) or DS_CALL_BEGIN.startswith(rest)) and not final:
                    return out
                if final and not rest and out.calls:
                    out.end = at
                    return out
                out.bad = not out.calls
                out.end = None if out.bad else at
                return out
            call, end = _call(section, at + len(DS_CALL_BEGIN), final, cache)
            if call is None:
                out.bad = not out.calls
                out.end = None if out.bad else at
                return out
            out.calls.append(call)
            if end is None:
                return out
            at = end


def _call(
    section: str, at: int, final: bool, cache: Cache | None
) -> tuple[PartialCall | None, int | None]:
    """One call from after its begin marker: (the call so far or None when it is not one,
    just past its end marker)."""
    call = PartialCall()
    sep = section.find(DS_SEP, at)
    if sep < 0:
        return (None, None) if DS_CALL_END in section[at:] or final else (call, None)
    head, at = section[at:sep], sep + len(DS_SEP)
    if head == "function":  # V3: the type, then the name and a fenced JSON block
        newline = section.find("\n", at)
        if newline < 0:
            return (None, None) if final else (call, None)
        call.name = section[at:newline]
        if not FENCE_OPEN.startswith(section[newline : newline + len(FENCE_OPEN)]):
            return None, None
        at = newline + len(FENCE_OPEN)
        tail = FENCE_CLOSE + DS_CALL_END
    else:  # V3.1: the name, then the JSON
        call.name = head
        tail = DS_CALL_END
    if at >= len(section):
        return (None, None) if final else (call, None)
    value = value_at(section, at, final, cache)
    if value.kind != "object":
        return None, None
    call.arguments = section[at : at + (value.end or value.scanned)]
    if value.end is None:
        return (call, None) if not final else (call, len(section))
    call.done = True
    after = at + value.end
    if section.startswith(tail, after):
        return call, after + len(tail)
    if tail.startswith(section[after:]) and not final:
        return call, None
    return call, after if final else None

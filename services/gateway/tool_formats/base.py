"""What every tool-call format gives: how its calls open in the output, how a call
section reads (a pure function of its text so far), how one call is written, and so the
grammar that forces calls in that format.

A format's output is content, then a call section opened by one of its `starts` (or, for
Llama's bare JSON, by the output itself), then possibly more content or sections. The
streaming driver (tool_call_parser.py) finds the sections; the format reads them.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spillway.shared.output_formats import TOOL_CALL_SYNTAX

Schemas = Mapping[str, dict[str, Any]]  # function name -> its parameters' schema


@dataclass
class PartialCall:
    """One call as far as it is written: its name once whole, the text of its arguments
    that is final (a prefix of what follows), and `done` when the call is whole (then
    `arguments` is all of them)."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass
class SectionScan:
    """A call section's reading: its calls so far; `end`, where the section ended in its
    text (what follows is outside it again); `bad`, the section is not calls (its text
    is content, unless a call's name was already streamed)."""

    calls: list[PartialCall] = field(default_factory=list)
    end: int | None = None
    bad: bool = False


@dataclass(frozen=True)
class CallShape:
    """How calls are written, for the grammar that forces them: `open`, the calls
    (`begin(name)`, the arguments, `close`) separated by `separator`, then `finish`.
    `xml`: the arguments are Qwen3-Coder's `<parameter=...>` lines, not JSON."""

    open: str
    begin: str
    close: str
    separator: str
    finish: str
    trigger: str  # what opens a call in free text (auto with a strict function)
    xml: bool = False

    def begin_for(self, name: str) -> str:
        return self.begin.replace("{name}", name)


def list_shape(start: str) -> CallShape:
    """`start`, then a JSON list of call objects (Mistral v3, Granite 3)."""
    return CallShape(
        open=start + "[",
        begin='{"name": "{name}", "arguments": ',
        close="}",
        separator=", ",
        finish="]",
        trigger=start,
    )


class ToolFormat(ABC):
    name: str = ""
    starts: tuple[str, ...] = ()
    shape: CallShape

    @property
    def words(self) -> tuple[str, ...]:
        """Every marker the format writes (shared.output_formats)."""
        return TOOL_CALL_SYNTAX[self.name].words  # type: ignore[index]

    def opening(self, text: str) -> tuple[int, int] | bool | None:
        """A section the output itself opens (not by a start marker): (where, length of
        the opener); False when it cannot open one any more; None when undecided."""
        return False

    @abstractmethod
    def scan(
        self, section: str, final: bool, schemas: Schemas, cache: dict[int, Any] | None = None
    ) -> SectionScan:
        """Reads the section's text (what follows its start marker); `final`: the output
        ended here; `cache`: the JSON scans of this section's text so far (it only grew)."""

    def write(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the model writes it (and as the forcing grammar lets it)."""
        shape = self.shape
        body = self.write_arguments(arguments)
        return shape.open + shape.begin_for(name) + body + shape.close + shape.finish

    def write_arguments(self, arguments: dict[str, Any]) -> str:
        return dumps(arguments)

    def new_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)

"""The model's output formats: how it writes tool calls and how it marks its reasoning.

The gateway parses them and the worker tracks their regions and keeps their marker
tokens in grammars, so both read the same choice from here: `--tool-call-parser` and
`--reasoning-parser` (vLLM's names) when given, else what the chat template shows.

Tool-call format from the template (the first rule that matches):

    `<function=` and `<parameter=`  qwen3_xml    (Qwen3-Coder)
    `tool▁calls▁begin`              deepseek_v3  (DeepSeek-V3, V3.1, R1)
    `[TOOL_CALLS]`                  mistral
    `<|tool_call|>`                 granite      (Granite 3.x)
    `<|python_tag|>`, or Llama's    llama3_json  (Llama 3.1 / 3.2 / 3.3)
    "parameters": dictionary sentence
    anything else                   hermes       (Qwen2.5/3, Granite 4, Hermes, no template)

Reasoning format: `Here is my thought process:` in the template is granite; else a
think pair (`<think>`..`</think>`, or `<thinking>`..`</thinking>`) that is a pair of single
tokens of the vocabulary or appears in the template is deepseek_r1 when the template is
DeepSeek's (`｜Assistant｜`), qwen3 otherwise; else the model has no reasoning markers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ToolCallParserName = Literal[
    "hermes", "llama3_json", "mistral", "qwen3_xml", "deepseek_v3", "granite"
]
ReasoningParserName = Literal["deepseek_r1", "qwen3", "granite"]
TOOL_CALL_PARSERS: tuple[ToolCallParserName, ...] = (
    "hermes",
    "llama3_json",
    "mistral",
    "qwen3_xml",
    "deepseek_v3",
    "granite",
)
REASONING_PARSERS: tuple[ReasoningParserName, ...] = ("deepseek_r1", "qwen3", "granite")

TokenId = Callable[[str], "int | None"]

DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


@dataclass(frozen=True)
class ToolCallSyntax:
    """What the worker needs of a tool-call format: the region its calls occupy (`end`
    None: the calls run to the end of the output) and every marker it writes (kept in
    grammars and in the decoded text when they are special tokens)."""

    start: str
    end: str | None
    words: tuple[str, ...]


TOOL_CALL_SYNTAX: dict[ToolCallParserName, ToolCallSyntax] = {
    "hermes": ToolCallSyntax("<tool_call>", "</tool_call>", ("<tool_call>", "</tool_call>")),
    "llama3_json": ToolCallSyntax("<|python_tag|>", None, ("<|python_tag|>",)),
    "mistral": ToolCallSyntax("[TOOL_CALLS]", None, ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
    "qwen3_xml": ToolCallSyntax("<tool_call>", "</tool_call>", ("<tool_call>", "</tool_call>")),
    "deepseek_v3": ToolCallSyntax(
        DS_CALLS_BEGIN,
        DS_CALLS_END,
        (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP),
    ),
    "granite": ToolCallSyntax("<|tool_call|>", None, ("<|tool_call|>",)),
}


@dataclass(frozen=True)
class ReasoningSyntax:
    """How a model marks its reasoning. `starts`/`ends`: the texts that open and close it
    (the first of each is the one grammars and region tracking use); `anywhere`: a block
    may open anywhere in the output (else only before any content); `opened`: the output
    starts inside a block unless the generation prompt closed one (DeepSeek-R1's template
    opens it, and R1 does not repeat the opening tag)."""

    name: str
    starts: tuple[str, ...]
    ends: tuple[str, ...]
    anywhere: bool = True
    opened: bool = False


THINK_PAIRS = (("<think>", "</think>"), ("<thinking>", "</thinking>"))
GRANITE_THINK = ("Here is my thought process:", "Here's my thought process:")
GRANITE_RESPONSE = ("Here is my response:", "Here's my response:")


def reasoning_syntax(name: ReasoningParserName, pair: tuple[str, str] = THINK_PAIRS[0]):
    if name == "granite":
        return ReasoningSyntax("granite", GRANITE_THINK, GRANITE_RESPONSE, anywhere=False)
    return ReasoningSyntax(name, (pair[0],), (pair[1],), opened=name == "deepseek_r1")


def detect_tool_call_parser(template: str | None) -> ToolCallParserName:
    """The tool-call format the chat template shows (see the module's table)."""
    text = template or ""
    if "<function=" in text and "<parameter=" in text:
        return "qwen3_xml"
    if "tool▁calls▁begin" in text:
        return "deepseek_v3"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|tool_call|>" in text:
        return "granite"
    if "<|python_tag|>" in text or '"parameters": dictionary of argument name' in text:
        return "llama3_json"
    return "hermes"


def detect_reasoning(
    token_id: TokenId, template: str | None, name: ReasoningParserName | None = None
) -> ReasoningSyntax | None:
    """The reasoning format: `name` when given, else what the template and vocabulary
    show (see the module's text); None when the model has no reasoning markers."""
    text = template or ""
    if name == "granite" or (name is None and GRANITE_THINK[0] in text):
        return reasoning_syntax("granite")
    pair = next(
        (
            (start, end)
            for start, end in THINK_PAIRS
            if (token_id(start) is not None and token_id(end) is not None)
            or (start in text and end in text)
        ),
        None,
    )
    if name is not None:
        return reasoning_syntax(name, pair or THINK_PAIRS[0])
    if pair is None:
        return None
    return reasoning_syntax("deepseek_r1" if "｜Assistant｜" in text else "qwen3", pair)

"""Tools in a chat request: what the chat template sees, what the output must follow, and
how the output is read back (tool_call_parser.py, in the model's format: tool_formats/).

- The template gets `tools` (OpenAI's shape, as transformers passes them) and the
  conversation with earlier calls' arguments as objects that also read as their JSON
  text (templates differ in which they expect: `tojson` on one, `+` on the other).
- A template that does not know tools gets the fallback: the tool list and the format's
  way of writing a call in the system message, earlier calls written out in the
  assistant's text, and tool results as user turns in `<tool_response>` tags.
- `tool_choice`: "auto" lets the model choose (calls are parsed from its text); "none"
  shows the tools but parses nothing; "required" and a named function are enforced by a
  grammar in the model's format: the output is one call (up to MAX_FORCED_CALLS with
  `parallel_tool_calls: true` given explicitly: a small model asked for "one or more"
  tends to repeat itself until its token budget runs out) and nothing else, its
  arguments valid under the function's schema. With "auto" and a function marked
  `strict`, every call the model opens is enforced (all calls open with the same text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from spillway.services.gateway.errors import invalid
from spillway.services.gateway.schemas import ChatCompletionRequest, Tool
from spillway.services.gateway.structured_output import GrammarBuilder, check_schema
from spillway.services.gateway.tool_formats import ToolFormat

# Calls one forced response may hold when parallel calls are allowed.
MAX_FORCED_CALLS = 4

FALLBACK_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

{how}"""
HERMES_HOW = """For each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""
OTHER_HOW = "For each function call, write it exactly in this form:\n"


@dataclass(frozen=True)
class ToolSetup:
    """What a request's tools change: the template's inputs, the grammar, the parsing."""

    tools: list[dict[str, Any]]  # OpenAI's shape
    format: ToolFormat  # how calls are written in the output
    schemas: dict[str, dict[str, Any]]  # function name -> its parameters' schema
    grammar: str | None  # EBNF the output must follow
    parse: bool  # read tool calls out of the output
    parallel: bool


def tool_setup(
    req: ChatCompletionRequest, builder: GrammarBuilder, fmt: ToolFormat
) -> ToolSetup | None:
    """None when the request has no tools (its tool_choice must then allow that)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs `tools`", "tool_choice")
        return None
    tools = req.tools
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise invalid(f"tools: the function name `{duplicate}` is used twice", "tools")
    parallel = req.parallel_tool_calls is not False
    grammar = None
    if choice == "required" or not isinstance(choice, (str, type(None))):
        forced = list(enumerate(tools))
        if not isinstance(choice, str) and choice is not None:
            forced = [(i, t) for i, t in forced if t.function.name == choice.function.name]
            if not forced:
                raise invalid(
                    f"tool_choice names `{choice.function.name}`, which is not in `tools`",
                    "tool_choice",
                )
        several = req.parallel_tool_calls is True
        grammar = str(forced_calls(builder, fmt, forced, several))
    elif choice in (None, "auto") and any(t.function.strict for t in tools):
        grammar = str(strict_calls(builder, fmt, tools))
    return ToolSetup(
        tools=[t.model_dump(exclude_none=True) for t in tools],
        format=fmt,
        schemas={t.function.name: _parameters(t) for t in tools},
        grammar=grammar,
        parse=choice != "none",
        parallel=parallel,
    )


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_calls(
    builder: GrammarBuilder, fmt: ToolFormat, tools: list[tuple[int, Tool]], parallel: bool
) -> Any:
    """One call (up to MAX_FORCED_CALLS with parallel calls) to one of `tools`, written
    in the format, and nothing else. tools: (index in the request, tool)."""
    shape = fmt.shape
    calls = []
    for i, tool in tools:
        param = f"tools[{i}].function.parameters"
        check_schema(_parameters(tool), param)  # reported relative to the parameters
        if shape.xml:
            arguments = builder.xml_arguments(_parameters(tool), param)
        else:
            arguments = builder.json_schema(_parameters(tool), bool(tool.function.strict), param)
        begin = builder.literal(shape.begin_for(tool.function.name))
        calls.append(builder.concat(begin, arguments, *builder.literals(shape.close)))
    many = builder.repeat(
        builder.union(*calls), shape.separator, MAX_FORCED_CALLS if parallel else 1
    )
    return builder.concat(*builder.literals(shape.open), many, *builder.literals(shape.finish))


def strict_calls(builder: GrammarBuilder, fmt: ToolFormat, tools: list[Tool]) -> Any:
    """Free text; a call, once opened, names one of the functions and follows its schema
    (every function's: a call to any of them opens with the same text)."""
    shape = fmt.shape
    items = [
        (shape.open + shape.begin_for(t.function.name), _parameters(t), shape.close + shape.finish)
        for t in tools
    ]
    return builder.triggered(items, shape.trigger, "tools", xml=shape.xml)


# --- the conversation for the template ---------------------------------------------------


def template_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    native: bool,
    fmt: ToolFormat,
) -> list[dict[str, Any]]:
    """The messages as the template must see them: `native` (the template knows tools)
    gets earlier calls' arguments as objects; any other gets the fallback (the tool list in
    the system message when there are tools, calls and results written out as text)."""
    messages = [_with_object_arguments(i, m) for i, m in enumerate(messages)]
    if native:
        return messages
    return _fallback_messages(messages, tools, fmt)


class TemplateArguments(dict[str, Any]):
    """A call's arguments for a template: a mapping (`tojson`, `items`), that is also its
    JSON text where a template joins it to a string (DeepSeek's, Qwen's `is string`
    aside) or prints it."""

    def __init__(self, value: dict[str, Any], text: str) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other: Any) -> Any:
        return self.text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + self.text if isinstance(other, str) else NotImplemented


def _with_object_arguments(index: int, message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for j, call in enumerate(calls):
        function = dict(call["function"])
        param = f"messages[{index}].tool_calls[{j}].function.arguments"
        try:
            value = json.loads(function["arguments"])
        except json.JSONDecodeError as e:
            raise invalid(f"{param} is not valid JSON: {e}", param) from e
        text = function["arguments"]
        function["arguments"] = TemplateArguments(value, text) if isinstance(value, dict) else value
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def _fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolFormat
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        how = HERMES_HOW
        if fmt.name != "hermes":
            how = OTHER_HOW + fmt.write("function_name", {"argument": "value"})
        prompt = FALLBACK_PROMPT.format(tools=listed, how=how)
        if messages and messages[0]["role"] in ("system", "developer"):
            first = messages[0]
            out.append({**first, "content": f"{first['content']}\n\n{prompt}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
            continue
        if message.get("tool_calls"):
            written = [
                fmt.write(c["function"]["name"], dict(c["function"]["arguments"]))
                for c in message["tool_calls"]
            ]
            text = "\n".join(filter(None, [message.get("content") or "", *written]))
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = text
        out.append(message)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def template_knows_tools(source: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable)."""
    return bool(source) and re.search(r"\btools\b", source or "") is not None

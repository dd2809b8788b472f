"""Tools in a chat request: what the chat template sees, what the output must follow, and
how the output is read back (`tool_call_parser`).

- The template gets `tools` (OpenAI's shape, as transformers passes them) and the
  conversation with earlier calls' arguments as objects, as templates expect them.
- A template that does not know tools gets the fallback, Hermes style: the tool list and
  the `<tool_call>` format in the system message, earlier calls written out in the
  assistant's text, and tool results as user turns in `<tool_response>` tags.
- `tool_choice`: "auto" lets the model choose (calls are parsed from its text); "none"
  shows the tools but parses nothing; "required" and a named function are enforced by a
  grammar: the output is one call (up to MAX_FORCED_CALLS with `parallel_tool_calls: true`
  given explicitly: a small model asked for "one or more" tends to repeat itself until its
  token budget runs out) and nothing else, its arguments valid under the function's
  schema. With "auto" and a function marked `strict`, every call the model opens is
  enforced (all calls open with the same tag).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from spillway.services.gateway.errors import invalid
from spillway.services.gateway.schemas import ChatCompletionRequest, Tool
from spillway.services.gateway.structured_output import GrammarBuilder, check_schema

# Calls one forced response may hold when parallel calls are allowed.
MAX_FORCED_CALLS = 4

FALLBACK_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
{start}{end} XML tags:
{start}
{{"name": <function-name>, "arguments": <args-json-object>}}
{end}"""


@dataclass(frozen=True)
class ToolSetup:
    """What a request's tools change: the template's inputs, the grammar, the parsing."""

    tools: list[dict[str, Any]]  # OpenAI's shape
    tags: tuple[str, str]  # what opens and closes a call in the output
    grammar: str | None  # EBNF the output must follow
    parse: bool  # read tool calls out of the output
    parallel: bool


def tool_setup(
    req: ChatCompletionRequest, builder: GrammarBuilder, markers: tuple[str, str] | None
) -> ToolSetup | None:
    """None when the request has no tools (its tool_choice must then allow that)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs `tools`", "tool_choice")
        return None
    if markers is None:
        raise invalid("this model profile has no tool-call markers: tools cannot be used", "tools")
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
        grammar = str(_forced_calls(builder, forced, markers, several))
    elif choice in (None, "auto") and any(t.function.strict for t in tools):
        grammar = str(_strict_calls(builder, tools, markers))
    return ToolSetup(
        tools=[t.model_dump(exclude_none=True) for t in tools],
        tags=markers,
        grammar=grammar,
        parse=choice != "none",
        parallel=parallel,
    )


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _forced_calls(
    builder: GrammarBuilder,
    tools: list[tuple[int, Tool]],
    markers: tuple[str, str],
    parallel: bool,
) -> Any:
    """`start` + one call object + `end`, repeated up to MAX_FORCED_CALLS times (once
    without parallel calls), and nothing else. tools: (index in the request, tool)."""
    start, end = markers
    calls = []
    for i, tool in tools:
        param = f"tools[{i}].function.parameters"
        check_schema(_parameters(tool), param)  # reported relative to the parameters
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": _parameters(tool),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        calls.append(builder.json_schema(schema, bool(tool.function.strict), param))
    one = builder.concat(
        builder.literal(start + "\n"), builder.union(*calls), builder.literal("\n" + end)
    )
    return builder.repeat(one, "\n", MAX_FORCED_CALLS if parallel else 1)


def _strict_calls(builder: GrammarBuilder, tools: list[Tool], markers: tuple[str, str]) -> Any:
    """Free text; a call, once opened, names one of the functions and follows its schema
    (every function's: a call to any of them opens with the same tag)."""
    start, end = markers
    items = [
        (
            f'{start}\n{{"name": {json.dumps(t.function.name)}, "arguments": ',
            _parameters(t),
            f"}}\n{end}",
        )
        for t in tools
    ]
    return builder.triggered(items, start, "tools")


# --- the conversation for the template ---------------------------------------------------


def template_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    native: bool,
    markers: tuple[str, str] | None,
) -> list[dict[str, Any]]:
    """The messages as the template must see them: `native` (the template knows tools)
    gets earlier calls' arguments as objects; any other gets the fallback (the tool list in
    the system message when there are tools, calls and results written out as text)."""
    messages = [_with_object_arguments(i, m) for i, m in enumerate(messages)]
    if native or markers is None:
        return messages
    return _fallback_messages(messages, tools, markers)


def _with_object_arguments(index: int, message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for j, call in enumerate(calls):
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError as e:
            param = f"messages[{index}].tool_calls[{j}].function.arguments"
            raise invalid(f"{param} is not valid JSON: {e}", param) from e
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def _fallback_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, markers: tuple[str, str]
) -> list[dict[str, Any]]:
    start, end = markers
    out: list[dict[str, Any]] = []
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = FALLBACK_PROMPT.format(tools=listed, start=start, end=end)
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
                f"{start}\n{json.dumps(_call_object(c), ensure_ascii=False)}\n{end}"
                for c in message["tool_calls"]
            ]
            text = "\n".join(filter(None, [message.get("content") or "", *written]))
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = text
        out.append(message)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _call_object(call: dict[str, Any]) -> dict[str, Any]:
    return {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def template_knows_tools(source: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable)."""
    return bool(source) and re.search(r"\btools\b", source or "") is not None

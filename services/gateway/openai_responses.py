"""OpenAI's Responses API (`POST /v1/responses`), stateless, over chat completions.

A request becomes a chat-completions body (`instructions` a system message, `input` the
messages, function tools and their calls and outputs, `reasoning.effort`, `text.format`),
runs as one choice, and its answer becomes a `response` object whose `output` lists a
`reasoning` item (a model that thinks), a `message` item (text) and a `function_call`
item per call, in that order. Streamed, the chat chunks become OpenAI's events:

    response.created, response.in_progress
    per item: response.output_item.added
      reasoning: response.reasoning_text.delta ... response.reasoning_text.done
      message:   response.content_part.added, response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      call:      response.function_call_arguments.delta ...,
                 response.function_call_arguments.done
    response.output_item.done
    response.completed (or response.incomplete when max_output_tokens ran out)

Nothing is stored: `previous_response_id`, `conversation` and `background` are refused by
name, and `store` is accepted and ignored like the other bookkeeping fields.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from spillway.services.gateway.errors import ApiError, invalid
from spillway.services.gateway.request_fields import warn_unknown

IGNORED = {
    "store", "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "include", "truncation",
    "max_tool_calls", "stream_options", "context_management", "moderation",
    "background_options", "access_programs",
}  # fmt: skip
STATEFUL = {"previous_response_id", "conversation", "prompt"}
PASSED = {"model", "temperature", "top_p", "parallel_tool_calls", "stream", "top_logprobs"}
# The chat field a 400 names, as this API names it.
PARAM_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
_TEXT_PART_TYPES = {"input_text", "output_text", "text"}


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body that runs this Responses request; a 400 naming the
    field for anything it cannot express."""
    chat: dict[str, Any] = {"n": 1}
    unknown = []
    for name, value in body.items():
        if name in IGNORED:
            continue
        if name in STATEFUL:
            if value is not None:
                raise invalid(f"{name}: this server keeps no responses (stateless)", name)
        elif name == "background":
            if value:
                raise invalid("background: responses run in the foreground here", name)
        elif name in PASSED:
            chat[name] = value
        elif name == "input":
            chat["messages"] = _messages(value)
        elif name == "instructions":
            if value is not None and not isinstance(value, str):
                raise invalid("instructions: a string", "instructions")
        elif name == "max_output_tokens":
            chat["max_completion_tokens"] = value
        elif name == "tools":
            chat["tools"] = _tools(value)
        elif name == "tool_choice":
            chat["tool_choice"] = _tool_choice(value)
        elif name == "reasoning":
            effort = _object(value, "reasoning").get("effort")
            if effort is not None:
                chat["reasoning_effort"] = effort
        elif name == "text":
            form = _object(value, "text").get("format")
            if form is not None:
                chat["response_format"] = _response_format(form)
        else:
            unknown.append(name)
    if unknown:
        warn_unknown(unknown)
    if "messages" not in chat:
        raise invalid("input is required", "input")
    if body.get("instructions"):
        chat["messages"].insert(0, {"role": "system", "content": body["instructions"]})
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def renamed(error: ApiError) -> ApiError:
    """A chat field's error under this API's name for the field."""
    if error.param is None:
        return error
    head, dot, rest = error.param.partition(".")
    head, bracket, index = head.partition("[")
    name = PARAM_NAMES.get(head)
    if name is None:
        return error
    param = name + bracket + index + dot + rest
    message = error.message.replace(error.param, param, 1)
    return ApiError(error.status, message, param, error.code, error.error_type)


def _object(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"{param}: an object", param)
    return value


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param}: a string or a list of text parts", param)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PART_TYPES:
            raise invalid(f"{param}[{i}]: only text parts are supported", f"{param}[{i}]")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{param}[{i}].text: a string", f"{param}[{i}].text")
        texts.append(text)
    return "\n".join(texts)


def _messages(given: Any) -> list[dict[str, Any]]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise invalid("input: a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{param}: an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(
                {
                    "role": item.get("role"),
                    "content": _text(item.get("content"), f"{param}.content"),
                }
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": _text(output, f"{param}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # an earlier answer's reasoning: templates drop it
        else:
            raise invalid(f"{param}.type: {kind!r} items are not supported", f"{param}.type")
    return messages


def _tools(given: Any) -> list[dict[str, Any]]:
    if given is None:
        return []
    if not isinstance(given, list):
        raise invalid("tools: a list", "tools")
    tools = []
    for i, tool in enumerate(given):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(
                f"tools[{i}].type: only function tools are served (not {kind!r})",
                f"tools[{i}].type",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(given: Any) -> Any:
    if isinstance(given, dict) and given.get("type") == "function":
        return {"type": "function", "function": {"name": given.get("name")}}
    return given


def _response_format(form: Any) -> dict[str, Any]:
    form = _object(form, "text.format")
    if form.get("type") != "json_schema":
        return form
    schema = {k: v for k, v in form.items() if k != "type"}
    return {"type": "json_schema", "json_schema": schema}


# --- the response --------------------------------------------------------------------


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    details = chat_usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        # cache_write_tokens: what a paid prompt cache billed for writing; none here.
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [output_text(text)] if status == "completed" else [],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class ResponseShell:
    """The fields of a `response` object that do not depend on the output."""

    request: dict[str, Any]
    model: str
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        output: list[dict[str, Any]],
        status: str,
        usage: dict[str, Any] | None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        req = self.request
        incomplete = status == "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.get("instructions"),
            "metadata": req.get("metadata") or {},
            "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "temperature": req.get("temperature"),
            "top_p": req.get("top_p"),
            "tool_choice": req.get("tool_choice") or "auto",
            "tools": req.get("tools") or [],
            "max_output_tokens": req.get("max_output_tokens"),
            "previous_response_id": None,
            "reasoning": req.get("reasoning"),
            "text": req.get("text") or {"format": {"type": "text"}},
            "store": False,
            "usage": usage,
        }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_body(shell: ResponseShell, chat: dict[str, Any]) -> dict[str, Any]:
    """The whole response for a chat completion's body (one choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(_new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        output.append(message_item(_new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(call_item(_new_id("fc"), call["id"], function["name"], function["arguments"]))
    finish = choice["finish_reason"]
    return shell.body(output, status_of(finish), _usage(chat["usage"]), finish)


class ResponseEvents:
    """Chat chunks in, Responses events out (see the module's docstring)."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        body = self.shell.body([], "in_progress", None)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._stream("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._stream("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    events += self._close()
                    events += self._open_call(call)
                arguments = (call.get("function") or {}).get("arguments") or ""
                if arguments:
                    events += self._stream("function_call", arguments)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def closing(self) -> list[dict[str, Any]]:
        events = self._close()
        status = status_of(self.finish_reason)
        body = self.shell.body(self.output, status, self.usage, self.finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=body)]

    def _stream(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._open(kind)
        assert self.open is not None
        self.text += piece
        index = len(self.output)
        at = {"item_id": self.open["id"], "output_index": index}
        if kind == "reasoning":
            events.append(
                self._event("response.reasoning_text.delta", **at, content_index=0, delta=piece)
            )
        elif kind == "message":
            events.append(
                self._event(
                    "response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[]
                )
            )
        else:
            events.append(self._event("response.function_call_arguments.delta", **at, delta=piece))
        return events

    def _open(self, kind: str) -> list[dict[str, Any]]:
        index = len(self.output)
        if kind == "reasoning":
            self.open = {**reasoning_item(_new_id("rs"), ""), "status": "in_progress"}
            self.open["content"] = []
        else:
            self.open = message_item(_new_id("msg"), "", "in_progress")
        self.text = ""
        events = [self._event("response.output_item.added", output_index=index, item=self.open)]
        if kind == "message":
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self.open["id"],
                    output_index=index,
                    content_index=0,
                    part=output_text(""),
                )
            )
        return events

    def _open_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        name = (call.get("function") or {}).get("name") or ""
        self.open = call_item(_new_id("fc"), call["id"], name, "", "in_progress")
        self.text = ""
        index = len(self.output)
        return [self._event("response.output_item.added", output_index=index, item=self.open)]

    def _close(self) -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        self.open = None
        index = len(self.output)
        at = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], self.text)
            events.append(
                self._event("response.reasoning_text.done", **at, content_index=0, text=self.text)
            )
        elif item["type"] == "message":
            done = message_item(item["id"], self.text)
            part = output_text(self.text)
            events.append(
                self._event(
                    "response.output_text.done", **at, content_index=0, text=self.text, logprobs=[]
                )
            )
            events.append(
                self._event("response.content_part.done", **at, content_index=0, part=part)
            )
        else:
            done = call_item(item["id"], item["call_id"], item["name"], self.text)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **at,
                    name=item["name"],
                    arguments=self.text,
                )
            )
        self.output.append(done)
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        return events


async def response_events(
    shell: ResponseShell, chunks: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    events = ResponseEvents(shell)
    for event in events.opening():
        yield event
    async for chunk in chunks:
        for event in events.chunk(chunk):
            yield event
    for event in events.closing():
        yield event

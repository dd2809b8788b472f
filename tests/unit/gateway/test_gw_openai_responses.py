"""The Responses API's translation, pure: a request into a chat body, a chat body into a
response, chat chunks into OpenAI's events (reasoning, text and calls in turn)."""

from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from spillway.services.gateway.errors import ApiError, invalid
from spillway.services.gateway.openai_responses import (
    ResponseEvents,
    ResponseShell,
    chat_body,
    renamed,
    response_body,
)

USAGE = {
    "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 2},
    "completion_tokens_details": {"reasoning_tokens": 3},
}  # fmt: skip
EVENT = TypeAdapter(ResponseStreamEvent)


def test_a_request_becomes_a_chat_body():
    chat = chat_body({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "store": True,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "reasoning": {"effort": "high"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    })  # fmt: skip
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][1] == {"role": "user", "content": "Hi"}
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    assert len(chat["messages"]) == 4 and "store" not in chat
    assert chat["max_completion_tokens"] == 9 and chat["reasoning_effort"] == "high"
    assert chat["tools"][0]["function"]["name"] == "f"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["name"] == "x"


def test_a_chat_error_is_named_as_this_api_names_the_field():
    error = renamed(invalid("max_completion_tokens: too small", "max_completion_tokens"))
    assert error.param == "max_output_tokens" and error.message.startswith("max_output_tokens")
    assert renamed(invalid("x", "messages[2].content")).param == "input[2].content"
    with pytest.raises(ApiError) as caught:
        chat_body({"input": "x", "conversation": "conv_1"})
    assert caught.value.param == "conversation"


def test_a_whole_response_lists_reasoning_text_and_calls_in_turn():
    chat = {"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me look.", "reasoning_content": "Hmm.",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}],
        "usage": USAGE}  # fmt: skip
    body = response_body(ResponseShell({"input": "x"}, "m"), chat)
    r = Response.model_validate(body)  # the SDK's own type, strictly
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output_text == "Let me look." and r.status == "completed"
    assert r.usage.input_tokens_details.cached_tokens == 2
    assert r.usage.output_tokens_details.reasoning_tokens == 3


def _chunk(delta=None, finish=None, usage=None):
    choices = [] if delta is None and finish is None else [
        {"index": 0, "delta": delta or {}, "finish_reason": finish}]  # fmt: skip
    return {"choices": choices, "usage": usage}


def test_chunks_become_events_in_openai_order():
    events = ResponseEvents(ResponseShell({"input": "x"}, "m"))
    out = events.opening()
    for chunk in (
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "Think"}),
        _chunk({"reasoning_content": "ing."}),
        _chunk({"content": "Hello"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        _chunk(finish="tool_calls"),
        _chunk(usage=USAGE),
    ):  # fmt: skip
        out += events.chunk(chunk)
    out += events.closing()
    parsed = [EVENT.validate_python(e) for e in out]  # each one the SDK's own type
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    final = parsed[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Thinking."
    assert final.output[2].arguments == '{"a": 1}' and final.output[2].call_id == "call_1"
    assert final.usage.total_tokens == 12

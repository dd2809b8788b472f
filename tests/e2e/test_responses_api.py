"""/v1/responses against a real running system (SmolLM2-135M-Instruct) through the
official openai SDK: text in, text out equal to the same chat completion's; a forced
function call as a `function_call` item, streamed and not; the call's output sent back;
the `responses.stream` helper; /tokenize agreeing with the prompt the chat request ran."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def sdk(system):
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=600)


def test_greedy_text_equals_the_chat_completion(sdk):
    r = sdk.responses.create(
        model=MODEL, instructions="Answer briefly.", input="Name a river.",
        temperature=0, max_output_tokens=12, store=True, reasoning={"effort": "low"},
    )  # fmt: skip
    chat = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Name a river."}],
        temperature=0, max_tokens=12,
    )  # fmt: skip
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_forced_function_call_and_its_output_sent_back(sdk):
    r = sdk.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    assert set(json.loads(call.arguments)) == {"city"}
    follow = sdk.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
        tools=[WEATHER], max_output_tokens=8,
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete") and follow.usage.output_tokens > 0


def test_streamed_function_call_events_join_to_the_call(sdk):
    stream = sdk.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=80, temperature=0, stream=True,
    )  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments and json.loads(deltas)["city"]
    final = events[-1].response
    assert [i.type for i in final.output] == ["function_call"]
    assert final.output[0].arguments == deltas


def test_stream_helper_gives_the_final_call(sdk):
    # A forced call ends by its grammar: the response completes (a budget that runs out
    # ends it with response.incomplete, as OpenAI's does, which the helper does not return).
    with sdk.responses.stream(
        model=MODEL,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
    ) as stream:
        deltas = "".join(
            e.delta for e in stream if e.type == "response.function_call_arguments.delta"
        )
        final = stream.get_final_response()
    assert final.status == "completed"
    (call,) = final.output
    assert call.type == "function_call" and call.arguments == deltas


def test_a_streamed_text_cut_by_the_budget_ends_incomplete(sdk):
    with sdk.responses.stream(
        model=MODEL, input="Count to ten.", temperature=0, max_output_tokens=5
    ) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1]
    assert last.type == "response.incomplete" and text
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].content[0].text == text


def test_tokenize_counts_what_the_chat_request_runs(client):
    messages = [{"role": "user", "content": "Hello there"}]
    tokens = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"] == len(tokens["tokens"])
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "Hello there" in text


def test_todays_sdk_fields_are_accepted_and_change_nothing(sdk):
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6)
    busy = sdk.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6,
        store=True, metadata={"team": "a"}, service_tier="auto", user="u-1",
        safety_identifier="s-1", prompt_cache_key="k", reasoning_effort="low",
        prediction={"type": "content", "content": "Blue"}, parallel_tool_calls=True,
        modalities=["text"], extra_body={"not_in_any_api": 1},
    )  # fmt: skip
    assert busy.choices[0].message.content == plain.choices[0].message.content


def test_legacy_functions_are_answered_as_function_call_too(sdk):
    fn = {k: v for k, v in WEATHER.items() if k != "type"}
    r = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Lima?"}],
        functions=[fn], function_call={"name": "get_weather"}, max_tokens=80, temperature=0,
    )  # fmt: skip
    message = r.choices[0].message
    assert message.function_call.name == "get_weather"
    assert message.function_call.arguments == message.tool_calls[0].function.arguments
    stream = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Lima?"}],
        functions=[fn], function_call={"name": "get_weather"}, max_tokens=80, temperature=0,
        stream=True,
    )  # fmt: skip
    pieces = [c.choices[0].delta.function_call for c in stream if c.choices]
    pieces = [p for p in pieces if p is not None]
    assert pieces[0].name == "get_weather"
    assert "".join(p.arguments or "" for p in pieces) == message.function_call.arguments

"""What agent frameworks and apps send, against the default model (SmolLM2-135M-Instruct,
whose template knows no tools: the Hermes fallback prompt is used): forced tool calls over
HTTP, streamed through the official openai SDK and over NATS; structured output; the new
fields' bad values; logprobs in streams."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import nats
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
NS = "e2e"
CHAT = "/v1/chat/completions"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(system):
    """Long generations on a busy machine: a generous timeout."""
    with httpx.Client(base_url=system.url, timeout=900) as c:
        yield c


def check_calls(calls: list[dict], names: set[str]) -> None:
    """Each call names an offered tool and its arguments validate against its schema."""
    assert calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, schemas[call["function"]["name"]])


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_call_over_http(client, choice):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 80, "seed": 1}
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    (out,) = r.json()["choices"]
    assert out["finish_reason"] == "tool_calls"
    assert out["message"]["content"] is None
    names = {"get_weather"} if choice is NAMED else {"get_weather", "get_time"}
    check_calls(out["message"]["tool_calls"], names)
    assert len(out["message"]["tool_calls"]) == 1  # parallel calls were not asked for


@pytest.fixture(scope="module")
def openai_client(system):
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=900)


def test_forced_tool_call_streams_through_the_openai_sdk(openai_client):
    with openai_client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=80,
        temperature=0.7,
        seed=5,
    ) as stream:
        fragments = [
            event.arguments_delta
            for event in stream
            if event.type == "tool_calls.function.arguments.delta"
        ]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [c.model_dump() for c in choice.message.tool_calls]
    check_calls(calls, {"get_weather"})
    assert len(fragments) > 1  # the arguments arrived in pieces, as the SDK expects
    assert "".join(fragments) == calls[0]["function"]["arguments"]


async def _nats_generate(nats_url: str, body: dict) -> list[dict]:
    nc = await nats.connect(nats_url)
    try:
        if not body.get("stream"):
            reply = await nc.request(f"{NS}.llm.generate", json.dumps(body).encode(), timeout=900)
            return [json.loads(reply.data)]
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"{NS}.llm.generate", json.dumps(body).encode(), reply=inbox)
        chunks = []
        while True:
            msg = await sub.next_msg(timeout=900)
            chunks.append(json.loads(msg.data))
            if msg.headers and ("Spillway-Done" in msg.headers or "Spillway-Error" in msg.headers):
                return chunks
    finally:
        await nc.close()


def test_forced_tool_call_over_nats(system, nats_url):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80, "seed": 2}
    (whole,) = asyncio.run(_nats_generate(nats_url, body))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    check_calls(choice["message"]["tool_calls"], {"get_weather", "get_time"})
    chunks = asyncio.run(_nats_generate(nats_url, {**body, "stream": True}))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            for delta in c["delta"].get("tool_calls", []):
                call = calls.setdefault(delta["index"], {"type": "function", "function": {}})
                call.setdefault("id", delta.get("id"))
                fn = call["function"]
                fn["name"] = fn.get("name") or delta["function"].get("name")
                fn["arguments"] = fn.get("arguments", "") + delta["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    streamed = [calls[i] for i in sorted(calls)]
    check_calls(streamed, {"get_weather", "get_time"})
    # The same seed, the same call (ids are fresh per response).
    assert [c["function"] for c in streamed] == [
        c["function"] for c in choice["message"]["tool_calls"]
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "maxItems": 3,
        },
        "retired": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "retired"],
    "additionalProperties": False,
}


def test_json_schema_holds_for_twenty_seeds_at_temperature_one(client):
    def one(seed: int) -> dict:
        body = {
            "messages": [{"role": "user", "content": "Describe a person."}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 200,
        }
        r = client.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with ThreadPoolExecutor(max_workers=20) as pool:
        choices = list(pool.map(one, range(20)))
    people = []
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        person = json.loads(choice["message"]["content"])
        jsonschema.validate(person, PERSON)
        people.append(person)
    assert len({json.dumps(p, sort_keys=True) for p in people}) > 1  # the seeds mattered


def test_json_object_gives_json(client):
    body = {
        "messages": [{"role": "user", "content": "Give the name and age of a cat as JSON."}],
        "response_format": {"type": "json_object"},
        "temperature": 0,
        "max_tokens": 200,
    }
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


BAD = [
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"min_tokens": -2}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "dependentRequired": {}}}}}, "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"sampling_by_region": {"code": {"top_p": 0}}}, "sampling_by_region.code.top_p"),
    ({"audio": {"voice": "x"}}, "audio"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[b[1] for b in BAD])
def test_bad_values_are_400s_naming_the_field_and_serving_goes_on(client, fields, param):
    r = client.post(CHAT, json={"messages": ASK, "max_tokens": 2, **fields})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    ok = client.post(CHAT, json={"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


def test_logprobs_stream_as_they_come(client):
    body = {
        "messages": ASK,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "presence_penalty": 0.5,
    }
    whole = client.post(CHAT, json=body).json()["choices"][0]["logprobs"]["content"]
    streamed = []
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    assert len(whole) == 6
    assert [(e["token"], e["logprob"]) for e in streamed] == [
        (e["token"], e["logprob"]) for e in whole
    ]
    assert all(len(e["top_logprobs"]) == 2 for e in streamed)

"""A model that thinks and whose template knows tools, through the whole system: the
scripted think model (tests/unit/worker/think_llama.py) answers every chat greedily with
`<think>\\n Let me see</think> Paris is lovely.`, the think block opened by its
generation prompt."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from spillway.services.cli.launcher import System
from tests.unit.worker.think_llama import CONTENT, REASONING, save_think_llama

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Where shall we go?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "book_trip", "parameters": CITY}}]


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    return save_think_llama(tmp_path_factory.mktemp("think-model"))


@pytest.fixture(scope="module")
def think_client(nats_url, redis_url, think_dir):
    system = System(
        "--model", str(think_dir),
        "--namespace", "think",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "256",
        "--dtype", "float32",
    )  # fmt: skip
    with httpx.Client(base_url=system.url, timeout=300) as client:
        yield client
    assert system.stop() == 0, system.tail()


def test_reasoning_is_split_from_content(think_client):
    r = think_client.post(CHAT, json={"messages": ASK, "temperature": 0, "max_tokens": 30})
    body = r.json()
    (choice,) = body["choices"]
    assert choice["message"]["reasoning_content"] == REASONING
    assert choice["message"]["content"] == CONTENT
    assert choice["finish_reason"] == "stop"
    # " Let" " me" " see" "</think>" are reasoning; " Paris" " is" " lovely" "." EOS not.
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    assert body["usage"]["completion_tokens"] == 9


def test_streamed_deltas_split_the_same_way(think_client):
    body = {
        "messages": ASK,
        "temperature": 0,
        "max_tokens": 30,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reasoning, content, usage = [], [], None
    with think_client.stream("POST", CHAT, json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                reasoning.append(choice["delta"].get("reasoning_content") or "")
                content.append(choice["delta"].get("content") or "")
    assert "".join(reasoning) == REASONING
    assert "".join(content) == CONTENT
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_adaptive_sampling_per_request_changes_only_the_think_block(think_client):
    def reasoning(seed: int, by_region) -> str:
        body = {
            "messages": ASK,
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 6,
            "sampling_by_region": by_region,
        }
        message = think_client.post(CHAT, json=body).json()["choices"][0]["message"]
        return message["reasoning_content"] or ""

    greedy_inside = {"think": {"temperature": 0}}
    # Greedy inside the block, every seed follows the script; sampled freely, not.
    assert {reasoning(s, greedy_inside)[: len(REASONING)] for s in range(3)} == {REASONING}
    assert any(not reasoning(s, False).startswith(REASONING) for s in range(3))


def test_a_named_tool_call_after_thinking(think_client):
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "book_trip"}},
        "temperature": 0,
        "max_tokens": 60,
    }
    choice = think_client.post(CHAT, json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == REASONING  # the grammar starts after the block
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "book_trip"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


def test_tool_results_go_back_through_the_template(think_client, think_dir):
    from transformers import AutoTokenizer

    arguments = '{"city": "Paris", "days": 2}'
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "book_trip", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "booked: ref 42"},
    ]
    body = {"messages": history, "tools": TOOLS, "temperature": 0, "max_tokens": 12}
    r = think_client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    reference = AutoTokenizer.from_pretrained(str(think_dir))
    expected = [
        *history[:1],
        {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
            "name": "book_trip", "arguments": json.loads(arguments)}}]},
        history[2],
    ]  # fmt: skip
    ids = reference.apply_chat_template(
        expected, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["message"]["reasoning_content"] == REASONING

"""Server-sent events and the official openai client against the running system."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def _sse_events(client, path: str, body: dict) -> list[str]:
    events = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    return events


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streamed_chunks_join_to_the_non_streamed_text(client, path):
    if path.endswith("chat/completions"):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Name two colours."}]}
    else:
        body = {"model": MODEL, "prompt": "Two colours are"}
    body.update(max_tokens=32, temperature=0)
    whole = client.post(path, json=body).json()
    events = _sse_events(
        client, path, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0]["choices"] == []
    # The same counts; only what the prefix cache served differs (the second run may hit
    # the first one's blocks), and never more than the prompt.
    streamed, plain = usage_chunks[0]["usage"], whole["usage"]
    for usage in (streamed, plain):
        cached = usage.pop("prompt_tokens_details")["cached_tokens"]
        assert 0 <= cached < usage["prompt_tokens"]
    assert streamed == plain
    if path.endswith("chat/completions"):
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        want = whole["choices"][0]["message"]["content"]
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        want = whole["choices"][0]["text"]
    assert text == want and text
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == whole["choices"][0]["finish_reason"]
    assert all(f is None for f in finishes[:-1])


def test_stream_without_usage_option_has_no_usage_chunk(client):
    events = _sse_events(
        client, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True}
    )
    assert events[-1] == "[DONE]"
    assert not any(json.loads(e).get("usage") for e in events[:-1])


@pytest.fixture(scope="module")
def openai_client(system):
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0)


def test_openai_client_chat(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 10


def test_openai_client_completions(openai_client):
    r = openai_client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0
    )
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    assert "5" in r.choices[0].text


def test_openai_client_streaming(openai_client):
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces)
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens >= 1


def test_stop_string_ends_with_stop_and_is_not_returned(client):
    body = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 30, "temperature": 0}
    free = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert " 8," in free  # the model counts on
    r = client.post("/v1/completions", json={**body, "stop": [" 8"]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == free[: free.index(" 8")]


def test_n_choices_are_returned(client):
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "Colours:",
            "max_tokens": 6,
            "temperature": 1.0,
            "n": 3,
            "seed": 5,
            "ignore_eos": True,
        },
    ).json()
    assert sorted(c["index"] for c in r["choices"]) == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in r["choices"])
    assert r["usage"]["completion_tokens"] == 18
    assert len({c["text"] for c in r["choices"]}) > 1  # each choice samples on its own

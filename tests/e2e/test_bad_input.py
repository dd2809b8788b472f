"""Bad input gets the contract's status and an OpenAI error body; the service goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (name, path, json body or raw bytes, status)
    ("invalid json", CHAT, b'{"messages": [', 400),
    ("body not an object", CHAT, b"[1, 2]", 400),
    ("messages missing", CHAT, {"max_tokens": 3}, 400),
    ("messages empty", CHAT, {"messages": []}, 400),
    ("messages not a list", CHAT, {"messages": "hi"}, 400),
    ("message without content", CHAT, {"messages": [{"role": "user"}]}, 400),
    ("message with bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("temperature a string", CHAT, {"messages": MSG, "temperature": "hot"}, 400),
    ("temperature negative", CHAT, {"messages": MSG, "temperature": -0.5}, 400),
    ("temperature above 2", CHAT, {"messages": MSG, "temperature": 2.5}, 400),
    ("top_p above 1", CHAT, {"messages": MSG, "top_p": 1.5}, 400),
    ("top_p zero", CHAT, {"messages": MSG, "top_p": 0}, 400),
    ("top_k below -1", CHAT, {"messages": MSG, "top_k": -5}, 400),
    ("min_p above 1", CHAT, {"messages": MSG, "min_p": 1.5}, 400),
    ("max_tokens zero", CHAT, {"messages": MSG, "max_tokens": 0}, 400),
    ("max_tokens a float", CHAT, {"messages": MSG, "max_tokens": 2.5}, 400),
    ("n zero", CHAT, {"messages": MSG, "n": 0}, 400),
    ("top_logprobs above 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400),
    ("stop not a string", CHAT, {"messages": MSG, "stop": 5}, 400),
    ("deadline negative", CHAT, {"messages": MSG, "deadline_ms": -10}, 400),
    ("priority a string", CHAT, {"messages": MSG, "priority": "high"}, 400),
    ("unknown model", CHAT, {"messages": MSG, "model": "gpt-17"}, 404),
    ("prompt missing", COMP, {"max_tokens": 3}, 400),
    ("prompt empty", COMP, {"prompt": ""}, 400),
    ("prompt a dict", COMP, {"prompt": {"a": 1}}, 400),
    ("token id out of vocab", COMP, {"prompt": [1, 2, 10_000_000]}, 400),
    ("token id negative", COMP, {"prompt": [1, -3]}, 400),
    ("prompt over the context", COMP, {"prompt": [42] * 9000}, 400),
    ("prompt + max_tokens over the context", COMP, {"prompt": [42] * 8000, "max_tokens": 500},
     400),
    ("logprobs above 5 on completions", COMP, {"prompt": "x", "logprobs": 6}, 400),
    ("audio output", CHAT, {"messages": MSG, "modalities": ["text", "audio"]}, 400),
    ("n above the cap", CHAT, {"messages": MSG, "n": 17}, 400),
    ("echo on completions", COMP, {"prompt": "x", "echo": True}, 400),
    ("tools on completions", COMP, {"prompt": "x", "tools": []}, 400),
    ("responses: a stored response", "/v1/responses",
     {"input": "x", "previous_response_id": "resp_1"}, 400),
    ("responses: input missing", "/v1/responses", {"instructions": "x"}, 400),
    ("responses: a web search tool", "/v1/responses",
     {"input": "x", "tools": [{"type": "web_search"}]}, 400),
    ("responses: input a number", "/v1/responses", {"input": 5}, 400),
    ("tokenize: prompt a number", "/tokenize", {"prompt": 5}, 400),
    ("tokenize: body a list", "/tokenize", b"[1]", 400),
    ("detokenize: id out of vocab", "/detokenize", {"tokens": [10**9]}, 400),
]  # fmt: skip


@pytest.fixture(scope="module")
def log_start(system) -> int:
    """Where the system's log stood before this module's bad input."""
    return Path(system.log.name).stat().st_size


@pytest.mark.parametrize(("name", "path", "body", "status"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_error_body_then_good_request_succeeds(
    client, log_start, name, path, body, status
):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, (name, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "traceparent" in r.headers
    good = client.post(COMP, json={"prompt": "Hello", "max_tokens": 2})
    assert good.status_code == 200, good.text


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_unknown_route_is_404_with_error_body(client):
    r = client.post("/v1/nothing", json={})
    assert r.status_code == 404


def test_models_lists_the_served_model(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["SmolLM2-135M-Instruct"]


def test_no_bad_input_made_a_scheduler_or_worker_log_an_error(system, log_start):
    with open(system.log.name, errors="replace") as log:
        log.seek(log_start)
        lines = log.read().splitlines()
    errors = [line for line in lines if " ERROR " in line]
    assert not errors, errors[:5]

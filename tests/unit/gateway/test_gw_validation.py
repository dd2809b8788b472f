"""Request validation: bad input is a 400 (404 for an unknown model) with an OpenAI error
body, never anything else; good input becomes the right PreparedRequest."""

from __future__ import annotations

import json

import pytest

from spillway.services.gateway.errors import ApiError
from spillway.services.gateway.json_body import parse_json_body
from spillway.services.gateway.validation import ModelInfo, RequestPreparer, kind_of

MODEL = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "hi"}]
CONTEXT = 8192


@pytest.fixture(scope="module")
def preparer(tokenizer):
    info = ModelInfo(MODEL, context_length=CONTEXT, vocab_size=49152, aliases=frozenset({"alias"}))
    return RequestPreparer(tokenizer, info, random_seed=lambda: 777)


BAD_BODIES = [
    # (name, kind, body, status, param)
    ("messages missing", "chat", {"max_tokens": 3}, 400, "messages"),
    ("messages empty", "chat", {"messages": []}, 400, "messages"),
    ("messages not a list", "chat", {"messages": "hi"}, 400, "messages"),
    ("message not an object", "chat", {"messages": ["hi"]}, 400, "messages[0]"),
    ("content missing", "chat", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("content null", "chat", {"messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content"),
    ("bad role", "chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("image content part", "chat",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content"),
    ("temperature a string", "chat", {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("temperature negative", "chat", {"messages": MSG, "temperature": -0.1}, 400, "temperature"),
    ("temperature above 2", "chat", {"messages": MSG, "temperature": 2.01}, 400, "temperature"),
    ("top_p zero", "chat", {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("top_p above 1", "chat", {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", "chat", {"messages": MSG, "top_k": -2}, 400, "top_k"),
    ("top_k a float", "chat", {"messages": MSG, "top_k": 2.5}, 400, "top_k"),
    ("min_p above 1", "chat", {"messages": MSG, "min_p": 1.01}, 400, "min_p"),
    ("max_tokens zero", "chat", {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a float", "chat", {"messages": MSG, "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens a string", "chat", {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens"),
    ("max_completion_tokens negative", "chat", {"messages": MSG, "max_completion_tokens": -1},
     400, "max_completion_tokens"),
    ("n zero", "chat", {"messages": MSG, "n": 0}, 400, "n"),
    ("n too large", "chat", {"messages": MSG, "n": 1000}, 400, "n"),
    ("top_logprobs above 20", "chat", {"messages": MSG, "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("top_logprobs without logprobs", "chat", {"messages": MSG, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("logprobs an int on chat", "chat", {"messages": MSG, "logprobs": 3}, 400, "logprobs"),
    ("stop a number", "chat", {"messages": MSG, "stop": 5}, 400, "stop"),
    ("five stop strings", "chat", {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop"),
    ("deadline negative", "chat", {"messages": MSG, "deadline_ms": -10}, 400, "deadline_ms"),
    ("deadline zero", "chat", {"messages": MSG, "deadline_ms": 0}, 400, "deadline_ms"),
    ("priority a string", "chat", {"messages": MSG, "priority": "high"}, 400, "priority"),
    ("stream a string", "chat", {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("ignore_eos a number", "chat", {"messages": MSG, "ignore_eos": 1}, 400, "ignore_eos"),
    ("seed a float", "chat", {"messages": MSG, "seed": 1.5}, 400, "seed"),
    ("seed beyond int64", "chat", {"messages": MSG, "seed": 2**70}, 400, "seed"),
    ("unknown model", "chat", {"messages": MSG, "model": "gpt-17"}, 404, "model"),
    ("chat prompt over the context", "chat",
     {"messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "messages"),
    ("prompt missing", "completion", {"max_tokens": 3}, 400, "prompt"),
    ("prompt empty", "completion", {"prompt": ""}, 400, "prompt"),
    ("prompt empty list", "completion", {"prompt": []}, 400, "prompt"),
    ("prompt a dict", "completion", {"prompt": {"a": 1}}, 400, "prompt"),
    ("prompt mixed list", "completion", {"prompt": [1, "a"]}, 400, "prompt"),
    ("token id out of vocab", "completion", {"prompt": [1, 2, 49152]}, 400, "prompt"),
    ("token id negative", "completion", {"prompt": [1, -3]}, 400, "prompt"),
    ("prompt over the context", "completion", {"prompt": [42] * 8192}, 400, "prompt"),
    ("prompt + max_tokens over the context", "completion",
     {"prompt": [42] * 8000, "max_tokens": 500}, 400, "max_tokens"),
    ("logprobs above 5 on completions", "completion", {"prompt": "x", "logprobs": 6}, 400,
     "logprobs"),
    ("logprobs a bool on completions", "completion", {"prompt": "x", "logprobs": True}, 400,
     "logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "kind", "body", "status", "param"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES]
)
def test_bad_input_is_an_openai_error(preparer, name, kind, body, status, param):
    with pytest.raises(ApiError) as caught:
        preparer.prepare(kind, body)
    error = caught.value
    assert error.status == status
    shaped = error.body()["error"]
    assert set(shaped) == {"message", "type", "param", "code"}
    assert shaped["message"]
    assert shaped["param"] == param
    assert shaped["type"] == "invalid_request_error"
    if status == 404:
        assert shaped["code"] == "model_not_found"
    if "context" in name:
        assert shaped["code"] == "context_length_exceeded"


def test_there_are_at_least_twenty_bad_input_cases():
    assert len(BAD_BODIES) >= 20


@pytest.mark.parametrize(
    "raw", [b"{not json", b"\xff\xfe bad utf-8", b"[1, 2]", b"null", b'"text"', b""]
)
def test_malformed_bodies_are_400(raw):
    with pytest.raises(ApiError) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_kind_follows_messages_or_prompt():
    assert kind_of({"messages": []}) == "chat"
    assert kind_of({"prompt": "x"}) == "completion"
    with pytest.raises(ApiError):
        kind_of({"max_tokens": 3})


def test_chat_request_becomes_template_ids_and_sampling(preparer, tokenizer):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "seed": 5,
        "stop": "END",
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "priority": -2,
        "deadline_ms": 1500,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u1",
    }
    p = preparer.prepare("chat", body)
    assert p.prompts == [tokenizer.encode_chat([{"role": "user", "content": "Hi"}])]
    assert p.max_tokens == 7  # max_completion_tokens wins
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.logprobs) == (
        0.0, 0.9, 0, 0.05, 5, 3,
    )  # fmt: skip
    assert p.stop == ["END"]
    assert (p.n, p.num_choices, p.priority, p.deadline_ms) == (2, 2, -2, 1500)
    assert p.ignore_eos and p.stream and p.include_usage
    assert [p.choice_sampling(i).seed for i in range(2)] == [5, 6]


def test_defaults_and_random_seed(preparer):
    p = preparer.prepare("completion", {"prompt": "Hello", "model": "alias", "n": None})
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.logprobs, s.seed) == (
        1.0, 1.0, 0, 0.0, None, 777,
    )  # fmt: skip
    # Completions default to 16 tokens, as OpenAI's and vLLM's do; chat runs to the end.
    assert p.max_tokens == 16 and p.n == 1 and not p.stream and not p.include_usage
    assert p.model == MODEL
    chat = preparer.prepare("chat", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.max_tokens is None


def test_completion_default_max_tokens_shrinks_to_the_room_left(preparer):
    p = preparer.prepare("completion", {"prompt": [42] * (CONTEXT - 5)})
    assert p.max_tokens == 5


def test_completion_prompt_forms(preparer, tokenizer):
    assert preparer.prepare("completion", {"prompt": [5, 6, 7]}).prompts == [[5, 6, 7]]
    assert preparer.prepare("completion", {"prompt": ["Hello"]}).prompts == [
        tokenizer.encode("Hello")
    ]
    batch = preparer.prepare("completion", {"prompt": [[1, 2], [3]], "n": 2, "seed": 10})
    assert batch.num_choices == 4
    assert [batch.choice_prompt(i) for i in range(4)] == [[1, 2], [1, 2], [3], [3]]
    assert [batch.choice_sampling(i).seed for i in range(4)] == [10, 11, 10, 11]
    assert preparer.prepare("completion", {"prompt": "x", "logprobs": 0}).sampling.logprobs == 0


def test_prompt_exactly_at_the_limit_is_accepted(preparer):
    assert len(preparer.prepare("completion", {"prompt": [42] * 8191}).prompts[0]) == 8191
    p = preparer.prepare("completion", {"prompt": [42] * 8000, "max_tokens": 192})
    assert p.max_tokens == 192


def test_error_body_is_json_serialisable(preparer):
    with pytest.raises(ApiError) as caught:
        preparer.prepare("chat", {"messages": MSG, "temperature": float("nan")})
    assert json.loads(json.dumps(caught.value.body()))["error"]["param"] == "temperature"

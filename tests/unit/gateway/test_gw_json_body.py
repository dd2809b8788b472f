"""Request bytes that would hurt the code behind the parser (deep nesting, lone UTF-16
surrogates, absurd numbers) are a 400 with an OpenAI error body, never a crash."""

from __future__ import annotations

import json

import pytest

from spillway.services.gateway.errors import ApiError
from spillway.services.gateway.json_body import MAX_JSON_DEPTH, parse_json_body


def _refused(raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400
    assert caught.value.body()["error"]["type"] == "invalid_request_error"
    return caught.value


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 100_000])
def test_nesting_beyond_the_limit_is_a_400(depth):
    raw = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    assert "nests deeper" in _refused(raw).message


def test_nesting_within_the_limit_parses():
    inner = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)
    body = parse_json_body(f'{{"x": {inner}}}'.encode())
    assert "x" in body


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\\ud800"}',
        b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
        b'{"\\ud83d": 1, "prompt": "x"}',
        b'{"stop": ["ok", "\\ud800\\ud800"]}',
    ],
)
def test_lone_surrogates_are_a_400_wherever_they_are(raw):
    assert "surrogate" in _refused(raw).message


def test_a_surrogate_pair_is_one_character_and_fine():
    body = parse_json_body(b'{"prompt": "party \\ud83c\\udf89"}')
    assert body["prompt"] == "party \U0001f389"
    body["prompt"].encode("utf-8")


def test_an_integer_too_long_to_convert_is_a_400():
    _refused(b'{"max_tokens": ' + b"9" * 5000 + b"}")


def test_a_wide_flat_body_is_not_mistaken_for_a_deep_one():
    body = parse_json_body(json.dumps({"prompt": list(range(100_000))}).encode())
    assert len(body["prompt"]) == 100_000

"""Every field of the installed `openai` SDK's chat-completions and completions requests
is classified (honoured, ignored, neutral only); ignored ones change nothing, neutral-only
ones are a 400 naming them when they ask for something, and fields in no API are dropped
with one WARNING naming them."""

from __future__ import annotations

import logging
import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from spillway.services.gateway.errors import ApiError
from spillway.services.gateway.request_fields import (
    IGNORED_CHAT,
    IGNORED_COMPLETION,
    known_fields,
)
from spillway.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from spillway.services.gateway.validation import ModelInfo, RequestPreparer

MODEL = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def preparer(tokenizer):
    info = ModelInfo(MODEL, context_length=8192, vocab_size=49152, listed=(MODEL, "other"))
    return RequestPreparer(tokenizer, info, random_seed=lambda: 7)


def _sdk_fields(module) -> set[str]:
    names: set[str] = set()
    for kind in ("CompletionCreateParamsNonStreaming", "CompletionCreateParamsStreaming"):
        names |= set(typing.get_type_hints(getattr(module, kind)))
    return names


@pytest.mark.parametrize(
    ("module", "schema", "kind"),
    [(chat_create_params, ChatCompletionRequest, "chat"),
     (completion_create_params, CompletionRequest, "completion")],
    ids=["chat", "completion"],
)  # fmt: skip
def test_every_sdk_field_is_classified(module, schema, kind):
    sdk = _sdk_fields(module)
    assert {"model", "stream", "max_tokens"} <= sdk  # the walk found the SDK's params
    classified = set(schema.model_fields) | known_fields(kind)
    assert sdk - classified == set(), "fields of the SDK this server does not classify"


def test_stream_options_of_the_sdk_are_accepted(preparer):
    sdk = set(typing.get_type_hints(chat_create_params.ChatCompletionStreamOptionsParam))
    options = dict.fromkeys(sdk, True)
    p = preparer.prepare("chat", {"messages": MSG, "stream": True, "stream_options": options})
    assert p.include_usage


ACCEPTED_NOOPS = {
    "metadata": {"app": "x"}, "store": True, "user": "u1", "service_tier": "flex",
    "safety_identifier": "s", "prompt_cache_key": "k", "prediction": {"type": "content",
    "content": "x"}, "verbosity": "low", "request_id": "r", "cache_salt": "c",
}  # fmt: skip


def test_ignored_fields_are_accepted_and_change_nothing(preparer):
    plain = preparer.prepare("chat", {"messages": MSG, "seed": 1})
    assert set(ACCEPTED_NOOPS) <= set(IGNORED_CHAT) | {"user"}
    busy = preparer.prepare("chat", {"messages": MSG, "seed": 1, **ACCEPTED_NOOPS})
    assert busy.prompts == plain.prompts and busy.sampling == plain.sampling
    comp = {k: v for k, v in ACCEPTED_NOOPS.items() if k in IGNORED_COMPLETION}
    assert preparer.prepare("completion", {"prompt": "x", **comp}).prompts


NEUTRAL_ACCEPTED = [
    ("chat", {"modalities": ["text"], "audio": None, "echo": False, "best_of": 1,
              "parallel_tool_calls": True, "use_beam_search": False}),
    ("completion", {"echo": False, "suffix": None, "best_of": 2, "n": 2,
                    "include_stop_str_in_output": False}),
]  # fmt: skip
REFUSED = [
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"web_search_options": {}}, None),  # {} asks for nothing
    ("chat", {"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    ("chat", {"n": 17}, "n"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("completion", {"echo": True}, "echo"),
    ("completion", {"suffix": "end"}, "suffix"),
    ("completion", {"best_of": 3}, "best_of"),
    ("completion", {"tools": []}, "tools"),  # a chat field: refused by name, not dropped
]  # fmt: skip


@pytest.mark.parametrize(("kind", "fields"), NEUTRAL_ACCEPTED, ids=["chat", "completion"])
def test_neutral_values_are_accepted(preparer, kind, fields):
    base = {"messages": MSG} if kind == "chat" else {"prompt": "x"}
    assert preparer.prepare(kind, {**base, **fields}).prompts


@pytest.mark.parametrize(("kind", "fields", "param"), REFUSED, ids=[str(r[1]) for r in REFUSED])
def test_what_cannot_be_done_is_a_400_naming_the_field(preparer, kind, fields, param):
    base = {"messages": MSG} if kind == "chat" else {"prompt": "x"}
    if param is None:
        assert preparer.prepare(kind, {**base, **fields}).prompts
        return
    with pytest.raises(ApiError) as caught:
        preparer.prepare(kind, {**base, **fields})
    assert caught.value.status == 400 and caught.value.param == param


def test_an_unknown_field_is_dropped_with_one_warning_naming_it(preparer, caplog):
    with caplog.at_level(logging.WARNING, "spillway.services.gateway.request_fields"):
        p = preparer.prepare("chat", {"messages": MSG, "frobnicate": 3, "max_tokens": 2})
    assert p.max_tokens == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'frobnicate'" in warnings[0].getMessage()


def test_many_unknown_fields_make_one_short_line(preparer, caplog):
    body = {"messages": MSG, **{f"x{i}" * 50: i for i in range(500)}}
    with caplog.at_level(logging.WARNING, "spillway.services.gateway.request_fields"):
        preparer.prepare("chat", body)
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(record.getMessage()) < 1200 and "492 more" in record.getMessage()


def test_legacy_functions_become_tools(preparer):
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
    p = preparer.prepare(
        "chat", {"messages": MSG, "functions": [fn], "function_call": {"name": "get_weather"}}
    )
    assert p.tools is not None and p.sampling.grammar is not None  # the named call is forced


def test_reasoning_effort_reaches_the_template(preparer, tokenizer):
    plain = preparer.prepare("chat", {"messages": MSG})
    # SmolLM2's template ignores the variable: the prompt is the same, and it is accepted.
    p = preparer.prepare("chat", {"messages": MSG, "reasoning_effort": "low"})
    assert p.prompts == plain.prompts
    with pytest.raises(ApiError) as caught:
        preparer.prepare("chat", {"messages": MSG, "reasoning_effort": "extreme"})
    assert caught.value.param == "reasoning_effort"


def test_the_response_names_the_served_name_asked_for(preparer):
    assert preparer.prepare("chat", {"messages": MSG, "model": "other"}).model == "other"
    assert preparer.prepare("chat", {"messages": MSG}).model == MODEL
    with pytest.raises(ApiError) as caught:
        preparer.prepare("chat", {"messages": MSG, "model": "nope"})
    assert caught.value.status == 404

"""What agents and apps send, through validation: every newly honoured field reaches the
SamplingParams, the template or the grammar, each has a bad value that is a 400 naming it,
and a field the server does not honour is a 400 too."""

from __future__ import annotations

import json

import pytest

from spillway.services.gateway.errors import ApiError
from spillway.services.gateway.sampling_fields import SamplingDefaults
from spillway.services.gateway.structured_output import GrammarBuilder, check_schema
from spillway.services.gateway.tokenizer import load_tokenizer_folder
from spillway.services.gateway.validation import ModelInfo, RequestPreparer
from spillway.shared.protocol import RegionSampling
from spillway.shared.regions import detect_markers
from tests.unit.worker.think_llama import save_think_llama

MODEL = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
DEFAULTS = SamplingDefaults(False, {"code": RegionSampling(temperature=0.2)})


@pytest.fixture(scope="module")
def grammars():
    return GrammarBuilder()


def _preparer(tokenizer, grammars, defaults=DEFAULTS):
    template = tokenizer.chat_template.source if tokenizer.chat_template else None
    markers = detect_markers(tokenizer.tokenizer.token_to_id, template)
    info = ModelInfo(MODEL, 8192, tokenizer.vocab_size, markers=markers)
    return RequestPreparer(tokenizer, info, lambda: 777, defaults, grammars)


@pytest.fixture(scope="module")
def preparer(tokenizer, grammars):
    return _preparer(tokenizer, grammars)


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    return load_tokenizer_folder(save_think_llama(tmp_path_factory.mktemp("think")))


@pytest.fixture(scope="module")
def think_preparer(think_tokenizer, grammars):
    return _preparer(think_tokenizer, grammars)


SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
}
BAD = [
    # (name, body, param)
    ("echo asked for", {"echo": True}, "echo"),
    ("audio output asked for", {"modalities": ["text", "audio"]}, "modalities"),
    ("functions beside tools", {"functions": [WEATHER["function"]], "tools": [WEATHER]},
     "functions"),
    ("unknown stream option", {"stream": True, "stream_options": {"continuous": True}},
     "stream_options.continuous"),
    ("frequency_penalty above 2", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("presence_penalty a string", {"presence_penalty": "x"}, "presence_penalty"),
    ("repetition_penalty zero", {"repetition_penalty": 0}, "repetition_penalty"),
    ("logit_bias key not a token", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias token out of vocab", {"logit_bias": {"49152": 1}}, "logit_bias"),
    ("logit_bias above 100", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("min_tokens negative", {"min_tokens": -1}, "min_tokens"),
    ("min_tokens above max_tokens", {"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ("stop_token_ids out of vocab", {"stop_token_ids": [10**6]}, "stop_token_ids"),
    ("stop_token_ids not a list", {"stop_token_ids": 5}, "stop_token_ids"),
    ("response_format unknown type", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("json_schema without its object", {"response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("schema keyword not enforced",
     {"response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ("schema that does not compile",
     {"response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "string", "pattern": "(("}}}},
     "response_format.json_schema.schema"),
    ("tools not a list", {"tools": {"a": 1}}, "tools"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("tool name with spaces", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("duplicate tool names", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("tool_choice unknown", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool_choice names a missing tool",
     {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("tool parameters not enforceable",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "not": {}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ("parallel_tool_calls a string", {"tools": [WEATHER], "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
    ("forced call and response_format",
     {"tools": [WEATHER], "tool_choice": "required", "response_format": SCHEMA_FORMAT},
     "response_format"),
    ("sampling_by_region unknown region", {"sampling_by_region": {"poem": {}}},
     "sampling_by_region"),
    ("sampling_by_region bad temperature",
     {"sampling_by_region": {"code": {"temperature": 3}}}, "sampling_by_region.code.temperature"),
    ("chat_template_kwargs overriding messages", {"chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("earlier call arguments not JSON",
     {"messages": [*MSG, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "fields", "param"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_is_a_400_naming_its_field(preparer, name, fields, param):
    with pytest.raises(ApiError) as caught:
        preparer.prepare("chat", {"messages": MSG, **fields})
    assert caught.value.status == 400
    assert caught.value.param == param, caught.value.message
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_completions_reject_chat_only_fields(preparer):
    for field in ("tools", "tool_choice", "chat_template_kwargs", "best_of"):
        with pytest.raises(ApiError) as caught:
            preparer.prepare("completion", {"prompt": "x", field: None or []})
        assert caught.value.param == field


def test_sampling_fields_reach_the_worker(preparer):
    p = preparer.prepare(
        "chat",
        {
            "messages": MSG,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.25,
            "repetition_penalty": 1.2,
            "logit_bias": {"42": -100, "7": 2.5},
            "min_tokens": 3,
            "stop_token_ids": [11, 12, 11],
            "max_tokens": 9,
        },
    )
    s = p.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.5, -0.25, 1.2)
    assert s.logit_bias == {42: -100.0, 7: 2.5}
    assert (s.min_tokens, s.stop_token_ids, p.stop_token_ids, p.min_tokens) == (
        3, [11, 12], [11, 12], 3,
    )  # fmt: skip
    assert s.region_sampling == {} and s.grammar is None
    plain = preparer.prepare("completion", {"prompt": "x"}).sampling
    assert plain.model_dump(exclude={"seed"}) == type(plain)(seed=0).model_dump(exclude={"seed"})


def test_sampling_by_region_per_request_or_server_wide(tokenizer, grammars, preparer):
    table = {"code": {"temperature": 0.0, "top_k": -1}, "think": {"top_p": 0.5}}
    asked = preparer.prepare("chat", {"messages": MSG, "sampling_by_region": table}).sampling
    assert asked.region_sampling == {
        "code": RegionSampling(temperature=0.0, top_k=0),
        "think": RegionSampling(top_p=0.5),
    }
    server = preparer.prepare("chat", {"messages": MSG, "sampling_by_region": True}).sampling
    assert server.region_sampling == {"code": RegionSampling(temperature=0.2)}
    on = _preparer(tokenizer, grammars, SamplingDefaults(True, DEFAULTS.region_table))
    assert on.prepare("chat", {"messages": MSG}).sampling.region_sampling == {
        "code": RegionSampling(temperature=0.2)
    }
    off = on.prepare("chat", {"messages": MSG, "sampling_by_region": False}).sampling
    assert off.region_sampling == {}


def test_tools_without_template_support_use_the_fallback_prompt(preparer, tokenizer):
    history = [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    p = preparer.prepare("chat", {"messages": history, "tools": [WEATHER]})
    text = tokenizer.decode(p.prompts[0], skip_special_tokens=False)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert p.tools is not None and p.tools.format.name == "hermes"
    assert p.sampling.grammar is None  # auto: the model chooses


def test_template_with_tools_gets_them_and_object_arguments(think_preparer, think_tokenizer):
    from transformers import PreTrainedTokenizerFast

    history = [
        *MSG,
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    p = think_preparer.prepare("chat", {"messages": history, "tools": [WEATHER]})
    # transformers renders the same conversation to the same ids (arguments as objects).
    reference = PreTrainedTokenizerFast(tokenizer_object=think_tokenizer.tokenizer)
    reference.chat_template = think_tokenizer.chat_template.source
    for message in history[1:2]:
        for call in message["tool_calls"]:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = reference.apply_chat_template(
        [*history[:1], {**history[1], "content": None}, history[2]],
        tools=[WEATHER],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert p.prompts[0] == list(expected)
    assert p.sampling.initial_region == "think" and p.split_reasoning


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_tool_calls_get_a_grammar(preparer, choice):
    tools = [WEATHER, {"type": "function", "function": {"name": "f"}}]
    p = preparer.prepare("chat", {"messages": MSG, "tools": tools, "tool_choice": choice})
    assert p.sampling.grammar is not None and "<tool_call>" in p.sampling.grammar
    assert ("get_weather" in p.sampling.grammar) == (choice == "required")
    assert p.tools is not None and p.tools.parse


def test_tool_choice_none_shows_tools_but_parses_nothing(preparer):
    p = preparer.prepare("chat", {"messages": MSG, "tools": [WEATHER], "tool_choice": "none"})
    assert p.tools is None and p.sampling.grammar is None


def test_strict_tools_are_enforced_once_a_call_opens(preparer):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    p = preparer.prepare("chat", {"messages": MSG, "tools": [strict]})
    assert p.sampling.grammar is not None


def test_response_formats_become_grammars(preparer):
    text = preparer.prepare("chat", {"messages": MSG, "response_format": {"type": "text"}})
    assert text.sampling.grammar is None
    obj = preparer.prepare("chat", {"messages": MSG, "response_format": {"type": "json_object"}})
    assert obj.sampling.grammar is not None
    schema = preparer.prepare("completion", {"prompt": "x", "response_format": SCHEMA_FORMAT})
    assert schema.sampling.grammar is not None


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (
            {"type": "object", "properties": {"a": {"not": {"type": "null"}}}},
            "`not` at #/properties/a",
        ),
        ({"$defs": {"x": {"if": {}}}, "$ref": "#/$defs/x"}, "`if` at #/$defs/x"),
        ({"type": "number", "multipleOf": 0.5}, "`multipleOf` on a non-integer"),
        ({"type": "string", "format": "password"}, "format `password`"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "`allOf` with more than one"),
        ({"items": [{"type": "string"}, 3]}, "keyword `items`"),
        ({"$ref": "https://example.com/s.json"}, "outside the document"),
    ],
)
def test_schemas_with_what_cannot_be_enforced_are_refused(schema, problem):
    with pytest.raises(ApiError) as caught:
        check_schema(schema, "p")
    assert problem in caught.value.message


def test_enforceable_schemas_pass():
    check_schema(
        {
            "title": "T",
            "type": "object",
            "properties": {
                "a": {"type": ["integer", "null"], "minimum": 0, "multipleOf": 2},
                "b": {"anyOf": [{"const": 1}, {"enum": ["x"]}], "description": "d"},
                "c": {"type": "array", "items": {"$ref": "#/$defs/s"}, "maxItems": 3},
                "d": {"type": "string", "format": "date-time", "pattern": "^2"},
            },
            "$defs": {"s": {"type": "string", "maxLength": 4}},
            "required": ["a"],
            "additionalProperties": False,
            "x-note": "extensions are annotations",
        },
        "p",
    )

"""Reasoning and tool calls out of scripted token streams, into OpenAI bodies and chunks:
the split is exact whatever the deltas, and streamed chunks join to the whole response."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from spillway.services.gateway.choice_output import ChoiceOutput, OutputOptions
from spillway.services.gateway.responses import (
    ChunkBuilder,
    ResponseMeta,
    completion_body,
    usage_of,
)
from spillway.services.gateway.tokenizer import ModelTokenizer, load_tokenizer_folder
from spillway.services.gateway.tool_formats import tool_format
from spillway.shared.protocol import RequestDelta
from spillway.shared.regions import detect_markers
from tests.unit.worker.think_llama import save_think_llama

META = ResponseMeta(id="chatcmpl-1", created=1, model="m", kind="chat", want_logprobs=False)


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    return load_tokenizer_folder(save_think_llama(tmp_path_factory.mktemp("think")))


@pytest.fixture(scope="module")
def markers(think_tokenizer):
    tok = think_tokenizer
    return detect_markers(tok.tokenizer.token_to_id, tok.chat_template.source)


def ids_of(tok, *parts: str) -> list[int]:
    out: list[int] = []
    for part in parts:
        out += tok.encode(part, add_special_tokens=False)
    return out


def run(tok, ids: list[int], options: OutputOptions, per_delta: int, finish: str = "stop"):
    output = ChoiceOutput(0, tok, options)
    steps = []
    for i in range(0, len(ids), per_delta):
        last = i + per_delta >= len(ids)
        delta = RequestDelta(
            request_id="r", token_ids=ids[i : i + per_delta], finish_reason=finish if last else None
        )
        steps.append(output.apply(delta))
    return output, steps


def stream_message(steps) -> dict:
    """What a client reassembles from the chunks of these steps."""
    builder = ChunkBuilder(META, include_usage=False)
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for step in steps:
        for chunk in builder.step(step):
            delta = chunk["choices"][0]["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls", []):
                entry = message["tool_calls"].setdefault(call["index"], {"arguments": ""})
                if "id" in call:
                    entry.update(id=call["id"], name=call["function"]["name"])
                entry["arguments"] += call["function"]["arguments"]
            if chunk["choices"][0]["finish_reason"]:
                message["finish_reason"] = chunk["choices"][0]["finish_reason"]
    return message


@pytest.mark.parametrize("per_delta", [1, 2, 5, 100])
def test_reasoning_and_content_split_exactly(think_tokenizer, markers, per_delta):
    tok = think_tokenizer
    # The generation prompt opened the block: the output starts inside it.
    ids = [*ids_of(tok, " Let me see, 世界", "</think>", "\n\nParis 🎉 is lovely."), 2]
    options = OutputOptions(reasoning=markers, initial_region="think")
    output, steps = run(tok, ids, options, per_delta)
    assert output.reasoning == " Let me see, 世界"
    assert output.text == "\n\nParis 🎉 is lovely."
    reasoning_len = len(ids_of(tok, " Let me see, 世界")) + 1  # with the end marker
    assert output.num_reasoning_tokens == reasoning_len
    body = completion_body(META, [output], usage_of([[1, 2, 3]], [output]))
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (output.reasoning, output.text)
    usage = body["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_len}
    assert usage["completion_tokens"] == len(ids)
    streamed = stream_message(steps)
    assert (streamed["reasoning_content"], streamed["content"]) == (output.reasoning, output.text)


def test_a_think_block_the_model_opens_itself(think_tokenizer, markers):
    tok = think_tokenizer
    ids = ids_of(tok, "Hm.", "<think>", " inner", "</think>", " out")
    output, _ = run(tok, ids, OutputOptions(reasoning=markers), 3)
    assert (output.reasoning, output.text) == (" inner", "Hm. out")
    assert output.num_reasoning_tokens == 3


def test_no_think_markers_no_reasoning_field(think_tokenizer):
    output, _ = run(think_tokenizer, ids_of(think_tokenizer, "plain"), OutputOptions(), 1)
    assert output.reasoning is None and output.num_reasoning_tokens is None
    message = completion_body(META, [output], usage_of([[1]], [output]))["choices"][0]
    assert "reasoning_content" not in message["message"]
    assert (
        "completion_tokens_details"
        not in completion_body(META, [output], usage_of([[1]], [output]))["usage"]
    )


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("per_delta", [1, 3, 100])
def test_tool_calls_in_the_body_and_in_the_stream(think_tokenizer, markers, per_delta):
    tok = think_tokenizer
    ids = [
        *ids_of(tok, " Let me see", "</think>", "<tool_call>", "\n" + CALL + "\n", "</tool_call>"),
        2,
    ]
    options = OutputOptions(
        reasoning=markers, initial_region="think", tool_format=tool_format("hermes", None)
    )
    output, steps = run(tok, ids, options, per_delta)
    assert output.finish_reason == "tool_calls"
    body = completion_body(META, [output], usage_of([[1]], [output]))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] == " Let me see"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    streamed = stream_message(steps)
    assert streamed["finish_reason"] == "tool_calls"
    assert streamed["content"] == "" and streamed["reasoning_content"] == " Let me see"
    assert streamed["tool_calls"] == {
        0: {"id": call["id"], "name": "get_weather", "arguments": '{"city": "Paris"}'}
    }


def test_a_cut_off_call_keeps_finish_reason_length(think_tokenizer):
    tok = think_tokenizer
    ids = ids_of(tok, "<tool_call>", '\n{"name": "f", "arguments": {"a": 1')
    options = OutputOptions(tool_format=tool_format("hermes", None))
    output, _ = run(tok, ids, options, 2, finish="length")
    assert output.finish_reason == "length"
    assert output.tool_calls[0].arguments == '{"a": 1'


def test_stop_strings_wait_for_min_tokens(think_tokenizer):
    tok = think_tokenizer
    ids = ids_of(tok, "a", " stop", " b", " stop", " c")
    early = run(tok, ids, OutputOptions(stop=[" stop"]), 1)[0]
    assert early.text == "a" and early.finish_reason == "stop"
    late = run(tok, ids, OutputOptions(stop=[" stop"], min_tokens=2), 1)[0]
    assert late.text == "a stop b" and late.finish_reason == "stop"


def test_format_markers_that_are_special_tokens_stay_visible_to_the_parser(think_tokenizer):
    tok = think_tokenizer
    tokenizer = Tokenizer.from_str(tok.tokenizer.to_str())
    tokenizer.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    special = ModelTokenizer(tokenizer, tok.special_tokens, tok.chat_template.source)
    marks = {tokenizer.token_to_id("[TOOL_CALLS]"), tokenizer.token_to_id("[ARGS]")}
    assert marks <= special.special_ids
    ids = ids_of(special, "Sure.", "[TOOL_CALLS]", "f", "[ARGS]", '{"a": 1}')
    output, _ = run(special, ids, OutputOptions(tool_format=tool_format("mistral", None)), 2)
    assert output.text == "Sure." and output.tool_calls[0].name == "f"
    assert output.tool_calls[0].arguments == '{"a": 1}'
    # Without tools, special tokens stay hidden as asked.
    plain, _ = run(special, ids, OutputOptions(), 2)
    assert plain.text == 'Sure.f{"a": 1}'

"""Hermes-style tool calls read out of streamed text: however the text is split into
pieces, the content and the calls come out the same, and the streamed argument fragments
join to exactly the arguments of the whole call."""

from __future__ import annotations

import itertools
import json

import pytest

from spillway.services.gateway.tool_call_parser import ToolCallDelta, ToolCallParser
from spillway.services.gateway.tool_formats.hermes import Hermes


def parse(text: str, piece: int, parallel: bool = True):
    ids = (f"call_{i}" for i in itertools.count())
    parser = ToolCallParser(Hermes(), new_id=lambda: next(ids), parallel=parallel)
    content, deltas = "", []
    for i in range(0, len(text), piece):
        c, d = parser.feed(text[i : i + piece])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    return content + c, deltas + d, parser.calls


def reassemble(deltas: list[ToolCallDelta]) -> list[dict]:
    """What an OpenAI client builds from the deltas."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls, "a call is announced once"
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": d.arguments}
        else:
            assert d.index in calls, "arguments come after the call's header"
            calls[d.index]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


PIECES = [1, 2, 3, 7, 1000]
TWO_CALLS = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "q": "a}\\"b"}}'
    "\n</tool_call>\n<tool_call>\n"
    '{"arguments": {"x": 1}, "name": "ping"}\n</tool_call>\n'
)


@pytest.mark.parametrize("piece", PIECES)
def test_calls_and_content_whatever_the_pieces(piece):
    content, deltas, calls = parse(TWO_CALLS, piece)
    assert content == "Let me look."
    assert [(c.id, c.name) for c in calls] == [("call_0", "get_weather"), ("call_1", "ping")]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": [1, 2], "q": 'a}"b'}
    assert calls[0].arguments == '{"city": "Paris", "days": [1, 2], "q": "a}\\"b"}'
    assert json.loads(calls[1].arguments) == {"x": 1}
    rebuilt = reassemble(deltas)
    assert [(r["id"], r["name"], r["arguments"]) for r in rebuilt] == [
        (c.id, c.name, c.arguments) for c in calls
    ]


def test_arguments_stream_in_fragments_before_the_call_ends():
    ids = iter(["call_a"])
    parser = ToolCallParser(Hermes(), new_id=lambda: next(ids))
    _, first = parser.feed('<tool_call>{"name": "f", "arguments": {"a": ')
    header = ToolCallDelta(0, id="call_a", name="f")
    assert first == [header, ToolCallDelta(0, arguments='{"a": ')]
    _, more = parser.feed('"long text')
    assert more == [ToolCallDelta(0, arguments='"long text')]
    _, last = parser.feed('"}}</tool_call>')
    assert last == [ToolCallDelta(0, arguments='"}')]
    assert parser.calls[0].arguments == '{"a": "long text"}'


@pytest.mark.parametrize("piece", PIECES)
def test_text_without_calls_is_content(piece):
    text = "No tools needed: x < y and <tool is not a tag.  \n"
    content, deltas, calls = parse(text, piece)
    assert content == text and deltas == [] and calls == []


@pytest.mark.parametrize("piece", PIECES)
def test_a_body_that_is_not_a_call_stays_content(piece):
    text = "a <tool_call>not json</tool_call> b"
    content, deltas, calls = parse(text, piece)
    assert content == text and deltas == [] and calls == []


@pytest.mark.parametrize("piece", PIECES)
def test_arguments_as_a_json_string_are_decoded(piece):
    text = '<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>'
    content, deltas, calls = parse(text, piece)
    assert content == ""
    assert calls[0].arguments == '{"k": 2}'
    assert reassemble(deltas)[0]["arguments"] == '{"k": 2}'


def test_a_call_cut_off_without_its_end_tag_counts_when_whole():
    content, _, calls = parse('<tool_call>\n{"name": "f", "arguments": {}}', 4)
    assert content == "" and calls[0].name == "f" and calls[0].arguments == "{}"


def test_a_truncated_call_keeps_what_was_streamed():
    content, deltas, calls = parse('<tool_call>{"name": "f", "arguments": {"a": "unfini', 5)
    assert content == ""
    assert calls[0].name == "f" and calls[0].arguments == '{"a": "unfini'
    assert reassemble(deltas)[0]["arguments"] == calls[0].arguments


def test_without_parallel_calls_only_the_first_counts():
    content, deltas, calls = parse(TWO_CALLS, 3, parallel=False)
    assert [c.name for c in calls] == ["get_weather"]
    assert {d.index for d in deltas} == {0}
    assert content == "Let me look."


def test_missing_arguments_are_an_empty_object():
    _, _, calls = parse('<tool_call>{"name": "now"}</tool_call>', 1000)
    assert calls[0].arguments == "{}"

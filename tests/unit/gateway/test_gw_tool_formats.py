"""Every tool-call format against the real chat templates of its models
(tests/fixtures/chat_templates): the template picks the format, the calls the template
writes into a conversation read back into the same arguments, streamed output reads the
same however it is cut, malformed output stays content, and the grammar that forces a
call lets exactly the format's calls with valid arguments through."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from spillway.services.gateway.chat_template import ChatTemplate
from spillway.services.gateway.schemas import Tool
from spillway.services.gateway.structured_output import GrammarBuilder
from spillway.services.gateway.tool_call_parser import ToolCallDelta, ToolCallParser
from spillway.services.gateway.tool_calls import forced_calls, strict_calls, template_messages
from spillway.services.gateway.tool_formats import ToolFormat, tool_format
from spillway.shared.output_formats import detect_reasoning, detect_tool_call_parser

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in (("get_weather", WEATHER), ("get_time", TIME))
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ARGS = {"city": "Paris", "days": 2}

# template -> (tool-call parser, reasoning parser) the template shows.
DETECTED = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama3_json", None),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("llama3_json", None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", None),
    "mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral", None),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", "qwen3"),
    "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja": ("qwen3_xml", None),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("deepseek_v3", "deepseek_r1"),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("deepseek_v3", "deepseek_r1"),
    # Granite 3.3 thinks in <think> tags (3.2's "Here is my thought process:" is granite).
    "ibm-granite-granite-3.3-2B-Instruct.jinja": ("granite", "qwen3"),
    "ibm-granite-granite-4.0.jinja": ("hermes", None),
}


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize("name", sorted(DETECTED))
def test_the_template_picks_the_format(name):
    tools, reasoning = DETECTED[name]
    source = template(name)
    assert detect_tool_call_parser(source) == tools
    found = detect_reasoning(lambda text: None, source)
    assert (found.name if found else None) == reasoning
    assert tool_format(None, source).name == tools


def test_granite_32s_thought_process_is_granite_reasoning():
    line = "Write your thoughts after 'Here is my thought process:' and write your response"
    assert detect_reasoning(lambda text: None, "{{ '" + line + "' }}").name == "granite"


def parse(fmt: ToolFormat, text: str, cuts: list[int] | None = None, parallel: bool = True):
    """(content, calls, deltas) of `text` fed in the pieces `cuts` gives (whole: none)."""
    ids = iter(f"call_{i}" for i in range(100))
    parser = ToolCallParser(fmt, SCHEMAS, new_id=lambda: next(ids), parallel=parallel)
    content, deltas, at = "", [], 0
    for cut in [*(cuts or []), len(text)]:
        c, d = parser.feed(text[at:cut])
        content, deltas, at = content + c, deltas + d, cut
    c, d = parser.finish()
    return content + c, [(x.name, x.arguments) for x in parser.calls], deltas + d


def reassemble(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls, "a call is announced once"
            calls[d.index] = [d.name or "", d.arguments]
        else:
            calls[d.index][1] += d.arguments
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))]


# A call in a conversation, as each template writes it, up to the end of its turn.
TURN_ENDS = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("{", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("{", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("[TOOL_CALLS]", "</s>"),
    "mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja": ("[TOOL_CALLS]", "</s>"),
    "Qwen-Qwen3-0.6B.jinja": ("<tool_call>", "<|im_end|>"),
    "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja": ("<tool_call>", "<|im_end|>"),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("<｜tool▁calls▁begin｜>", "<｜end▁of▁sentence｜>"),
    "ibm-granite-granite-4.0.jinja": ("<tool_call>", "<|end_of_text|>"),
}  # R1's template writes calls only for content None; Granite 3.3's writes none.
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcDEF123", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}},
        {"id": "xyzXYZ789", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
    {"role": "tool", "tool_call_id": "xyzXYZ789", "content": "noon"},
]  # fmt: skip


@pytest.mark.parametrize("name", sorted(TURN_ENDS))
def test_the_calls_a_template_writes_read_back_as_the_same_calls(name):
    source = template(name)
    fmt = tool_format(None, source)
    history = HISTORY
    if fmt.name == "llama3_json":  # Llama's template takes one call per turn
        history = [HISTORY[0], {**HISTORY[1], "tool_calls": HISTORY[1]["tool_calls"][:1]}]
    chat = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    rendered = chat.render(template_messages(history, TOOLS, True, fmt), False, TOOLS)
    start, turn_end = TURN_ENDS[name]
    at = rendered.index(start, rendered.index("Weather in Paris?") + 17)
    written = rendered[at : rendered.index(turn_end, at)]
    content, calls, _ = parse(fmt, written)
    assert content == ""
    expected = [("get_weather", ARGS), ("get_time", {"zone": "CET"})][: len(calls)]
    assert len(calls) == len(history[1]["tool_calls"])
    assert [(n, json.loads(a)) for n, a in calls] == expected


FORMATS = {
    "hermes": tool_format("hermes", None),
    "llama3_json": tool_format("llama3_json", None),
    "mistral": tool_format("mistral", None),
    "mistral_named": tool_format("mistral", "[ARGS]"),
    "qwen3_xml": tool_format("qwen3_xml", None),
    "deepseek_v3": tool_format("deepseek_v3", None),
    "deepseek_v31": tool_format("deepseek_v3", "tool▁sep｜>' + tool['function']['arguments']"),
    "granite": tool_format("granite", None),
}
# Outputs in each format as models write them: (text, content, calls).
SAMPLES: dict[str, list[tuple[str, str, list[tuple[str, dict]]]]] = {
    "hermes": [
        ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
         '\n</tool_call>\n<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n'
         "</tool_call>",
         "Sure.", [("get_weather", ARGS), ("get_time", {"zone": "UTC"})]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "",
         [("get_weather", ARGS)]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
         '{"name": "get_time", "arguments": {"zone": "UTC"}}', "",
         [("get_weather", ARGS), ("get_time", {"zone": "UTC"})]),
        ("The weather is {\"nice\"}.", "The weather is {\"nice\"}.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
         '{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "abcDEF123"}]', "",
         [("get_weather", ARGS), ("get_time", {"zone": "UTC"})]),
        ('Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
         '[TOOL_CALLS]get_time[CALL_ID]abcDEF123[ARGS]{"zone": "UTC"}', "Let me check.",
         [("get_weather", ARGS), ("get_time", {"zone": "UTC"})]),
    ],
    "qwen3_xml": [
        ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
         "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
         "Checking.", [("get_weather", ARGS), ("get_time", {"zone": "UTC"})]),
        # Whitespace around a value that is not a string is not part of it.
        ("<tool_call>\n<function=get_time>\n<parameter=zone> UTC\r</parameter>\n</function>\n"
         "</tool_call>", "", [("get_time", {"zone": "UTC"})]),
        # A value that is not its type stays text; an unknown function's values read as JSON.
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
         "<parameter=days>\ntwo\n</parameter>\n</function>\n</tool_call>", "",
         [("get_weather", {"city": "42", "days": "two"})]),
        ("<tool_call>\n<function=other>\n<parameter=xs>\n[1, 2]\n</parameter>\n"
         "<parameter=s>\nline one\nline two\n</parameter>\n</function>\n</tool_call>", "",
         [("other", {"xs": [1, 2], "s": "line one\nline two"})]),
    ],
    "deepseek_v3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
         '<｜tool▁sep｜>get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜>'
         "<｜tool▁calls▁end｜>", "", [("get_weather", ARGS), ("get_time", {"zone": "UTC"})]),
        ("Ok.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
         '{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Ok.",
         [("get_weather", ARGS)]),
    ],
    "granite": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
         '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "",
         [("get_weather", ARGS), ("get_time", {"zone": "UTC"})]),
    ],
}  # fmt: skip
SAMPLES["mistral_named"] = SAMPLES["mistral"]
SAMPLES["deepseek_v31"] = SAMPLES["deepseek_v3"]
CASES = [(f, *s) for f, samples in SAMPLES.items() for s in samples]


def random_cuts(text: str, rng: random.Random) -> list[int]:
    return sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))


@pytest.mark.parametrize(("fmt", "text", "content", "expected"), CASES)
def test_output_reads_the_same_in_any_pieces(fmt, text, content, expected):
    whole = parse(FORMATS[fmt], text)
    assert whole[0] == content
    assert [(n, json.loads(a)) for n, a in whole[1]] == expected
    assert reassemble(whole[2]) == whole[1]
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), *(random_cuts(text, rng) for _ in range(12))]:
        pieces = parse(FORMATS[fmt], text, cuts)
        assert pieces[:2] == whole[:2]
        assert reassemble(pieces[2]) == whole[1]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_written_call_reads_back(fmt):
    f = FORMATS[fmt]
    text = f.write("get_weather", ARGS)
    content, calls, _ = parse(f, text)
    assert content == "" and [(n, json.loads(a)) for n, a in calls] == [("get_weather", ARGS)]


MALFORMED = {
    "hermes": ["<tool_call>not json</tool_call> after", '<tool_call>{"arguments": {}}</tool_call>',
               "<tool_call>\n{\"na"],
    "llama3_json": ['{"city": "Paris"}', "{not json at all", '{"name": 3, "parameters": {}}'],
    "mistral": ["[TOOL_CALLS] nonsense here", '[TOOL_CALLS][{"x": 1}]', "[TOOL_CALLS][1, 2]"],
    "qwen3_xml": ["<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<tool_call>\n<func",
                  "<tool_call>\n<function=f"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>oops", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>x"
                    "<｜tool▁call▁end｜>"],
    "granite": ["<|tool_call|>I cannot", '<|tool_call|>[{"arguments": {}}]'],
}  # fmt: skip


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, ts in MALFORMED.items() for t in ts])
def test_malformed_output_is_content(fmt, text):
    for cuts in (None, list(range(1, len(text)))):
        content, calls, deltas = parse(FORMATS[fmt], text, cuts)
        assert (content, calls, deltas) == (text, [], [])


def test_without_parallel_calls_only_the_first_counts():
    text, _, _ = SAMPLES["deepseek_v3"][0]
    _, calls, deltas = parse(FORMATS["deepseek_v3"], text, parallel=False)
    assert [n for n, _ in calls] == ["get_weather"] and {d.index for d in deltas} == {0}


def test_mistral_call_ids_are_nine_letters_and_digits():
    call_id = FORMATS["mistral"].new_id()
    assert len(call_id) == 9 and call_id.isalnum()


@pytest.fixture(scope="module")
def grammars():
    return GrammarBuilder()


def accepts(grammar, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    # The worker compiles the EBNF text: check that, not the object.
    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(str(grammar)), text)


TOOL_MODELS = [(i, Tool.model_validate(t)) for i, t in enumerate(TOOLS)]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_forcing_grammar_lets_through_only_valid_calls_in_the_format(grammars, fmt):
    f = FORMATS[fmt]
    one = forced_calls(grammars, f, TOOL_MODELS, parallel=False)
    good = f.write("get_weather", ARGS)
    assert accepts(one, good)
    assert accepts(one, f.write("get_time", {"zone": "UTC"}))
    assert not accepts(one, f.write("get_weather", {"city": "Paris", "days": 9}))  # maximum
    assert not accepts(one, f.write("get_time", {"zone": "PST"}))  # enum
    assert not accepts(one, f.write("get_other", {"zone": "UTC"}))  # not offered
    assert not accepts(one, "Sure. " + good)  # nothing but the call
    # The grammar's own text parses back into the same arguments.
    content, calls, _ = parse(f, good)
    assert content == "" and [(n, json.loads(a)) for n, a in calls] == [("get_weather", ARGS)]
    named = forced_calls(grammars, f, TOOL_MODELS[1:], parallel=False)
    assert not accepts(named, good) and accepts(named, f.write("get_time", {"zone": "CET"}))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_parallel_forced_calls_follow_the_formats_separator(grammars, fmt):
    f, shape = FORMATS[fmt], FORMATS[fmt].shape
    many = forced_calls(grammars, f, TOOL_MODELS, parallel=True)
    calls = [shape.begin_for(n) + f.write_arguments(a) + shape.close for n, a in
             [("get_weather", ARGS), ("get_time", {"zone": "UTC"})]]  # fmt: skip
    text = shape.open + shape.separator.join(calls) + shape.finish
    assert accepts(many, text)
    content, parsed, _ = parse(f, text)
    assert content == "" and [n for n, _ in parsed] == ["get_weather", "get_time"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_strict_function_holds_every_call_the_model_opens(grammars, fmt):
    f = FORMATS[fmt]
    strict = strict_calls(grammars, f, [t for _, t in TOOL_MODELS])
    if fmt != "llama3_json":  # Llama's calls are the whole output
        assert accepts(strict, "Let me look. " + f.write("get_weather", ARGS))
    assert accepts(strict, f.write("get_weather", ARGS))
    assert not accepts(strict, f.write("get_weather", {"city": "Paris", "days": 0}))

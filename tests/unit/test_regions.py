"""Regions of an output (plain, think, code, tool call) from scripted token streams: the
region after each token, markers by id and by text across token boundaries, detection
from a vocabulary and a chat template, and the override setting."""

from __future__ import annotations

import pytest

from spillway.shared.regions import (
    Marker,
    RegionMarkers,
    RegionTracker,
    detect_markers,
    marker_ids,
    region_after_text,
)

# A scripted vocabulary: think markers are single tokens (ids 1, 2); the code fence and
# the tool-call tags are not, and split across tokens in several ways.
VOCAB = {
    1: b"<think>",
    2: b"</think>",
    3: b"Hello",
    4: b" world",
    5: b"``",
    6: b"`python\n",
    7: b"print(1)\n",
    8: b"```\n",
    9: b"<tool",
    10: b"_call>",
    11: b'{"name": "f"}',
    12: b"</tool_call>",
    13: b"x```",
    14: b"``` and ```",
    15: b"</think> spelled",
}
MARKERS = RegionMarkers(think_start=Marker("<think>", 1), think_end=Marker("</think>", 2))


def regions(tokens: list[int], start: str = "plain", markers: RegionMarkers = MARKERS) -> list:
    tracker = RegionTracker(markers, VOCAB.__getitem__, start)  # type: ignore[arg-type]
    return [tracker.advance(t) for t in tokens]


def test_region_after_each_token_of_a_scripted_stream():
    stream = [3, 1, 3, 5, 6, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3]
    assert regions(stream) == [
        "plain",  # Hello
        "think",  # <think>
        "think",  # Hello
        "think",  # `` (a fence inside a think block is text)
        "think",  # `python
        "plain",  # </think>
        "plain",  # world
        "plain",  # `` (two backticks: not yet a fence)
        "code",  # `python\n completes ``` across the token boundary
        "code",  # print(1)
        "plain",  # ```\n closes it
        "plain",  # <tool
        "tool_call",  # _call>
        "tool_call",  # {"name": ...}
        "plain",  # </tool_call>
        "plain",
    ]


def test_single_token_markers_match_by_id_only():
    # "</think>" spelled inside a longer token is text, not the marker token.
    assert regions([15, 3], start="think") == ["think", "think"]
    assert regions([2], start="think") == ["plain"]


def test_one_token_can_open_and_close_a_fence():
    assert regions([14, 3]) == ["plain", "plain"]  # "``` and ```": opens and closes
    assert regions([13]) == ["code"]


def test_a_think_marker_inside_code_or_a_tool_call_is_text():
    assert regions([1, 3], start="code") == ["code", "code"]
    assert regions([1, 12, 3], start="tool_call") == ["tool_call", "plain", "plain"]


def test_region_after_text_reads_every_marker_as_text():
    assert region_after_text(MARKERS, "<|im_start|>assistant\n<think>\n") == "think"
    assert region_after_text(MARKERS, "<think>a</think>b") == "plain"
    assert region_after_text(MARKERS, "see ```py\nx") == "code"


def test_detection_from_vocabulary_template_and_override():
    vocab = {"<think>": 10, "</think>": 11}.get
    found = detect_markers(vocab, None)
    assert found.think_start == Marker("<think>", 10) and found.think_end == Marker("</think>", 11)
    # No think tokens, but the template names the pair: matched as text.
    found = detect_markers({}.get, "{{ '<think>' }}...{{ '</think>' }}")
    assert found.thinks and found.think_ids == frozenset()
    plain = detect_markers({}.get, "{{ messages }}")
    assert not plain.thinks
    assert plain.tool_call_start == Marker("<tool_call>")  # the fallback prompt's tags
    assert plain.code_fence == Marker("```")
    overridden = detect_markers(vocab, None, {"think_start": "<t>", "code_fence": ""})
    assert overridden.think_start == Marker("<t>") and overridden.code_fence is None
    assert marker_ids(found) == []
    assert marker_ids(detect_markers(vocab, None)) == [10, 11]


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_text_markers_match_however_the_text_is_split(split):
    text = b"a ```js\ncode``` b <tool_call>{}</tool_call> c"
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    vocab = dict(enumerate(pieces))
    tracker = RegionTracker(RegionMarkers(), vocab.__getitem__)
    seen = ["plain"]
    for i in range(len(pieces)):
        region = tracker.advance(i)
        if not seen or seen[-1] != region:
            seen.append(region)
    assert seen == ["plain", "code", "plain", "tool_call", "plain"]


def test_the_output_formats_choose_the_markers():
    ids = {"[TOOL_CALLS]": 50, "[ARGS]": 51, "<think>": 1, "</think>": 2}
    mistral = detect_markers(ids.get, "... [TOOL_CALLS] ...")
    assert mistral.tool_call_start == Marker("[TOOL_CALLS]", 50)
    assert mistral.tool_call_end is None  # Mistral's calls run to the end of the output
    assert [w.text for w in mistral.words] == ["[ARGS]"]  # [CALL_ID] is not one token here
    assert marker_ids(mistral) == [1, 2, 50, 51]
    named = detect_markers(ids.get, None, tool_call_parser="deepseek_v3")
    assert named.tool_call_start is not None and "tool▁calls▁begin" in named.tool_call_start.text
    assert detect_markers(ids.get, None).tool_call_start == Marker("<tool_call>")  # Hermes
    assert not detect_markers(lambda t: None, None).thinks


def test_granites_reasoning_markers_are_text_with_two_spellings():
    markers = detect_markers(lambda t: None, None, reasoning_parser="granite")
    pieces = [b"Here", b"'s my", b" thought process:", b" hm", b" Here is my", b" response:"]
    vocab = dict(enumerate(pieces))
    tracker = RegionTracker(markers, vocab.__getitem__)
    assert [tracker.advance(i) for i in range(len(pieces))] == [
        "plain", "plain", "think", "think", "think", "plain"
    ]  # fmt: skip

"""Stop strings across piece boundaries: held back while they could still match, released
when disambiguated, and the output truncated before the earliest match."""

from __future__ import annotations

import random

import pytest

from spillway.services.gateway.stop_strings import StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = ""
    for piece in pieces:
        check = matcher.feed(piece)
        out += check.text
        if check.matched is not None:
            return out, check.matched
    return out + matcher.flush(), None


def test_stop_string_split_across_pieces_is_matched_and_left_out():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello S").text == "hello "  # "S" could begin STOP: held
    assert m.feed("T").text == ""
    check = m.feed("OP and more")
    assert check.matched == "STOP"
    assert check.text == ""
    assert m.feed("ignored").text == ""


def test_held_text_is_released_once_it_cannot_match():
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST").text == "a "
    check = m.feed("ART")
    assert check.matched is None
    assert check.text == "START"


def test_held_tail_is_plain_text_when_the_output_ends():
    m = StopStringMatcher(["\n\n"])
    assert m.feed("line\n").text == "line"
    assert m.flush() == "\n"


def test_earliest_of_several_stop_strings_wins():
    out, matched = feed_all(StopStringMatcher(["world", "lo w"]), ["hel", "lo wor", "ld"])
    assert (out, matched) == ("hel", "lo w")


def test_stop_string_inside_one_piece_truncates_before_it():
    out, matched = feed_all(StopStringMatcher(["###"]), ["abc###def"])
    assert (out, matched) == ("abc", "###")


def test_overlapping_prefixes_are_handled():
    # "aab" after "aaa...": the held tail must be the longest suffix that starts a stop.
    out, matched = feed_all(StopStringMatcher(["aab"]), ["a", "a", "a", "a", "b", "c"])
    assert (out, matched) == ("aa", "aab")


def test_no_stop_strings_releases_everything_at_once():
    m = StopStringMatcher([])
    assert m.feed("anything S").text == "anything S"
    assert m.flush() == ""


def test_empty_stop_strings_are_ignored():
    out, matched = feed_all(StopStringMatcher(["", "x"]), ["ab", "cx"])
    assert (out, matched) == ("abc", "x")


@pytest.mark.parametrize("seed", range(5))
def test_random_splits_give_the_same_result_as_one_piece(seed):
    rng = random.Random(seed)
    stops = ["</s>", "END", "\n\nQ:"]
    for _ in range(200):
        text = "".join(rng.choice(["a", "b", " ", "\n", "E", "N", "D", "<", "/", "s", ">", "Q:"])
                       for _ in range(rng.randint(0, 40)))  # fmt: skip
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        got = feed_all(StopStringMatcher(stops), pieces)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, stop = min(hits)
            assert got == (text[:at], stop) or (got[0] == text[:at] and got[1] in stops)
        else:
            assert got == (text, None)

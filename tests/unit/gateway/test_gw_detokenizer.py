"""Incremental detokenizing: the pieces join to exactly the full decode, and a character
split over several byte-level tokens is never emitted broken."""

from __future__ import annotations

import random

import pytest

from spillway.services.gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

ALPHABET = (
    "abcdefghijklmnopqrstuvwxyz ABC 0123456789 .,;:!?'\"()[]{}\n\t"
    "éèüßøñçàâ 你好世界中文字符 日本語のテキスト 한국어 Ελληνικά Русский עברית العربية "
    "🎉🚀👍🏽🧑‍🚀🇫🇷❤️😀 ∑∫√∞≠ ℝ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
)


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60))) for _ in range(count)]


def stream(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t, skip_special_tokens))
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.finish())
    return pieces


@pytest.mark.parametrize("seed", range(4))
def test_pieces_join_to_full_decode_without_broken_characters(tokenizer, seed):
    for text in random_texts(50, seed):
        ids = tokenizer.encode(text)
        pieces = stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert not any(REPLACEMENT_CHAR in p for p in pieces), (text, pieces)


def test_emoji_split_over_four_tokens_comes_out_whole(tokenizer):
    ids = tokenizer.encode(" 🎉")
    assert len(ids) >= 2  # the emoji's bytes span several tokens
    detok = IncrementalDetokenizer(tokenizer.decode)
    pieces = [detok.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)  # held back until the last byte
    assert pieces[-1] == " 🎉"
    assert detok.finish() == ""


def test_special_tokens_are_left_out_of_the_text(tokenizer):
    ids = [*tokenizer.encode("Hello"), 2, *tokenizer.encode(" world"), 1]
    assert "".join(stream(tokenizer, ids)) == "Hello world"
    kept = "".join(stream(tokenizer, ids, skip_special_tokens=False))
    assert kept == "Hello<|im_end|> world<|im_start|>"


def test_random_ids_still_join_to_the_full_decode(tokenizer):
    """Even garbage (invalid byte sequences) comes out exactly as the full decode shows it."""
    rng = random.Random(11)
    for _ in range(40):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


def test_unfinished_character_at_the_end_is_released_by_finish(tokenizer):
    ids = tokenizer.encode("ok 🎉")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer.decode)
    emitted = "".join(detok.push(i) for i in ids)
    assert REPLACEMENT_CHAR not in emitted
    tail = detok.finish()
    assert emitted + tail == tokenizer.decode(ids)
    assert tail.endswith(REPLACEMENT_CHAR)


def sentencepiece_decode(ids: list[int]) -> str:
    """A Metaspace-style decoder: "▁" is a space, and the text's leading space is dropped."""
    vocab = {0: "▁Hello", 1: "▁world", 2: "!", 3: "▁again"}
    return "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_leading_space_decoders_keep_spaces_between_pieces():
    ids = [0, 1, 2, 3, 1]
    detok = IncrementalDetokenizer(sentencepiece_decode)
    pieces = [detok.push(i) for i in ids]
    assert pieces == ["Hello", " world", "!", " again", " world"]
    assert "".join(pieces) == sentencepiece_decode(ids)


def test_emitted_char_count_tracks_text_offsets(tokenizer):
    ids = tokenizer.encode("ab 世界 cd")
    detok = IncrementalDetokenizer(tokenizer.decode)
    for i in ids:
        before = detok.num_emitted_chars
        piece = detok.push(i)
        assert detok.num_emitted_chars == before + len(piece)
    assert detok.num_emitted_chars == len("ab 世界 cd")

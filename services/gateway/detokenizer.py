r"""Incremental detokenizing of generated ids into text pieces, UTF-8 safe.

Decoding one id at a time goes wrong in two ways: a character split over several
byte-level tokens decodes to U+FFFD until its last byte arrives, and decoders that strip
or add spaces at the start of a text (SentencePiece's "▁") see a different start on every
call. So, as vLLM does, the detokenizer decodes a small window of ids twice:

    ids:   ... | prefix_offset ....... read_offset ....... len(ids)
                 \__ already emitted __/\__ not yet emitted __/
    piece = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

and emits `piece` only when the window's text does not end in U+FFFD (an unfinished
character); then the window slides. Each emitted boundary is a clean character boundary,
so the pieces concatenate to exactly `decode(ids)`. `finish()` releases whatever is held
(a truly invalid byte sequence then shows as U+FFFD, as the full decode shows it).
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[list[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: DecodeFn) -> None:
        self._decode = decode
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted_chars = 0

    @property
    def num_emitted_chars(self) -> int:
        return self._emitted_chars

    def push(self, token_id: int) -> str:
        """Adds one id; returns the text it completes (often "", e.g. mid-character)."""
        self.token_ids.append(token_id)
        prefix_text, window_text = self._window_texts()
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text[len(prefix_text) :])

    def finish(self) -> str:
        """The text still held back (an unfinished character at the end of the output)."""
        prefix_text, window_text = self._window_texts()
        if len(window_text) <= len(prefix_text):
            return ""
        return self._emit(window_text[len(prefix_text) :])

    def _window_texts(self) -> tuple[str, str]:
        window = self.token_ids[self._prefix_offset :]
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        return prefix_text, self._decode(window)

    def _emit(self, piece: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._emitted_chars += len(piece)
        return piece

"""One choice's output: from the scheduler's token deltas to text, logprobs and a finish.

Pure: detokenizes incrementally, matches stop strings, shapes logprobs and counts
tokens. The engine feeds it `RequestDelta`s and acts on what comes back (a matched stop
string means the scheduler must be told to abort the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer import ModelTokenizer
from shared.protocol import ErrorInfo, RequestDelta, SampledLogprobs

# JSON has no -inf; OpenAI-compatible servers report a very unlikely token like this.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class TopToken:
    token: str
    bytes: list[int]
    logprob: float


@dataclass(frozen=True)
class TokenLogprobInfo:
    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top: list[TopToken]
    text_offset: int  # where this token's text starts in the choice's text


@dataclass
class ChoiceStep:
    """What one delta changed for a choice."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprobInfo] = field(default_factory=list)
    finish_reason: str | None = None
    error: ErrorInfo | None = None
    stop_matched: bool = False  # the scheduler still runs the sequence: abort it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True)
class OutputOptions:
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: no logprobs
    tokens_as_ids: bool = False  # logprob tokens spelled "token_id:<id>"
    skip_special_tokens: bool = True
    # Never more tokens than this, whatever the scheduler sends (None: no cap).
    max_tokens: int | None = None


class ChoiceOutput:
    def __init__(self, index: int, tokenizer: ModelTokenizer, options: OutputOptions) -> None:
        self.index = index
        self._tokenizer = tokenizer
        skip = options.skip_special_tokens
        self._detokenizer = IncrementalDetokenizer(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
        )
        self._stop = StopStringMatcher(options.stop)
        self._want_logprobs = options.logprobs is not None
        self._tokens_as_ids = options.tokens_as_ids
        self._max_tokens = options.max_tokens
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.text = ""
        self.logprobs: list[TokenLogprobInfo] = []
        self.finish_reason: str | None = None
        self.error: ErrorInfo | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def apply(self, delta: RequestDelta) -> ChoiceStep:
        step = ChoiceStep(self.index)
        if self.finished:
            return step
        if delta.num_prompt_tokens:  # the first delta: what the prefix cache served
            self.num_cached_tokens = delta.num_cached_tokens
        sampled = delta.logprobs or []
        for i, token_id in enumerate(delta.token_ids):
            if self._max_tokens is not None and self.num_tokens >= self._max_tokens:
                # More than asked for (a scheduler that ran it twice): keep what was asked.
                step.text += self._release_held_text()
                step.finish_reason = "length"
                step.stop_matched = True
                return self._record(step)
            self.num_tokens += 1
            if self._want_logprobs and i < len(sampled):
                step.logprobs.append(self._logprob_info(token_id, sampled[i]))
            check = self._stop.feed(self._detokenizer.push(token_id))
            step.text += check.text
            if check.matched is not None:
                step.finish_reason = "stop"
                step.stop_matched = True
                return self._record(step)
        if delta.finish_reason == "error":
            step.error = delta.error or ErrorInfo(message="the request failed in the engine")
        elif delta.finish_reason is not None:
            step.text += self._release_held_text()
            step.finish_reason = "stop" if self._stop.matched else delta.finish_reason
        return self._record(step)

    def end(self, finish_reason: str) -> ChoiceStep:
        """Ends the choice here without the scheduler (deadline backstop, abort)."""
        step = ChoiceStep(self.index)
        if self.finished:
            return step
        step.text = self._release_held_text()
        step.finish_reason = finish_reason
        return self._record(step)

    def fail(self, error: ErrorInfo) -> ChoiceStep:
        """Ends the choice with an error the gateway found itself (its scheduler is gone,
        the scheduler's news is unusable)."""
        step = ChoiceStep(self.index)
        if self.finished:
            return step
        step.error = error
        return self._record(step)

    def _release_held_text(self) -> str:
        check = self._stop.feed(self._detokenizer.finish())
        return check.text + self._stop.flush()

    def _record(self, step: ChoiceStep) -> ChoiceStep:
        self.text += step.text
        self.logprobs.extend(step.logprobs)
        self.finish_reason = step.finish_reason
        self.error = step.error
        return step

    def _spelling(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._tokenizer.token_bytes(token_id)
        if self._tokens_as_ids:
            return f"token_id:{token_id}", list(raw)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _logprob_info(self, token_id: int, sampled: SampledLogprobs) -> TokenLogprobInfo:
        top = [
            TopToken(*self._spelling(t.token_id), max(t.logprob, MIN_LOGPROB)) for t in sampled.top
        ]
        token, raw = self._spelling(token_id)
        return TokenLogprobInfo(
            token_id=token_id,
            token=token,
            bytes=raw,
            logprob=max(sampled.logprob, MIN_LOGPROB),
            top=top,
            text_offset=self._detokenizer.num_emitted_chars,
        )

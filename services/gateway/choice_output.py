"""One choice's output: from the scheduler's token deltas to text, logprobs and a finish.

Pure: detokenizes incrementally, splits reasoning from content (models with think
markers), matches stop strings on the content (from min_tokens on), reads tool calls out
of it, shapes logprobs and counts tokens. The engine feeds it `RequestDelta`s and acts on
what comes back (a matched stop string means the scheduler must be told to abort the
sequence).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from spillway.services.gateway.detokenizer import DecodeFn, IncrementalDetokenizer
from spillway.services.gateway.reasoning import ReasoningSplit
from spillway.services.gateway.stop_strings import StopCheck, StopStringMatcher
from spillway.services.gateway.tokenizer import ModelTokenizer
from spillway.services.gateway.tool_call_parser import ToolCall, ToolCallDelta, ToolCallParser
from spillway.services.gateway.validation import PreparedRequest
from spillway.shared.protocol import ErrorInfo, RegionName, RequestDelta, SampledLogprobs
from spillway.shared.regions import RegionMarkers

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
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def has_news(self) -> bool:
        return bool(
            self.text or self.reasoning or self.tool_calls or self.logprobs or self.finished
        )


@dataclass(frozen=True)
class OutputOptions:
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: no logprobs
    tokens_as_ids: bool = False  # logprob tokens spelled "token_id:<id>"
    skip_special_tokens: bool = True
    # Never more tokens than this, whatever the scheduler sends (None: no cap).
    max_tokens: int | None = None
    min_tokens: int = 0  # stop strings apply once this many tokens are out
    # Reasoning split: the model's markers and the region the output starts in.
    reasoning: RegionMarkers | None = None
    initial_region: RegionName = "plain"
    # Tool calls parsed out of the content: the (start, end) tags.
    tool_tags: tuple[str, str] | None = None
    parallel_tool_calls: bool = True


def output_options(prepared: PreparedRequest, markers: RegionMarkers) -> OutputOptions:
    """How a request's choices turn tokens into text, reasoning and tool calls."""
    tools = prepared.tools
    return OutputOptions(
        stop=prepared.stop,
        logprobs=prepared.sampling.logprobs,
        tokens_as_ids=prepared.tokens_as_ids,
        skip_special_tokens=prepared.skip_special_tokens,
        max_tokens=prepared.max_tokens,
        min_tokens=prepared.min_tokens,
        reasoning=markers if prepared.split_reasoning else None,
        initial_region=prepared.sampling.initial_region,
        tool_tags=tools.tags if tools is not None else None,
        parallel_tool_calls=tools.parallel if tools is not None else True,
    )


def _content_decoder(tokenizer: ModelTokenizer, options: OutputOptions) -> DecodeFn:
    """Decodes content; tool-call tags stay in it for the parser even when they are special
    tokens that skip_special_tokens would drop."""
    skip = options.skip_special_tokens
    tags = options.tool_tags
    kept = {tokenizer.tokenizer.token_to_id(tag) for tag in tags} if tags and skip else set()
    dropped = tokenizer.special_ids - kept
    if not kept & tokenizer.special_ids:
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
    return lambda ids: tokenizer.decode([i for i in ids if i not in dropped], False)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceOutput:
    def __init__(self, index: int, tokenizer: ModelTokenizer, options: OutputOptions) -> None:
        self.index = index
        self._tokenizer = tokenizer
        skip = options.skip_special_tokens
        self._detokenizer = IncrementalDetokenizer(_content_decoder(tokenizer, options))
        self._stop = StopStringMatcher(options.stop)
        self._min_tokens = options.min_tokens
        self._want_logprobs = options.logprobs is not None
        self._tokens_as_ids = options.tokens_as_ids
        self._max_tokens = options.max_tokens
        self._split: ReasoningSplit | None = None
        self._reasoning_text: IncrementalDetokenizer | None = None
        if options.reasoning is not None:
            self._split = ReasoningSplit(
                options.reasoning, tokenizer.token_bytes, options.initial_region
            )
            self._reasoning_text = IncrementalDetokenizer(
                lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
            )
        self._tools: ToolCallParser | None = None
        if options.tool_tags is not None:
            start, end = options.tool_tags
            self._tools = ToolCallParser(
                start, end, new_tool_call_id, parallel=options.parallel_tool_calls
            )
        self.num_tokens = 0
        self.token_ids: list[int] = []  # what the client has: a resume continues after them
        self.num_cached_tokens = 0
        self.text = ""
        self.reasoning: str | None = "" if options.reasoning is not None else None
        self.logprobs: list[TokenLogprobInfo] = []
        self.finish_reason: str | None = None
        self.error: ErrorInfo | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    @property
    def num_reasoning_tokens(self) -> int | None:
        return self._split.num_reasoning_tokens if self._split is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def apply(self, delta: RequestDelta) -> ChoiceStep:
        step = ChoiceStep(self.index)
        if self.finished:
            return step
        # The first delta: what the prefix cache served (a resumed run's first delta
        # counts its cache hits on the output as well: the first run's figure stands).
        if delta.num_prompt_tokens and not self.num_tokens:
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
            self.token_ids.append(token_id)
            if self._want_logprobs and i < len(sampled):
                step.logprobs.append(self._logprob_info(token_id, sampled[i]))
            channel = self._split.route(token_id) if self._split is not None else "content"
            if channel != "content":
                step.reasoning += self._reasoning_piece(token_id, channel)
                continue
            piece = self._detokenizer.push(token_id)
            # Stop strings count only once min_tokens are out (as vLLM does).
            check = (
                self._stop.feed(piece) if self.num_tokens > self._min_tokens else StopCheck(piece)
            )
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

    def _reasoning_piece(self, token_id: int, channel: str) -> str:
        """Reasoning text for a think-block token; a marker releases what was held back
        (the block ended, or a new one starts)."""
        assert self._reasoning_text is not None
        if channel == "reasoning":
            return self._reasoning_text.push(token_id)
        return self._reasoning_text.finish()

    def _release_held_text(self) -> str:
        check = self._stop.feed(self._detokenizer.finish())
        return check.text + self._stop.flush()

    def _record(self, step: ChoiceStep) -> ChoiceStep:
        if step.finished and self._reasoning_text is not None:
            step.reasoning += self._reasoning_text.finish()
        if self._tools is not None:
            step.text, step.tool_calls = self._tools.feed(step.text)
            if step.finished:
                text, calls = self._tools.finish()
                step.text += text
                step.tool_calls += calls
            if step.finish_reason == "stop" and self._tools.calls:
                step.finish_reason = "tool_calls"
        self.text += step.text
        if self.reasoning is not None:
            self.reasoning += step.reasoning
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

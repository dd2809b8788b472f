"""One choice's output: from the scheduler's token deltas to text, logprobs and a finish.

Pure: detokenizes incrementally, splits reasoning from content (models with think
markers), matches stop strings on the content (from min_tokens on), reads tool calls out
of it, shapes logprobs and counts tokens. The engine feeds it `RequestDelta`s and acts on
what comes back (a matched stop string means the scheduler must be told to abort the
sequence).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spillway.services.gateway.detokenizer import DecodeFn, IncrementalDetokenizer
from spillway.services.gateway.reasoning import ReasoningText, ReasoningTokens
from spillway.services.gateway.stop_strings import StopCheck, StopStringMatcher
from spillway.services.gateway.tokenizer import ModelTokenizer
from spillway.services.gateway.tool_call_parser import ToolCall, ToolCallDelta, ToolCallParser
from spillway.services.gateway.tool_formats import ToolFormat
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
    # Reasoning split: the model's markers, the region the output starts in, and whether
    # a block may open anywhere (else only before any content: Granite).
    reasoning: RegionMarkers | None = None
    initial_region: RegionName = "plain"
    reasoning_anywhere: bool = True
    # Tool calls parsed out of the content: their format and the functions' schemas.
    tool_format: ToolFormat | None = None
    tool_schemas: Mapping[str, dict[str, Any]] = field(default_factory=dict)
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
        reasoning_anywhere=prepared.reasoning_anywhere,
        tool_format=tools.format if tools is not None else None,
        tool_schemas=tools.schemas if tools is not None else {},
        parallel_tool_calls=tools.parallel if tools is not None else True,
    )


def _marker_texts(options: OutputOptions) -> set[str]:
    """The texts the parsers read: think markers, and the tool-call format's markers."""
    texts: set[str] = set()
    markers = options.reasoning
    if markers is not None:
        for marker in (markers.think_start, markers.think_end):
            if marker is not None:
                texts.update(marker.texts)
    if options.tool_format is not None:
        texts.update(options.tool_format.words)
    return texts


def _text_decoder(tokenizer: ModelTokenizer, options: OutputOptions) -> DecodeFn:
    """Decodes the output; the markers the parsers read stay in it even when they are
    special tokens that skip_special_tokens would drop."""
    skip = options.skip_special_tokens
    ids = (tokenizer.tokenizer.token_to_id(t) for t in _marker_texts(options)) if skip else ()
    kept = {i for i in ids if i is not None} & tokenizer.special_ids
    if not kept:
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
    dropped = tokenizer.special_ids - kept
    return lambda ids: tokenizer.decode([i for i in ids if i not in dropped], False)


class ChoiceOutput:
    def __init__(self, index: int, tokenizer: ModelTokenizer, options: OutputOptions) -> None:
        self.index = index
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(_text_decoder(tokenizer, options))
        self._stop = StopStringMatcher(options.stop)
        self._min_tokens = options.min_tokens
        self._want_logprobs = options.logprobs is not None
        self._tokens_as_ids = options.tokens_as_ids
        self._max_tokens = options.max_tokens
        self._think: ReasoningText | None = None
        self._think_tokens: ReasoningTokens | None = None
        markers = options.reasoning
        if markers is not None and markers.think_start and markers.think_end:
            self._think = ReasoningText(
                markers.think_start.texts,
                markers.think_end.texts,
                inside=options.initial_region == "think",
                anywhere=options.reasoning_anywhere,
            )
            self._think_tokens = ReasoningTokens(
                markers, tokenizer.token_bytes, options.initial_region
            )
        self._tools: ToolCallParser | None = None
        if options.tool_format is not None:
            self._tools = ToolCallParser(
                options.tool_format,
                options.tool_schemas,
                parallel=options.parallel_tool_calls,
            )
        self.num_tokens = 0
        self.token_ids: list[int] = []  # what the client has: a resume continues after them
        self.num_cached_tokens = 0
        self.text = ""
        self.reasoning: str | None = "" if self._think is not None else None
        self.logprobs: list[TokenLogprobInfo] = []
        self.finish_reason: str | None = None
        self.error: ErrorInfo | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    @property
    def num_reasoning_tokens(self) -> int | None:
        return self._think_tokens.count if self._think_tokens is not None else None

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
                step.text += self._release_held_text(step)
                step.finish_reason = "length"
                step.stop_matched = True
                return self._record(step)
            self.num_tokens += 1
            self.token_ids.append(token_id)
            if self._want_logprobs and i < len(sampled):
                step.logprobs.append(self._logprob_info(token_id, sampled[i]))
            if self._think_tokens is not None:
                self._think_tokens.advance(token_id)
            piece = self._detokenizer.push(token_id)
            if self._think is not None:
                reasoning, piece = self._think.feed(piece)
                step.reasoning += reasoning
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
            step.text += self._release_held_text(step)
            step.finish_reason = "stop" if self._stop.matched else delta.finish_reason
        return self._record(step)

    def end(self, finish_reason: str) -> ChoiceStep:
        """Ends the choice here without the scheduler (deadline backstop, abort)."""
        step = ChoiceStep(self.index)
        if self.finished:
            return step
        step.text = self._release_held_text(step)
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

    def _release_held_text(self, step: ChoiceStep) -> str:
        """The output ended: the text held back (incomplete characters, a possible
        marker or stop string) is released; reasoning goes to the step."""
        text = self._detokenizer.finish()
        if self._think is not None:
            reasoning, text = self._think.feed(text)
            more, rest = self._think.finish()
            step.reasoning += reasoning + more
            text += rest
        check = self._stop.feed(text)
        return check.text + self._stop.flush()

    def _record(self, step: ChoiceStep) -> ChoiceStep:
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

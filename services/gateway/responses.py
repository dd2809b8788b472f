"""OpenAI response bodies: `chat.completion`, `chat.completion.chunk`, `text_completion`,
the model list, and the stream of chunks one request produces.

Pure functions of the choices' outputs; the HTTP API writes the chunks as SSE `data:`
lines, the NATS API publishes each as one message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spillway.services.gateway.choice_output import ChoiceOutput, ChoiceStep, TokenLogprobInfo
from spillway.services.gateway.tool_call_parser import ToolCall, ToolCallDelta
from spillway.services.gateway.validation import Kind


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache or shared tier
    reasoning_tokens: int | None = None  # for a model that thinks

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reasoning_tokens is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return body


def usage_of(
    prompts: Sequence[Sequence[int]], outputs: Sequence[ChoiceOutput], n: int = 1
) -> Usage:
    """Each prompt counts once, however many choices it has (as OpenAI counts); its
    cached tokens are those its first choice (choice i runs prompt i // n) found."""
    cached = sum(
        outputs[i * n].num_cached_tokens for i in range(len(prompts)) if i * n < len(outputs)
    )
    reasoning = [o.num_reasoning_tokens for o in outputs if o.num_reasoning_tokens is not None]
    return Usage(
        sum(len(p) for p in prompts),
        sum(o.num_tokens for o in outputs),
        cached_tokens=cached,
        reasoning_tokens=sum(reasoning) if reasoning else None,
    )


def tool_calls_body(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def tool_call_deltas(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """A call's first delta names it; later ones carry argument fragments (OpenAI's shape)."""
    out = []
    for d in deltas:
        if d.id is not None:
            entry: dict[str, Any] = {
                "index": d.index,
                "id": d.id,
                "type": "function",
                "function": {"name": d.name, "arguments": d.arguments},
            }
        else:
            entry = {"index": d.index, "function": {"arguments": d.arguments}}
        out.append(entry)
    return out


def chat_message(output: ChoiceOutput, legacy_functions: bool = False) -> dict[str, Any]:
    calls = output.tool_calls
    content: str | None = output.text
    if calls and not output.text.strip():
        content = None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if output.reasoning is not None:
        message["reasoning_content"] = output.reasoning or None
    if calls:
        message["tool_calls"] = tool_calls_body(calls)
        if legacy_functions:  # OpenAI's legacy answer: the first call, without an id
            message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
    return message


# --- logprobs -------------------------------------------------------------------------


def chat_logprobs(infos: Sequence[TokenLogprobInfo]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": i.token,
                "logprob": i.logprob,
                "bytes": i.bytes,
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in i.top
                ],
            }
            for i in infos
        ],
        "refusal": None,
    }


def completion_logprobs(infos: Sequence[TokenLogprobInfo]) -> dict[str, Any]:
    top: list[dict[str, float]] = []
    for i in infos:
        # The sampled token is listed with the alternatives, as OpenAI's legacy API does.
        entry = {t.token: t.logprob for t in i.top}
        entry.setdefault(i.token, i.logprob)
        top.append(entry)
    return {
        "tokens": [i.token for i in infos],
        "token_logprobs": [i.logprob for i in infos],
        "top_logprobs": top,
        "text_offset": [i.text_offset for i in infos],
    }


# --- whole responses -----------------------------------------------------------------


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str
    kind: Kind
    want_logprobs: bool
    legacy_functions: bool = False  # the request gave `functions` (see chat_message)


def completion_body(
    meta: ResponseMeta, outputs: Sequence[ChoiceOutput], usage: Usage
) -> dict[str, Any]:
    if meta.kind == "chat":
        choices = [
            {
                "index": o.index,
                "message": chat_message(o, meta.legacy_functions),
                "logprobs": chat_logprobs(o.logprobs) if meta.want_logprobs else None,
                "finish_reason": o.finish_reason,
            }
            for o in outputs
        ]
        obj = "chat.completion"
    else:
        choices = [
            {
                "index": o.index,
                "text": o.text,
                "logprobs": completion_logprobs(o.logprobs) if meta.want_logprobs else None,
                "finish_reason": o.finish_reason,
            }
            for o in outputs
        ]
        obj = "text_completion"
    return {
        "id": meta.id,
        "object": obj,
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage.body(),
    }


def models_body(names: Sequence[str], created: int, max_model_len: int) -> dict[str, Any]:
    """One entry per served name, with vLLM's `max_model_len` beside OpenAI's fields."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "spillway",
                "max_model_len": max_model_len,
            }
            for name in names
        ],
    }


# --- streams -------------------------------------------------------------------------


class ChunkBuilder:
    """The chunks of one streamed response, in order:

    chat:        role chunk per choice, content chunks, a finish chunk per choice
    completion:  text chunks, a finish chunk per choice
    then, with include_usage, one chunk with empty choices and the usage.
    """

    def __init__(self, meta: ResponseMeta, include_usage: bool) -> None:
        self.meta = meta
        self.include_usage = include_usage
        self._object = "chat.completion.chunk" if meta.kind == "chat" else "text_completion"

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        if self.meta.kind != "chat":
            return []
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(num_choices)]

    def step(self, step: ChoiceStep) -> list[dict[str, Any]]:
        """Content for a step (when it has text, reasoning, tool calls or logprobs), then
        its finish chunk."""
        out = []
        if step.text or step.logprobs or step.reasoning or step.tool_calls:
            out.append(self._chunk(step.index, self._content(step), step.logprobs))
        if step.finish_reason is not None:
            out.append(self.finish(step.index, step.finish_reason))
        return out

    def finish(self, index: int, finish_reason: str, usage: Usage | None = None) -> dict[str, Any]:
        chunk = self._chunk(index, {} if self.meta.kind == "chat" else "", finish=finish_reason)
        if usage is not None:
            chunk["usage"] = usage.body()
        return chunk

    def usage(self, usage: Usage) -> dict[str, Any]:
        return self._envelope([], usage.body())

    def _content(self, step: ChoiceStep) -> dict[str, Any] | str:
        if self.meta.kind != "chat":
            return step.text
        delta: dict[str, Any] = {}
        if step.reasoning:
            delta["reasoning_content"] = step.reasoning
        if step.text or not (step.reasoning or step.tool_calls):
            delta["content"] = step.text
        if step.tool_calls:
            delta["tool_calls"] = tool_call_deltas(step.tool_calls)
            first = [d for d in step.tool_calls if d.index == 0]
            if self.meta.legacy_functions and first:
                # The legacy delta: the first call's name once, then its argument pieces.
                names = [d.name for d in first if d.id is not None]
                legacy = {"name": names[0]} if names else {}
                delta["function_call"] = {
                    **legacy,
                    "arguments": "".join(d.arguments for d in first),
                }
        return delta

    def _chunk(
        self,
        index: int,
        content: dict[str, Any] | str,
        logprobs: Sequence[TokenLogprobInfo] | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.meta.kind == "chat":
            choice["delta"] = content
            shaped = chat_logprobs(logprobs) if logprobs and self.meta.want_logprobs else None
        else:
            choice["text"] = content
            shaped = completion_logprobs(logprobs) if logprobs and self.meta.want_logprobs else None
        choice["logprobs"] = shaped
        choice["finish_reason"] = finish
        return self._envelope([choice], None)

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict:
        body: dict[str, Any] = {
            "id": self.meta.id,
            "object": self._object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return body

"""The soak's traffic, pure: the request of each kind, and what a client saw of it
(an `Outcome`), read from the chunks or the body it got.

Greedy completions carry their tokens as ids with the top-2 logprobs (`logprobs: 2`,
`return_tokens_as_token_ids`), so that a stream can be compared token by token with a
fault-free run of the same body and a near tie told from a real difference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = (
    "stream",  # greedy completions stream over HTTP
    "spec_stream",  # the same with a repetitive prompt: n-gram drafts find matches
    "tools",  # chat, a forced tool call
    "json_schema",  # chat, a JSON-schema output
    "n2",  # two sampled choices (seeded), streamed
    "disconnect",  # a greedy stream the client leaves after a few chunks
    "deadline",  # a greedy stream with a short deadline_ms
    "nats",  # llm.generate request/reply (greedy)
    "nats_stream",  # llm.generate streamed (greedy)
)
GREEDY_KINDS = {"stream", "spec_stream", "disconnect", "deadline", "nats", "nats_stream"}

PLAIN_PROMPTS = (
    "Once upon a time",
    "The river ran past the mill and",
    "List the planets of the solar system:",
    "def fibonacci(n):",
    "In the beginning the servers were quiet, then",
    "Dear diary, today the scheduler",
)
REPETITIVE_PROMPTS = (
    "red green blue red green blue red green blue red green blue red green",
    "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
    "tick tock tick tock tick tock tick tock tick tock tick",
)
MAX_TOKENS = (48, 96, 160, 240)
DEADLINE_MS = 400
DISCONNECT_AFTER = 3  # chunks read before the client leaves

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "cat",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 30},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
}


def greedy_body(i: int, repetitive: bool = False) -> dict[str, Any]:
    """The i-th greedy completion. With ignore_eos, a greedy run of fewer tokens is the
    start of a longer one: one reference per prompt (the longest) serves every length."""
    prompts = REPETITIVE_PROMPTS if repetitive else PLAIN_PROMPTS
    return {
        "prompt": prompts[i % len(prompts)],
        "max_tokens": MAX_TOKENS[(i // len(prompts)) % len(MAX_TOKENS)],
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
    }


def reference_bodies() -> dict[str, dict[str, Any]]:
    """The fault-free run each greedy request is compared with, by prompt: the body at
    the longest length."""
    return {
        p: {**greedy_body(0), "prompt": p, "max_tokens": max(MAX_TOKENS)}
        for p in (*PLAIN_PROMPTS, *REPETITIVE_PROMPTS)
    }


@dataclass
class Request:
    kind: str
    path: str  # an HTTP path, or "nats"
    body: dict[str, Any]
    stream: bool
    reference: str | None = None  # the greedy body's prompt (its reference's key)
    choices: int = 1


def request(kind: str, i: int) -> Request:
    """The i-th request of `kind` (i picks the prompt, the length, the seed)."""
    if kind in ("stream", "disconnect", "deadline", "nats", "nats_stream", "spec_stream"):
        repetitive = kind == "spec_stream" or (kind == "nats_stream" and i % 2 == 1)
        body = {**greedy_body(i, repetitive), "stream_options": {"include_usage": True}}
        if kind == "deadline":
            body = {**body, "max_tokens": max(MAX_TOKENS), "deadline_ms": DEADLINE_MS}
        path = "nats" if kind.startswith("nats") else "/v1/completions"
        stream = kind != "nats"
        if not stream:
            body.pop("stream_options")
        return Request(kind, path, body, stream, body["prompt"])
    if kind == "tools":
        body = {
            "messages": [{"role": "user", "content": f"Weather in city number {i}?"}],
            "tools": [TOOL],
            "tool_choice": "required",
            "temperature": 0,
            "max_tokens": 64,
        }
        return Request(kind, "/v1/chat/completions", body, stream=i % 2 == 1)
    if kind == "json_schema":
        body = {
            "messages": [{"role": "user", "content": f"Describe cat number {i}."}],
            "response_format": SCHEMA,
            "temperature": 0.7,
            "seed": i,
            "max_tokens": 64,
        }
        return Request(kind, "/v1/chat/completions", body, stream=i % 2 == 0)
    if kind == "n2":
        body = {
            "prompt": PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)],
            "n": 2,
            "temperature": 0.9,
            "seed": i,
            "max_tokens": 40,
            "ignore_eos": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        return Request(kind, "/v1/completions", body, stream=True, choices=2)
    raise ValueError(f"unknown request kind {kind!r}")


@dataclass
class Outcome:
    """What one client saw of one request."""

    kind: str
    started_s: float  # seconds from the start of the soak
    ended_s: float = 0.0
    reference: str | None = None
    choices: int = 1
    max_tokens: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)
    gaps: dict[int, list[float]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, list[str]] = field(default_factory=dict)  # every finish seen
    done_marks: int = 0  # `[DONE]` (HTTP) or `Spillway-Done` (NATS) messages
    after_done: int = 0  # messages that came after the end
    usage_completion: int | None = None
    error: dict[str, Any] | None = None  # the error body's `error`, or the client's own
    disconnected: bool = False
    status: int = 200
    tool_arguments: list[str] = field(default_factory=list)

    @property
    def finish(self) -> str | None:
        reasons = [r for rs in self.finishes.values() for r in rs]
        return reasons[-1] if reasons else None


def gap(top: dict[str, float]) -> float:
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def absorb(out: Outcome, payload: dict[str, Any], streamed: bool) -> None:
    """One chunk of a stream (or a whole body) into `out`."""
    if out.done_marks:
        out.after_done += 1
    if "error" in payload:
        out.error = payload["error"]
        return
    for choice in payload.get("choices") or []:
        i = choice.get("index", 0)
        delta = choice.get("delta") if streamed else choice.get("message")
        delta = delta or {}
        text = choice.get("text") or delta.get("content") or ""
        out.text[i] = out.text.get(i, "") + text
        for call in delta.get("tool_calls") or []:
            args = (call.get("function") or {}).get("arguments") or ""
            if streamed and call.get("index", 0) < len(out.tool_arguments):
                out.tool_arguments[call.get("index", 0)] += args
            else:
                out.tool_arguments.append(args)
        logprobs = choice.get("logprobs") or {}
        if "tokens" in logprobs:  # a completion with token ids (chat's are not counted)
            ids = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
            out.tokens.setdefault(i, []).extend(ids)
            tops = logprobs.get("top_logprobs") or []
            out.gaps.setdefault(i, []).extend(gap(t) for t in tops)
        if choice.get("finish_reason"):
            out.finishes.setdefault(i, []).append(choice["finish_reason"])
    usage = payload.get("usage")
    if usage:
        out.usage_completion = usage.get("completion_tokens")


def absorb_sse(out: Outcome, data: str) -> None:
    """One `data:` payload of an SSE stream."""
    if data == "[DONE]":
        out.done_marks += 1
        return
    absorb(out, json.loads(data), streamed=True)

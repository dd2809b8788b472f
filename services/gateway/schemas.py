"""The OpenAI request bodies the gateway honours, as strict pydantic models.

Strict: a string where a number belongs, a number where a boolean belongs, is a 400 and
not silently coerced. Unknown fields (tools, response_format, frequency_penalty, ...) are
accepted and ignored, as OpenAI-compatible servers do. Every optional field accepts
`null`, which some clients send for "not given"; defaults are applied in validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_N = 16  # choices per prompt
MAX_STOP_STRINGS = 4
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5

Role = Literal["system", "developer", "user", "assistant", "tool"]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _GenerationFields(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: FiniteFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    user: str | None = None
    top_k: int | None = Field(None, ge=-1)  # -1 and 0: off
    min_p: FiniteFloat | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool | None = None
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    deadline_ms: int | None = Field(None, gt=0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extensions: logprob tokens as "token_id:<id>"; keep special tokens' text.
    return_tokens_as_token_ids: bool | None = None
    skip_special_tokens: bool | None = None


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)


# A prompt: text, token ids, or a batch of either.
Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_GenerationFields):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

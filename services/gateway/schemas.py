"""The OpenAI request bodies the gateway honours, as strict pydantic models.

Strict: a string where a number belongs, a number where a boolean belongs, is a 400 and
not silently coerced. Top-level fields that are not honoured are sorted out before these
models see a body (request_fields.py: ignored, neutral only, or unknown); a field left
over here, or a nested one the server does not know, is a 400 that names it. Every
optional field accepts `null`, which some clients send for "not given"; defaults are
applied in validation.
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
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows

Role = Literal["system", "developer", "user", "assistant", "tool"]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


RequestBody = _Body  # the strict base, for bodies of other endpoints


class StreamOptions(_Body):
    include_usage: bool | None = None
    # OpenAI pads streamed chunks against side channels; nothing to pad here.
    include_obfuscation: bool | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's earlier refusal part


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning, as this server returned it; templates that show past
    # reasoning (or drop it) see it.
    reasoning_content: str | None = None
    # An earlier answer's refusal (OpenAI's field); the template sees its content only.
    refusal: str | None = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class RegionSamplingBody(_Body):  # the values of `sampling_by_region`
    """Settings that replace the request's inside one region (adaptive sampling)."""

    temperature: FiniteFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: FiniteFloat | None = Field(None, ge=0.0, le=1.0)


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
    # Penalties and biases (OpenAI's ranges; repetition_penalty is vLLM's extension).
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: FiniteFloat | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, FiniteFloat] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    response_format: ResponseFormat | None = None
    # spillway's adaptive sampling: true (the server's table), false, or a table of
    # RegionSamplingBody by region (checked in sampling_fields, for errors that name it).
    sampling_by_region: bool | dict[str, Any] | None = None


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template (vLLM's extension), e.g. enable_thinking.
    chat_template_kwargs: dict[str, Any] | None = None
    # Reaches the chat template as the variable `reasoning_effort`, as vLLM passes it.
    reasoning_effort: ReasoningEffort | None = None
    # The legacy form of tools and tool_choice (validation turns them into those).
    functions: list[FunctionDefinition] | None = Field(None, max_length=MAX_TOOLS)
    function_call: Literal["none", "auto"] | ToolChoiceFunction | None = None


# A prompt: text, token ids, or a batch of either.
Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_GenerationFields):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

"""From raw request bytes to a `PreparedRequest` the engine can submit, or an ApiError.

Pure: the tokenizer, the model's limits and the seed source are handed in. Each check
maps to the OpenAI error a client expects: 400 `invalid_request_error` (with `param`)
for bad input, 404 `model_not_found`, 400 `context_length_exceeded`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from spillway.services.gateway.chat_template import ChatTemplateError
from spillway.services.gateway.errors import ApiError, invalid
from spillway.services.gateway.reasoning import splits_reasoning
from spillway.services.gateway.request_fields import screen, warn_unknown
from spillway.services.gateway.sampling_fields import SamplingDefaults, sampling_fields
from spillway.services.gateway.schemas import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    Tool,
    ToolChoiceFunction,
)
from spillway.services.gateway.structured_output import GrammarBuilder, response_format_grammar
from spillway.services.gateway.tokenizer import ModelTokenizer
from spillway.services.gateway.tool_calls import (
    ToolSetup,
    template_knows_tools,
    template_messages,
    tool_setup,
)
from spillway.services.gateway.tool_formats import ToolFormat, tool_format
from spillway.shared.output_formats import ReasoningSyntax
from spillway.shared.protocol import RegionName, SamplingParams
from spillway.shared.regions import RegionMarkers, region_after_text

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
MAX_PROMPTS = 16  # prompts in one batched completions request
# /v1/completions without max_tokens generates this many, as OpenAI's and vLLM's do
# (chat completions run to the end of the context).
COMPLETION_DEFAULT_MAX_TOKENS = 16
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    context_length: int
    vocab_size: int
    aliases: frozenset[str] = frozenset()
    # What /v1/models lists (--served-model-name's names; empty: model_id alone).
    listed: tuple[str, ...] = ()
    # Think / code / tool-call markers of the model (shared.regions).
    markers: RegionMarkers = field(default_factory=RegionMarkers)
    # How it writes tool calls and marks its reasoning (shared.output_formats).
    tool_format: ToolFormat = field(default_factory=lambda: tool_format("hermes", None))
    reasoning: ReasoningSyntax | None = None

    def serves(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases or name in self.listed


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: its prompts as ids and everything the scheduler needs.

    Choice `i` of the response runs prompt `i // n` with seed `seed + i % n`, so n
    choices of one prompt differ while the whole request stays reproducible."""

    kind: Kind
    model: str
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    max_tokens: int | None
    stop: list[str]
    ignore_eos: bool
    priority: int
    deadline_ms: int | None
    stream: bool
    include_usage: bool
    user: str | None = None
    tokens_as_ids: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0  # stop strings apply from this many tokens on
    tools: ToolSetup | None = None  # tool calls are parsed out of the output when set
    # Reasoning is split from content (chat, a model with think markers); a block may
    # open anywhere in the output (else only before any content).
    split_reasoning: bool = False
    reasoning_anywhere: bool = True
    # Asked with the legacy `functions`: the answer also carries `function_call`.
    legacy_functions: bool = False

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice_prompt(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def choice_sampling(self, index: int) -> SamplingParams:
        seed = (self.sampling.seed + index % self.n) % 2**64
        return self.sampling.model_copy(update={"seed": seed})


def kind_of(body: dict[str, Any]) -> Kind:
    """For the NATS API, where one subject serves both: `messages` means chat."""
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completion"
    raise invalid("the request needs either `messages` (chat) or `prompt` (completion)")


class RequestPreparer:
    def __init__(
        self,
        tokenizer: ModelTokenizer,
        model: ModelInfo,
        random_seed: Callable[[], int],
        sampling_defaults: SamplingDefaults | None = None,
        grammars: GrammarBuilder | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.random_seed = random_seed
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self._grammars = grammars
        template = tokenizer.chat_template.source if tokenizer.chat_template else None
        self.native_tools = template_knows_tools(template)

    @property
    def grammars(self) -> GrammarBuilder:
        if self._grammars is None:
            self._grammars = GrammarBuilder()
        return self._grammars

    def prepare(self, kind: Kind, body: dict[str, Any]) -> PreparedRequest:
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        screened = screen(kind, body, _HONOURED[kind])
        if screened.unknown:
            warn_unknown(screened.unknown)
        if kind == "chat":
            return self.prepare_chat(_validate(schema, screened.body))
        return self.prepare_completion(_validate(schema, screened.body))

    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        self._check_model(req.model)
        legacy = req.functions is not None
        req = _legacy_functions(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        tools = tool_setup(req, self.grammars, self.model.tool_format)
        messages = template_messages(
            [_template_message(i, m) for i, m in enumerate(req.messages)],
            tools.tools if tools else None,
            self.native_tools,
            self.model.tool_format,
        )
        template_tools = tools.tools if tools and self.native_tools else None
        extra = _template_kwargs(req.chat_template_kwargs)
        if req.reasoning_effort is not None:
            extra = {"reasoning_effort": req.reasoning_effort, **(extra or {})}
        markers = self.model.markers
        try:
            prompt = self.tokenizer.encode_chat(messages, template_tools, extra)
            opening = (
                self.tokenizer.generation_prompt(messages, template_tools, extra)
                if markers.thinks
                else ""
            )
        except ChatTemplateError as e:
            raise invalid(str(e), "messages") from e
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        region = self._output_region(opening)
        prepared = self._prepared("chat", req, [prompt], logprobs, region, tools)
        return replace(prepared, legacy_functions=True) if legacy else prepared

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt ids of a conversation without tools (what /tokenize counts)."""
        shown = template_messages(
            [_template_message(i, m) for i, m in enumerate(messages)],
            None,
            self.native_tools,
            self.model.tool_format,
        )
        extra = _template_kwargs(template_kwargs)
        try:
            text = self.tokenizer.render_chat(shown, None, extra, add_generation_prompt)
        except ChatTemplateError as e:
            raise invalid(str(e), "messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_model(self, name: str | None) -> None:
        self._check_model(name)

    def _output_region(self, opening: str) -> RegionName:
        """The region the generation prompt leaves the output in; a model whose reasoning
        opens without a marker (DeepSeek-R1) starts in it unless the prompt closed it."""
        markers, reasoning = self.model.markers, self.model.reasoning
        region = region_after_text(markers, opening)
        closed = markers.think_end is not None and any(
            t in opening for t in markers.think_end.texts
        )
        if region == "plain" and reasoning is not None and reasoning.opened and not closed:
            return "think" if markers.thinks else region
        return region

    def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        self._check_model(req.model)
        prompts = self._completion_prompts(req.prompt)
        if len(prompts) == 1 and self.model.markers.thinks:
            # A prompt that ends inside a think block continues in it (a batch shares one
            # SamplingParams: its prompts start plain).
            text = self.tokenizer.decode(prompts[0], skip_special_tokens=False)
            region = region_after_text(self.model.markers, text)
        else:
            region = "plain"
        return self._prepared("completion", req, prompts, req.logprobs, region)

    def _check_model(self, name: str | None) -> None:
        if name is not None and not self.model.serves(name):
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.model.model_id}`.",
                "model",
                "model_not_found",
            )

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif prompt and isinstance(prompt[0], str):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        elif prompt and isinstance(prompt[0], list):
            prompts = [list(p) for p in prompt]
        else:
            prompts = [list(prompt)]
        if len(prompts) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        for ids in prompts:
            if not ids:
                raise invalid("the prompt is empty", "prompt")
            bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
            if bad:
                raise invalid(
                    f"token id {bad[0]} is outside the vocabulary (0..{self.model.vocab_size - 1})",
                    "prompt",
                )
        return prompts

    def _prepared(
        self,
        kind: Kind,
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        logprobs: int | None,
        initial_region: RegionName = "plain",
        tools: ToolSetup | None = None,
    ) -> PreparedRequest:
        max_tokens = req.max_completion_tokens or req.max_tokens
        prompt_param = "messages" if kind == "chat" else "prompt"
        for ids in prompts:
            self._check_context(ids, max_tokens, prompt_param)
        if max_tokens is None and kind == "completion":
            room = self.model.context_length - max(len(ids) for ids in prompts)
            max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, room)
        top_k = req.top_k or 0
        extra = sampling_fields(req, self.model.vocab_size, max_tokens, self.sampling_defaults)
        grammar = response_format_grammar(self.grammars, req.response_format)
        if tools is not None and tools.grammar is not None:
            if grammar is not None:
                raise invalid(
                    "response_format cannot be combined with a forced or strict tool call",
                    "response_format",
                )
            grammar = tools.grammar
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if top_k <= 0 else min(top_k, self.model.vocab_size),
            min_p=req.min_p or 0.0,
            seed=self.random_seed() if req.seed is None else req.seed,
            logprobs=logprobs,
            initial_region=initial_region,
            grammar=grammar,
            **extra,
        )
        return PreparedRequest(
            kind=kind,
            # The served name the client asked for (as vLLM answers), else the first.
            model=req.model if req.model in self.model.listed else self.model.model_id,
            prompts=prompts,
            n=req.n or 1,
            sampling=sampling,
            max_tokens=max_tokens,
            stop=_stop_strings(req.stop),
            ignore_eos=bool(req.ignore_eos),
            priority=req.priority or 0,
            deadline_ms=req.deadline_ms,
            stream=bool(req.stream),
            include_usage=bool(
                req.stream and req.stream_options and req.stream_options.include_usage
            ),
            user=req.user,
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
            skip_special_tokens=req.skip_special_tokens is not False,
            stop_token_ids=sampling.stop_token_ids,
            min_tokens=sampling.min_tokens,
            tools=tools if tools is not None and tools.parse else None,
            split_reasoning=kind == "chat" and splits_reasoning(self.model.markers),
            reasoning_anywhere=self.model.reasoning is None or self.model.reasoning.anywhere,
        )

    def _check_context(self, prompt: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.model.context_length
        wanted = len(prompt) + (max_tokens or 1)
        if wanted > limit:
            raise invalid(
                f"This model's maximum context length is {limit} tokens. However, you requested"
                f" {wanted} tokens ({len(prompt)} in the prompt, {max_tokens or 1} for the"
                " completion). Please reduce the prompt or the completion length.",
                param if max_tokens is None else "max_tokens",
                "context_length_exceeded",
            )


_HONOURED: dict[Kind, frozenset[str]] = {
    "chat": frozenset(ChatCompletionRequest.model_fields),
    "completion": frozenset(CompletionRequest.model_fields),
}


def _legacy_functions(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """OpenAI's deprecated `functions` / `function_call` as the `tools` / `tool_choice`
    they became."""
    if req.functions is None and req.function_call is None:
        return req
    if req.tools is not None or req.tool_choice is not None:
        param = "functions" if req.functions is not None else "function_call"
        raise invalid(f"{param}: give either tools or the legacy functions, not both", param)
    choice = req.function_call
    if isinstance(choice, ToolChoiceFunction):
        choice = NamedToolChoice(type="function", function=choice)
    tools = [Tool(type="function", function=f) for f in req.functions or []]
    return req.model_copy(update={"tools": tools or None, "tool_choice": choice})


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """`body` as `model`, or a 400 naming the first field at fault."""
    return _validate(model, body)


def _validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param_of(first["loc"])
        if first["type"] == "extra_forbidden":
            raise invalid(
                f"{param}: this field is not supported by this server (docs/api.md lists the"
                " accepted ones)",
                param,
                "unsupported_field",
            ) from e
        raise invalid(f"{param or 'body'}: {first['msg']}", param) from e


RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    if not kwargs:
        return None
    taken = sorted(RESERVED_TEMPLATE_NAMES.intersection(kwargs))
    if taken:
        raise invalid(
            f"chat_template_kwargs: `{taken[0]}` is set by the request itself",
            "chat_template_kwargs",
        )
    return kwargs


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """`messages[0].role` from pydantic's location, leaving out its union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _UNION_TAGS:
            out += f".{part}" if out else part
    return out or None


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    param = f"messages[{index}].content"
    if message.content is None:
        if not (message.role == "assistant" and message.tool_calls):
            raise invalid(f"{param} is required", param)
        content = ""
    elif isinstance(message.content, str):
        content = message.content
    else:
        texts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise invalid(f"{param}: only text content parts are supported", param)
            texts.append(part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content}
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    if message.tool_calls is not None:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    return out


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"stop: at most {MAX_STOP_STRINGS} stop strings", "stop")
    return [s for s in stops if s]

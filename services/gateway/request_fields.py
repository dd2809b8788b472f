"""Every top-level field a chat-completions or completions body may carry, classified.

OpenAI's SDK and agent frameworks send fields the server cannot act on (`store`,
`metadata`, `service_tier`, ...); vLLM's clients send vLLM's extensions. Each field is one
of:

- honoured: a field of the request schema (schemas.py) that changes the output;
- ignored: accepted and dropped, because it cannot change the output (bookkeeping for
  OpenAI's platform, cache hints, latency hints);
- neutral only: accepted at the value that asks for nothing (`echo: false`,
  `modalities: ["text"]`), a 400 naming it otherwise, since the server cannot do what it
  asks (audio output, beam search, ...);
- unknown: in no OpenAI or vLLM API; ignored with one WARNING naming it, as vLLM does.

A field of the other endpoint's API (`tools` on completions) is left to the schema,
which refuses it by name. `tests/unit/gateway/test_gw_request_fields.py` walks the
installed `openai` SDK's request types and holds every field to this table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spillway.services.gateway.errors import invalid

log = logging.getLogger(__name__)

Kind = str  # "chat" | "completion" (validation.Kind; kept loose to avoid an import cycle)


def _absent(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _false(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value is False


def _true(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value is True


def _one(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or (isinstance(value, int | float) and value == 1)


def _text_only(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value == ["text"]


def _best_of_n(value: Any, body: Mapping[str, Any]) -> bool:
    # best_of > n would rank candidates by their log probability: not done here.
    return value is None or (type(value) is int and value in (1, body.get("n") or 1))


@dataclass(frozen=True)
class NeutralOnly:
    is_neutral: Callable[[Any, Mapping[str, Any]], bool]
    asks: str  # what a non-neutral value asks for, for the error message


# Fields both endpoints accept and drop: none of them changes a token of the output.
IGNORED_BOTH = {
    "user": "an end-user id for OpenAI's abuse monitoring",
    "metadata": "tags stored with the completion on OpenAI's platform",
    "store": "stores the completion on OpenAI's platform",
    "service_tier": "OpenAI's processing tier",
    "safety_identifier": "an end-user id for OpenAI's safety monitoring",
    "prompt_cache_key": "a prefix-cache routing hint (the prefix cache here is automatic)",
    "prompt_cache_retention": "how long OpenAI keeps a cached prefix",
    "prompt_cache_options": "OpenAI's prefix-cache options",
    "moderation": "OpenAI's moderation settings",
    "request_id": "vLLM: the client's request id",
    "cache_salt": "vLLM: separates prefix caches by tenant",
    "kv_transfer_params": "vLLM: disaggregated-prefill transfer",
    "vllm_xargs": "vLLM: arguments for custom plugins",
    "guided_decoding_backend": "vLLM: which grammar engine (xgrammar runs here)",
    "mm_processor_kwargs": "vLLM: multimodal processor options (text only here)",
    "media_io_kwargs": "vLLM: media loading options (text only here)",
}
IGNORED_CHAT = {
    **IGNORED_BOTH,
    "prediction": "predicted output, a latency hint that never changes the output",
    "verbosity": "a hint for OpenAI's reasoning models",
}
IGNORED_COMPLETION = dict(IGNORED_BOTH)

# Fields accepted only at the value that asks for nothing.
NEUTRAL_BOTH = {
    "use_beam_search": NeutralOnly(_false, "beam search"),
    "length_penalty": NeutralOnly(_one, "beam search's length penalty"),
    "include_stop_str_in_output": NeutralOnly(_false, "the stop string in the output"),
    "spaces_between_special_tokens": NeutralOnly(_true, "special tokens joined without spaces"),
    "truncate_prompt_tokens": NeutralOnly(_absent, "a truncated prompt"),
    "prompt_logprobs": NeutralOnly(_absent, "the prompt's log probabilities"),
    "allowed_token_ids": NeutralOnly(_absent, "a whitelist of tokens"),
    "bad_words": NeutralOnly(_absent, "banned words"),
    "logits_processors": NeutralOnly(_absent, "custom logits processors"),
    "return_token_ids": NeutralOnly(_false, "the token ids beside the text"),
    "echo": NeutralOnly(_false, "the prompt echoed in the output"),
    "structured_outputs": NeutralOnly(_absent, "vLLM's structured outputs (use response_format)"),
    "guided_json": NeutralOnly(_absent, "vLLM's guided JSON (use response_format)"),
    "guided_regex": NeutralOnly(_absent, "a regular expression grammar"),
    "guided_choice": NeutralOnly(_absent, "a choice grammar"),
    "guided_grammar": NeutralOnly(_absent, "a context-free grammar"),
    "guided_whitespace_pattern": NeutralOnly(_absent, "a whitespace pattern in JSON"),
    "structural_tag": NeutralOnly(_absent, "structural tags"),
    "thinking_token_budget": NeutralOnly(_absent, "a cap on reasoning tokens"),
}
NEUTRAL_CHAT = {
    **NEUTRAL_BOTH,
    "audio": NeutralOnly(_absent, "audio output"),
    "modalities": NeutralOnly(_text_only, "audio output"),
    "web_search_options": NeutralOnly(_absent, "a web search"),
    "best_of": NeutralOnly(_best_of_n, "the best of several candidates"),
    "add_generation_prompt": NeutralOnly(_true, "a prompt without the assistant's opening"),
    "continue_final_message": NeutralOnly(_false, "the last message continued"),
    "add_special_tokens": NeutralOnly(_false, "special tokens added around the template"),
    "documents": NeutralOnly(_absent, "documents for the chat template"),
    "chat_template": NeutralOnly(_absent, "a chat template per request"),
}
NEUTRAL_COMPLETION = {
    **NEUTRAL_BOTH,
    "best_of": NeutralOnly(_best_of_n, "the best of several candidates"),
    "suffix": NeutralOnly(_absent, "text inserted before a suffix"),
    "add_special_tokens": NeutralOnly(_true, "a prompt without the tokenizer's special tokens"),
    "prompt_embeds": NeutralOnly(_absent, "prompt embeddings"),
}

# Fields of either endpoint's API (OpenAI's or vLLM's): on the other endpoint they are not
# unknown, so the schema refuses them by name rather than a warning dropping them.
CHAT_ONLY = {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "top_logprobs", "chat_template_kwargs", "reasoning_effort",
}  # fmt: skip
COMPLETION_ONLY = {"prompt"}


@dataclass(frozen=True)
class Screened:
    body: dict[str, Any]  # what the schema validates: honoured fields only
    unknown: list[str]  # in no OpenAI or vLLM API: dropped, to be logged


def screen(kind: Kind, body: dict[str, Any], honoured: frozenset[str]) -> Screened:
    """Splits a body into the honoured fields and the unknown ones; a neutral-only field
    at a value that asks for something is a 400 naming it."""
    ignored = IGNORED_CHAT if kind == "chat" else IGNORED_COMPLETION
    neutral = NEUTRAL_CHAT if kind == "chat" else NEUTRAL_COMPLETION
    kept: dict[str, Any] = {}
    unknown: list[str] = []
    for name, value in body.items():
        if name in honoured or name in CHAT_ONLY or name in COMPLETION_ONLY:
            kept[name] = value
        elif name in ignored:
            continue
        elif name in neutral:
            rule = neutral[name]
            if not rule.is_neutral(value, body):
                raise invalid(
                    f"{name}: {rule.asks} is not supported by this server",
                    name,
                    "unsupported_field",
                )
        else:
            unknown.append(name)
    return Screened(kept, unknown)


def known_fields(kind: Kind) -> frozenset[str]:
    """Every field this endpoint classifies besides the schema's own (for the test that
    walks the SDK)."""
    if kind == "chat":
        return frozenset({*IGNORED_CHAT, *NEUTRAL_CHAT, *CHAT_ONLY})
    return frozenset({*IGNORED_COMPLETION, *NEUTRAL_COMPLETION, *COMPLETION_ONLY})


MAX_NAMES_LOGGED = 8


def warn_unknown(names: list[str]) -> None:
    """One WARNING per request naming the fields dropped (vLLM's behaviour); names are
    the client's text, so they are cut short and escaped, and only a few are listed."""
    shown = [repr(name[:64]) for name in names[:MAX_NAMES_LOGGED]]
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    log.warning(
        "ignored request fields that no OpenAI or vLLM API defines: %s%s", ", ".join(shown), more
    )

"""`/tokenize` and `/detokenize` with vLLM's request and response shapes.

    POST /tokenize    {"model"?, "prompt", "add_special_tokens"?}
                   or {"model"?, "messages", "add_generation_prompt"?, "chat_template_kwargs"?}
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model"?, "tokens"} -> {"prompt"}

The ids are exactly those a completion or chat request with the same text would run.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from spillway.services.gateway.errors import invalid
from spillway.services.gateway.schemas import ChatMessage, RequestBody
from spillway.services.gateway.validation import RequestPreparer, validate

MAX_TOKENS_DETOKENIZED = 1 << 20


class TokenizeCompletion(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeChat(RequestBody):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class Detokenize(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKENS_DETOKENIZED)


def tokenize(preparer: RequestPreparer, body: dict[str, Any]) -> dict[str, Any]:
    if "messages" in body:
        chat: TokenizeChat = validate(TokenizeChat, body)
        preparer.check_model(chat.model)
        ids = preparer.chat_prompt(
            chat.messages, chat.chat_template_kwargs, chat.add_generation_prompt is not False
        )
        want_strs = chat.return_token_strs
    else:
        text: TokenizeCompletion = validate(TokenizeCompletion, body)
        preparer.check_model(text.model)
        ids = preparer.tokenizer.encode(text.prompt, text.add_special_tokens is not False)
        want_strs = text.return_token_strs
    strs = [preparer.tokenizer.tokenizer.id_to_token(i) for i in ids] if want_strs else None
    return {
        "count": len(ids),
        "max_model_len": preparer.model.context_length,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(preparer: RequestPreparer, body: dict[str, Any]) -> dict[str, Any]:
    req: Detokenize = validate(Detokenize, body)
    preparer.check_model(req.model)
    vocab = preparer.model.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise invalid(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return {"prompt": preparer.tokenizer.decode(req.tokens)}

"""Rendering a model's chat template the way transformers' `apply_chat_template` does.

The template is untrusted code from the model files, so it runs in jinja2's immutable
sandbox. The environment mirrors transformers' (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, a `tojson` that does not HTML-escape, `strftime_now`) so that
the rendered text, and therefore the prompt's token ids, are the same.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template refused it or failed)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source)
        # transformers hands every special token (bos_token, eos_token, ...) to the template.
        self._special_tokens = {k: v for k, v in special_tokens.items() if v is not None}

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """`extra`: more template variables (a request's chat_template_kwargs)."""
        try:
            return self._template.render(
                **(extra or {}),
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on the conversation: {e}") from e

"""The served model's tokenizer as the gateway uses it: the tokenizer files
(`shared/tokenizer_files.py`, loaded and cached there) plus the chat template's rendering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from spillway.services.gateway.chat_template import ChatTemplate, ChatTemplateError
from spillway.shared import tokenizer_files
from spillway.shared.model_files import ModelSource
from spillway.shared.tokenizer_files import LoadedTokenizer


class ModelTokenizer(LoadedTokenizer):
    """Encoding, decoding, chat rendering and per-token bytes for one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_tokens: dict[str, str | None],
        chat_template: str | None,
    ) -> None:
        super().__init__(tokenizer, special_tokens, chat_template)
        self.chat_template = ChatTemplate(chat_template, special_tokens) if chat_template else None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("the model has no chat template: use /v1/completions")
        return self.chat_template.render(messages, add_generation_prompt, tools, extra)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids transformers' apply_chat_template(..., add_generation_prompt=True)
        gives: the template writes every special token itself, so none is added."""
        return self.encode(self.render_chat(messages, tools, extra), add_special_tokens=False)

    def generation_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The text the template adds to open the answer (it may open a think block)."""
        full = self.render_chat(messages, tools, extra)
        bare = self.render_chat(messages, tools, extra, add_generation_prompt=False)
        return full[len(bare) :] if full.startswith(bare) else full


def load_tokenizer(
    source: ModelSource, cache_dir: str | Path, chat_template: str | None = None
) -> ModelTokenizer:
    """The tokenizer of `source` (converted once into `cache_dir`, see tokenizer_files);
    `chat_template` replaces the model's own (`--chat-template`)."""
    loaded = tokenizer_files.load_tokenizer(source, cache_dir)
    template = chat_template or loaded.chat_template_source
    return ModelTokenizer(loaded.tokenizer, loaded.special_tokens, template)


def load_tokenizer_folder(folder: Path) -> ModelTokenizer:
    return _with_chat(tokenizer_files.load_tokenizer_folder(folder))


def _with_chat(loaded: LoadedTokenizer) -> ModelTokenizer:
    return ModelTokenizer(loaded.tokenizer, loaded.special_tokens, loaded.chat_template_source)

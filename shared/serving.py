"""What the serving options with vLLM's names make of the model's own facts, the same in
the gateway and the worker: `--served-model-name`, `--chat-template`, `--max-model-len`."""

from __future__ import annotations

from pathlib import Path

# A --chat-template value holding one of these is the template itself (vLLM's
# "single-line form"); anything else is a file.
_TEMPLATE_MARKS = ("{{", "{%")


def chat_template_text(given: str | None) -> str | None:
    """The chat template `--chat-template` names (a file, or the template inline), or
    None for the model's own; a file that cannot be read fails start-up by its name."""
    if not given:
        return None
    if any(mark in given for mark in _TEMPLATE_MARKS):
        return given
    path = Path(given).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {given}: cannot read the file ({e})") from e


def served_context_length(model_context: int, max_model_len: int | None) -> int:
    """The context a request may fill: the model's, or `--max-model-len` below it (as in
    vLLM, a longer one than the model's positions is refused at start)."""
    if max_model_len is None:
        return model_context
    if max_model_len > model_context:
        raise ValueError(
            f"--max-model-len {max_model_len} is longer than the model's context"
            f" ({model_context} positions)"
        )
    return max_model_len


def served_names(given: list[str] | None, model_id: str) -> list[str]:
    """The names the API answers to, the first being the one it reports (`model_id`
    unless `--served-model-name` says otherwise)."""
    names = [name for name in (given or []) if name]
    return list(dict.fromkeys(names)) or [model_id]

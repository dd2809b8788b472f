"""Error text fit for a log line or a health body: never payload bytes.

An exception's message may carry what the failed call was given: redis-py puts a failed
pipeline command with its arguments (a KV value of megabytes, shown as escapes) into the
message, and pydantic quotes the invalid input (a prompt, token ids). `error_text(e)`
keeps the error's kind and what went wrong, and drops the rest: the command's arguments
(its name stays), the quoted input, and any binary run left.
"""

from __future__ import annotations

import re

MAX_CHARS = 300
BINARY = "<binary>"

# redis-py: "Command # 1 (SET key <value>) of pipeline caused error: <reason>".
_PIPELINE = re.compile(r"^Command # (\d+) \((\S*).*\) of pipeline caused error: ", re.DOTALL)
# pydantic: "[type=int_type, input_value=<the input>, input_type=str]".
_INPUT_VALUE = re.compile(r"input_value=.*?, input_type=", re.DOTALL)
# One byte of payload: shown by repr ("\\x9c"), or a character no text prints (a control
# character, U+FFFD from a lossy decode) or a byte decoded as Latin-1; a run is such bytes
# at most 8 characters apart (binary holds printable bytes too, in short runs).
_BYTE = r"(?:\\x[0-9a-fA-F]{2}|[^\x20-\x7e\u0100-\ud7ff\ue000-\ufffc])"
_BINARY_RUN = re.compile(rf"{_BYTE}(?:.{{0,8}}?{_BYTE})*", re.DOTALL)
_WHITESPACE = re.compile(r"[\t\r\n]+")


def error_text(e: BaseException, limit: int = MAX_CHARS) -> str:
    """`Kind: message`, the message without payload (see the module's docstring)."""
    return f"{type(e).__name__}: {safe_text(str(e), limit)}"


def safe_text(text: str, limit: int = MAX_CHARS) -> str:
    """`text` without a pipeline command's arguments, quoted input or binary runs, cut
    to `limit` characters."""
    text = _WHITESPACE.sub(" ", text)
    text = _PIPELINE.sub(lambda m: f"command #{m[1]} ({m[2]} ...) of pipeline failed: ", text)
    text = _INPUT_VALUE.sub("input_value=..., input_type=", text)
    text = _BINARY_RUN.sub(BINARY, text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def size_text(num_bytes: int) -> str:
    """A byte count for a log line: 512 B, 1.5 KB, 3.2 MB."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    if num_bytes < 1024 * 1024:
        return f"{num_bytes / 1024:.1f} KB"
    return f"{num_bytes / (1024 * 1024):.1f} MB"

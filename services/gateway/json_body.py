"""Request bytes to a JSON object, refusing what would hurt the code behind it.

Python's json parser recurses once per nesting level and raises RecursionError deep
down; the chat template and pydantic recurse again later. A lone UTF-16 surrogate
("\\ud800") decodes to a Python string that no UTF-8 encoder (the tokenizer's included)
accepts. Both are a 400 here, before anything else sees the body.
"""

from __future__ import annotations

import json
import re
from typing import Any

from spillway.services.gateway.errors import invalid

# Far above what an OpenAI body needs (a tool's JSON schema is the deepest part).
MAX_JSON_DEPTH = 64
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8: {e}") from e
    try:
        body = json.loads(text)
    except RecursionError as e:
        raise invalid(_too_deep()) from e
    except json.JSONDecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from e
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise invalid(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_json_value(body)
    return body


def check_json_value(value: Any) -> None:
    """Raises a 400 ApiError for nesting beyond MAX_JSON_DEPTH or a lone surrogate in any
    string (keys included). Iterative, so any depth is safe to check."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise invalid(_too_deep())
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    found = _LONE_SURROGATE.search(text)
    if found is not None:
        raise invalid(
            f"the request holds a lone UTF-16 surrogate (\\u{ord(found.group()):04x}), "
            "which is not a Unicode character: send text as valid UTF-8"
        )


def _too_deep() -> str:
    return f"the request body nests deeper than {MAX_JSON_DEPTH} levels"

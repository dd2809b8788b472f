"""Structured output: `response_format` and forced tool calls as grammars for the worker.

The gateway turns a JSON schema into an xgrammar grammar (EBNF text, which the worker
compiles against its vocabulary and enforces token by token). xgrammar accepts some JSON
Schema keywords that it does not enforce (it would ignore `uniqueItems` or `not`), so every
schema is first checked against the keywords it does enforce: anything else is a 400 that
names the keyword and where it is, never an answer that silently breaks the schema.

Enforced: type (one or a list), enum, const, anyOf, oneOf (as anyOf: keep the branches
disjoint), allOf with one member, $ref into the document ($defs, definitions), properties,
required, additionalProperties, patternProperties, propertyNames, min/maxProperties, items,
prefixItems, min/maxItems, min/maxLength, pattern, format (FORMATS), minimum, maximum,
exclusiveMinimum, exclusiveMaximum, multipleOf (integers), nullable; annotations (title,
description, default, examples, ...) and `x-` extensions are allowed and have no effect.

Output is compact JSON with ", " and ": " separators and no other whitespace (a small model
cannot wander off into blank lines). With `strict`, an object has no property its schema
does not name (OpenAI's strict mode); without it, JSON Schema's default applies.

xgrammar imports torch: it is loaded on a helper thread when the gateway starts, and only
a structured request that arrives before that finished waits for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from spillway.services.gateway.errors import invalid

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",
    }
)
ENFORCED = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "nullable",
        "uniqueItems",  # false only
    }
)
FORMATS = frozenset(
    {
        "date",
        "date-time",
        "time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Keywords whose value is one subschema, a list of them, or a name -> subschema table.
_ONE = ("additionalProperties", "propertyNames", "items")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_TABLE = ("properties", "patternProperties", "$defs", "definitions")
MAX_SCHEMA_BYTES = 256 << 10
# xgrammar (0.2.9) spells a character of a length-bounded string as "anything but a quote,
# a backslash or a line break", which lets a raw tab or other control character through:
# invalid JSON. It is replaced by the class its unbounded strings use.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def check_schema(schema: Any, param: str) -> None:
    """Raises a 400 naming the first keyword of `schema` the grammar cannot enforce."""
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise invalid(f"{param}: the schema is larger than {MAX_SCHEMA_BYTES} bytes", param)
    for path, node in _subschemas(schema, "#"):
        problem = _unsupported(node)
        if problem is not None:
            raise invalid(
                f"{param}: {problem} at {path} cannot be enforced; supported keywords are "
                "listed in docs/api.md (Structured output)",
                param,
                "unsupported_schema",
            )


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, bool):
        return
    yield path, node
    if not isinstance(node, dict):
        return
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            yield from _subschemas(node[key], f"{path}/{key}")
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
    for key in _TABLE:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")


def _unsupported(node: Any) -> str | None:
    if not isinstance(node, dict):
        return f"a schema that is a {type(node).__name__}"
    for key, value in node.items():
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key not in ENFORCED:
            return f"keyword `{key}`"
        if key == "uniqueItems" and value is not False:
            return "keyword `uniqueItems`"
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return "`allOf` with more than one schema"
        if key == "format" and value not in FORMATS:
            return f"format `{value}`"
        if key == "multipleOf" and not _integer_only(node.get("type")):
            return "`multipleOf` on a non-integer"
        if key == "items" and not isinstance(value, (dict, bool)):
            return "keyword `items` as a list (use `prefixItems`)"
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            return f"`$ref` {value!r} outside the document"
    return None


def _integer_only(types: Any) -> bool:
    names = types if isinstance(types, list) else [types]
    return "integer" in names and "number" not in names


class GrammarBuilder:
    """Builds xgrammar grammars (EBNF text for the worker); xgrammar loads in the background."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xgrammar-import")
        self._xgr: Future[Any] = self._pool.submit(_import_xgrammar)
        self._pool.shutdown(wait=False)

    @property
    def xgr(self) -> Any:
        return self._xgr.result()

    def json_schema(self, schema: Any, strict: bool, param: str) -> Any:
        """The grammar of JSON text valid under `schema` (checked first)."""
        check_schema(schema, param)
        try:
            grammar = self.xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=strict
            )
            text = str(grammar)
            if _LOOSE_STRING_CHAR in text:
                fixed = text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
                grammar = self.xgr.Grammar.from_ebnf(fixed)
            return grammar
        except Exception as e:  # xgrammar's own refusal: bad $ref, bad pattern, ...
            raise invalid(f"{param}: the schema cannot be compiled: {_last_line(e)}", param) from e

    def xml_arguments(self, schema: Any, param: str) -> Any:
        """Arguments valid under `schema` as Qwen3-Coder's `<parameter=...>` blocks."""
        check_schema(schema, param)
        st = self.xgr.structural_tag
        form = st.JSONSchemaFormat(json_schema=schema, style="qwen_xml", max_whitespace_cnt=1)
        try:
            return self.xgr.Grammar.from_structural_tag(st.StructuralTag(format=form))
        except Exception as e:
            raise invalid(f"{param}: the schema cannot be compiled: {_last_line(e)}", param) from e

    def literal(self, text: str) -> Any:
        return self.xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")

    def literals(self, text: str) -> list[Any]:
        """The literal as a list of parts to concatenate: none for the empty text."""
        return [self.literal(text)] if text else []

    def concat(self, *parts: Any) -> Any:
        return parts[0] if len(parts) == 1 else self.xgr.Grammar.concat(*parts)

    def union(self, *parts: Any) -> Any:
        return parts[0] if len(parts) == 1 else self.xgr.Grammar.union(*parts)

    def repeat(self, grammar: Any, separator: str, most: int) -> Any:
        """`grammar` once, then up to `most - 1` more times, each after `separator`."""
        if most == 1:
            return grammar
        between = f"{json.dumps(separator, ensure_ascii=False)} " if separator else ""
        rule = f"root ({between}root){{0, {most - 1}}}"
        text = f"{grammar}\nspillway_repeat ::= {rule}\n"
        return self.xgr.Grammar.from_ebnf(text, root_rule_name="spillway_repeat")

    def triggered(
        self, items: list[tuple[str, Any, str]], trigger: str, param: str, xml: bool = False
    ) -> Any:
        """Free text in which every `trigger` starts one of the items: its begin text,
        arguments valid under its schema (checked first; JSON, or with `xml` Qwen3-Coder's
        parameter blocks), its end text."""
        for _, schema, _ in items:
            check_schema(schema, param)
        try:
            if xml:
                st = self.xgr.structural_tag
                tags = [
                    st.TagFormat(
                        begin=begin,
                        content=st.JSONSchemaFormat(
                            json_schema=schema, style="qwen_xml", max_whitespace_cnt=1
                        ),
                        end=end,
                    )
                    for begin, schema, end in items
                ]
                form = st.TriggeredTagsFormat(triggers=[trigger], tags=tags)
                return self.xgr.Grammar.from_structural_tag(st.StructuralTag(format=form))
            legacy = [
                self.xgr.StructuralTagItem(begin=begin, schema=json.dumps(schema), end=end)
                for begin, schema, end in items
            ]
            return self.xgr.Grammar.from_structural_tag(legacy, [trigger])
        except Exception as e:
            raise invalid(f"{param}: the schema cannot be compiled: {_last_line(e)}", param) from e


def _last_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


def _import_xgrammar() -> Any:
    import xgrammar

    return xgrammar


def response_format_grammar(builder: GrammarBuilder, response_format: Any) -> str | None:
    """The EBNF for a request's `response_format` (None for `text` or none given)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        grammar = builder.json_schema({"type": "object"}, False, "response_format")
        return str(grammar)
    spec = response_format.json_schema
    if spec is None:
        raise invalid(
            "response_format: type json_schema needs a `json_schema` object",
            "response_format.json_schema",
        )
    param = "response_format.json_schema.schema"
    if spec.schema_ is None:
        raise invalid(f"{param} is required", param)
    return str(builder.json_schema(spec.schema_, bool(spec.strict), param))

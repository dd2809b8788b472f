"""The gateway's OpenAPI 3.1 document (GET /openapi.json), as FastAPI-based servers such as
vLLM publish theirs: request bodies from the very pydantic models that validate them, so
the document cannot drift from what the gateway accepts. Schema-driven tools (clients,
schemathesis in the tests) read it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel

from spillway.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from spillway.services.gateway.tokenize_api import Detokenize, TokenizeCompletion

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {
    "400": "invalid input",
    "401": "missing or wrong API key (when one is set)",
    "404": "unknown model",
    "408": "the body did not arrive in time",
    "413": "the body is too large",
    "429": "the admission queue is full (Retry-After)",
    "503": "no scheduler or worker can serve it, or the gateway is draining (Retry-After)",
}


def openapi_document(model_id: str, context_length: int, vocab_size: int) -> dict[str, Any]:
    doc = dict(_document(context_length, vocab_size))
    doc["info"] = {**doc["info"], "description": f"Serves `{model_id}`."}
    return doc


@cache
def _document(context_length: int, vocab_size: int) -> dict[str, Any]:
    schemas: dict[str, Any] = {"ErrorBody": _ERROR_BODY, "Object": {"type": "object"}}
    for model in (ChatCompletionRequest, CompletionRequest, TokenizeCompletion, Detokenize):
        schemas.update(_component(model, schemas))
    schemas["ResponsesRequest"] = _RESPONSES_REQUEST
    _served_limits(schemas, context_length, vocab_size)
    return {
        "openapi": "3.1.0",
        "info": {"title": "spillway", "version": "1"},
        "paths": {
            "/v1/chat/completions": {"post": _generation("ChatCompletionRequest", "chat")},
            "/v1/completions": {"post": _generation("CompletionRequest", "completions")},
            "/v1/responses": {"post": _generation("ResponsesRequest", "responses")},
            "/tokenize": {"post": _generation("TokenizeCompletion", "tokenize")},
            "/detokenize": {"post": _generation("Detokenize", "detokenize")},
            "/v1/models": {"get": _get("the served model", "models")},
            "/v1/models/{model}": {
                "get": {
                    **_get("one model", "model"),
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                }
            },
            "/health": {"get": _get("200 while a worker can serve, else 503", "health")},
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "responses": {
                        "200": {
                            "description": "Prometheus text format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {"schemas": schemas},
    }


def _served_limits(schemas: dict[str, Any], context_length: int, vocab_size: int) -> None:
    """What the pydantic models cannot know: the served model's limits. A prompt is not
    empty and its token ids lie in the vocabulary; max_tokens fits the context; a
    message has content (only an assistant's tool calls may go without)."""
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    ids = {"type": "array", "items": token, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt")
    if prompt is not None:
        prompt["anyOf"] = [
            text,
            ids,
            {"type": "array", "items": text, "minItems": 1},
            {"type": "array", "items": ids, "minItems": 1},
        ]
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        for field in ("max_tokens", "max_completion_tokens"):
            limit = schemas.get(request, {}).get("properties", {}).get(field)
            for option in (limit or {}).get("anyOf", []):
                if option.get("type") == "integer":
                    option["maximum"] = context_length - 1
    message = schemas.get("ChatMessage")
    if message is not None and "content" in message.get("properties", {}):
        content = message["properties"]["content"]
        content["anyOf"] = [o for o in content.get("anyOf", []) if o.get("type") != "null"]
        content.pop("default", None)
        message["required"] = sorted({*message.get("required", []), "content"})


def _component(model: type[BaseModel], known: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF)
    out = {name: s for name, s in schema.pop("$defs", {}).items() if name not in known}
    out[model.__name__] = schema
    return out


def _generation(body_schema: str, operation: str) -> dict[str, Any]:
    return {
        "operationId": operation,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=body_schema)}}},
        },
        "responses": {
            "200": {
                "description": "the completion, or its Server-Sent Events with stream: true",
                "content": {
                    "application/json": {"schema": {"$ref": REF.format(model="Object")}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **_errors(),
        },
    }


def _get(description: str, operation: str) -> dict[str, Any]:
    return {
        "operationId": operation,
        "responses": {
            "200": {
                "description": description,
                "content": {"application/json": {"schema": {"$ref": REF.format(model="Object")}}},
            },
            **_errors(),
        },
    }


def _errors() -> dict[str, Any]:
    return {
        status: {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}},
        }
        for status, description in ERROR_STATUSES.items()
    }


# The Responses API's request as served (openai_responses.py turns it into a chat body).
_RESPONSES_REQUEST = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": {"type": "string"},
        "input": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "object"}},
            ]
        },
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": ["boolean", "null"]},
        "tools": {"type": ["array", "null"], "items": {"type": "object"}},
        "tool_choice": {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "reasoning": {"type": ["object", "null"]},
        "text": {"type": ["object", "null"]},
        "metadata": {"type": ["object", "null"]},
        "store": {"type": ["boolean", "null"]},
    },
}

_ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

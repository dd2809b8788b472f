"""What the HTTP and the NATS API share: open a generation for a request body, then
either collect it into one response body or produce its stream of chunks.

The caller owns the request's root span; this module names it with the OpenTelemetry
GenAI attributes and submits with its context, so the scheduler's and workers' spans
join the same trace.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from opentelemetry import trace

from spillway.services.gateway.engine import GatewayEngine, RequestRun
from spillway.services.gateway.errors import ApiError
from spillway.services.gateway.responses import (
    ChunkBuilder,
    ResponseMeta,
    completion_body,
    models_body,
)
from spillway.services.gateway.validation import Kind, ModelInfo, PreparedRequest, RequestPreparer


class Generation:
    """One request in flight; always `close()` it (aborts what is still running)."""

    def __init__(self, run: RequestRun, meta: ResponseMeta, span: trace.Span) -> None:
        self.run = run
        self.meta = meta
        self.span = span
        self._closed = False

    @property
    def prepared(self) -> PreparedRequest:
        return self.run.prepared

    async def collect(self) -> dict[str, Any]:
        async for step in self.run.steps():
            if step.error is not None:
                raise ApiError.from_info(step.error)
        return completion_body(self.meta, self.run.outputs, self.run.usage)

    async def chunks(self, usage_in_last: bool = False) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (SSE `data:` bodies). `usage_in_last` (the NATS API): the
        finish chunk of the last choice to end carries the usage, and no usage chunk
        follows. A failure mid-stream raises ApiError."""
        builder = ChunkBuilder(self.meta, self.prepared.include_usage and not usage_in_last)
        for chunk in builder.opening(self.prepared.num_choices):
            yield chunk
        async for step in self.run.steps():
            if step.error is not None:
                raise ApiError.from_info(step.error)
            if usage_in_last and step.finish_reason is not None and self.run.finished:
                for chunk in builder.step(replace(step, finish_reason=None)):
                    yield chunk
                yield builder.finish(step.index, step.finish_reason, self.run.usage)
                continue
            for chunk in builder.step(step):
                yield chunk
        if builder.include_usage:
            yield builder.usage(self.run.usage)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.run.close()
        usage = self.run.usage
        self.span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        self.span.set_attribute("gen_ai.response.finish_reasons", self.run.finish_reasons)


class GatewayApi:
    def __init__(self, engine: GatewayEngine, preparer: RequestPreparer, model: ModelInfo) -> None:
        self.engine = engine
        self.preparer = preparer
        self.model = model
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return models_body(
            self.model.listed or (self.model.model_id,), self.created, self.model.context_length
        )

    async def open(
        self,
        kind: Kind,
        body: dict[str, Any],
        span: trace.Span,
        arrival: float,
        aliases: list[str] | None = None,
    ) -> Generation:
        """Validates and submits; raises ApiError (nothing left running) on any refusal.
        Templating and tokenizing run on a worker thread: a big body never stalls the
        event loop that serves everyone else."""
        prepared = await asyncio.to_thread(self.preparer.prepare, kind, body)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        meta = ResponseMeta(
            id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=prepared.model,
            kind=kind,
            want_logprobs=prepared.sampling.logprobs is not None,
            legacy_functions=prepared.legacy_functions,
        )
        _annotate_request(span, prepared, meta)
        run = await self.engine.submit(
            prepared,
            arrival,
            context=trace.set_span_in_context(span),
            aliases=[*(aliases or []), meta.id],
        )
        span.set_attribute("spillway.request_ids", run.request_ids)
        # One id per choice; the scheduler's and worker's spans carry theirs.
        ids = run.request_ids
        span.set_attribute("spillway.request.id", ids[0] if len(ids) == 1 else ids)
        return Generation(run, meta, span)


def _annotate_request(span: trace.Span, prepared: PreparedRequest, meta: ResponseMeta) -> None:
    sampling = prepared.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat" if prepared.kind == "chat" else "text_completion",
        "gen_ai.system": "spillway",
        "gen_ai.request.model": prepared.model,
        "gen_ai.response.model": prepared.model,
        "gen_ai.response.id": meta.id,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.seed": sampling.seed,
        "gen_ai.request.choice.count": prepared.num_choices,
        "gen_ai.request.stream": prepared.stream,
        "spillway.request.priority": prepared.priority,
    }
    if sampling.top_k:
        attributes["gen_ai.request.top_k"] = sampling.top_k
    if prepared.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = prepared.max_tokens
    if prepared.stop:
        attributes["gen_ai.request.stop_sequences"] = prepared.stop
    if prepared.deadline_ms is not None:
        attributes["spillway.request.deadline_ms"] = prepared.deadline_ms
    span.set_attributes(attributes)

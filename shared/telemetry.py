"""OpenTelemetry set-up for one service, and W3C trace context in and out of headers.

Every service has a real SDK tracer provider (so ids exist and `traceparent` can be
returned even when nothing is exported); spans are exported with OTLP/HTTP when an
endpoint is configured, and appended to a file as OTLP JSON lines when a trace file is
(trace_file.py); either, both or neither.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
_propagator = TraceContextTextMapPropagator()

SERVICE_NAMES = {
    "gateway": "spillway-gateway",
    "scheduler": "spillway-scheduler",
    "worker": "spillway-worker",
    "spillstore": "spillway-spillstore",
}


class Telemetry:
    """One service's tracer. `exporting` tells hot paths whether detailed spans are worth it."""

    def __init__(
        self, service: str, otlp_endpoint: str | None, trace_file: str | None = None
    ) -> None:
        resource = Resource.create({"service.name": SERVICE_NAMES.get(service, service)})
        self.provider = TracerProvider(resource=resource)
        self.exporting = bool(otlp_endpoint or trace_file)
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            # The endpoint is a base URL; the signal path is appended as the OTel spec says.
            url = otlp_endpoint.rstrip("/") + "/v1/traces"
            self.provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=500)
            )
        if trace_file:
            from spillway.shared.trace_file import FileSpanExporter

            self.provider.add_span_processor(
                BatchSpanProcessor(FileSpanExporter(trace_file), schedule_delay_millis=500)
            )
        self.tracer = self.provider.get_tracer("spillway")

    def shutdown(self) -> None:
        try:
            self.provider.shutdown()
        except Exception:  # exporting is best effort; never block a shutdown on it
            log.exception("telemetry shutdown failed")


def inject(context: Context | None = None) -> dict[str, str]:
    """W3C `traceparent` (and `tracestate`) headers for `context` (default: the current)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier


def extract(headers: Mapping[str, str] | None) -> Context:
    """The context a message's headers carry (an empty context when they carry none)."""
    if not headers:
        return Context()
    lowered = {k.lower(): v for k, v in headers.items()}
    return _propagator.extract(lowered)

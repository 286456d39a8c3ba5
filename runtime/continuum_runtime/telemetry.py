"""OpenTelemetry tracing: one tracer provider per process, spans per RPC (no exporter by default)."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor


def tracer_provider(service: str, *, console: bool = False) -> TracerProvider:
    """A provider naming `service`; `console` prints finished spans (ids and timings only)."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"continuum-{service}"}))
    if console:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    return provider

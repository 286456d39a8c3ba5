"""OpenTelemetry tracing: one tracer provider per process, spans per RPC (no exporter by default)."""

from __future__ import annotations

import sys

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor


def tracer_provider(service: str, exporter: str) -> TracerProvider | None:
    """A provider naming `service` that sends spans to `exporter`, or None for "none".

    With no exporter there is no provider at all, so no span is made: a span per RPC that goes
    nowhere still costs every call.
    """
    if exporter == "none":
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": f"continuum-{service}"}))
    if exporter == "console":
        # Span names, ids, timings and RPC attributes only; handlers never put bodies on spans.
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
    return provider

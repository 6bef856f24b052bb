"""One OpenTelemetry SDK provider for the whole test session, exporting to memory.

The global tracer provider can be set only once per process, so the provider and its
exporter live here at module level; tests clear the exporter instead of replacing them.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
# Simple, not batch: a span is in the exporter the moment it ends, with no flush to wait for.
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))


def install() -> TracerProvider:
    """Make :data:`PROVIDER` the global tracer provider; a second call changes nothing."""
    if trace.get_tracer_provider() is not PROVIDER:
        trace.set_tracer_provider(PROVIDER)
    # Another provider set first would silently swallow every span these tests look for.
    assert trace.get_tracer_provider() is PROVIDER, "a different global tracer provider is set"
    return PROVIDER

"""OpenTelemetry spans for decisions and effects, when the ``otel`` extra is installed.

A thin layer: without ``opentelemetry-api`` every function here is a no-op and the
runtime runs unchanged, so the base install carries no tracing dependency.

The trace follows the operation: ``record_decision`` stores the active span's W3C
``traceparent`` in the outbox row, the dispatcher copies it into the message headers,
and the consumer starts the attempt span as its child, so decision -> publish -> effect
is one trace. Reconciliation has no message in hand and starts a trace of its own,
tied to the operation by its id attribute.

Span attributes obey the redaction rules of docs/design.md section 10: only the keys in
:data:`ALLOWED_ATTRIBUTES` (ids, codes, counters, the sanitized fingerprint, the
provider reference) are accepted. Tool inputs never reach a span.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from outbox.fingerprint import sanitized

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `otel` extra is not installed: tracing is off
    AVAILABLE = False
else:
    AVAILABLE = True

TRACER_NAME = "effect-outbox"
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")

AttributeValue = str | int | bool

# Everything a span may carry. A key outside this set is a programming error: it is
# how a tool input would leak into a tracing backend, so it fails loudly instead.
ALLOWED_ATTRIBUTES = frozenset(
    {
        "outbox.operation_id",
        "outbox.tool",
        "outbox.tool_version",
        "outbox.attempt",
        "outbox.reconcile_attempt",
        "outbox.fingerprint",
        "outbox.outcome",
        "outbox.code",
        "outbox.result",
        "outbox.provider_reference",
    }
)


def valid_traceparent(value: object) -> str | None:
    """``value`` if it is a W3C traceparent (version 00), else None: a header from the
    broker is untrusted input and nothing else may pass into a span's parentage."""
    if isinstance(value, str) and TRACEPARENT.fullmatch(value):
        return value
    return None


def active() -> bool:
    """Whether spans can be recorded: OpenTelemetry is installed and an SDK tracer
    provider is set. Without one every span is a no-op, yet building it (its parent's
    context, its attributes, the keyed fingerprint) cost about 20 us an attempt."""
    if not AVAILABLE:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def current_traceparent() -> str | None:
    """The W3C traceparent of the active span, or None (no span, or no OpenTelemetry)."""
    if not AVAILABLE:
        return None
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return valid_traceparent(carrier.get("traceparent"))


def _checked(attributes: Mapping[str, AttributeValue | None]) -> dict[str, AttributeValue]:
    unknown = sorted(set(attributes) - ALLOWED_ATTRIBUTES)
    if unknown:
        raise ValueError(f"span attributes outside the redaction allow-list: {unknown}")
    # None means "not known" (a provider that gave no reference): the attribute is left out.
    checked = {key: value for key, value in attributes.items() if value is not None}
    if "outbox.fingerprint" in checked:
        checked["outbox.fingerprint"] = sanitized(str(checked["outbox.fingerprint"]))
    return checked


class SpanHandle:
    """What :func:`span` yields: sets the outcome of the span (a no-op without OTel)."""

    def __init__(self, otel_span: Any = None) -> None:
        self._span = otel_span

    @property
    def recording(self) -> bool:
        return self._span is not None and bool(self._span.is_recording())

    def set_attributes(self, attributes: Mapping[str, AttributeValue | None]) -> None:
        checked = _checked(attributes)
        if self._span is not None:
            self._span.set_attributes(checked)

    def set_status(self, ok: bool, code: str | None = None) -> None:
        """OK, or ERROR described by a code (a label such as ``deadline_exceeded``)."""
        if self._span is None:
            return
        if ok:
            self._span.set_status(Status(StatusCode.OK))
        else:
            self._span.set_status(Status(StatusCode.ERROR, code))


@contextlib.contextmanager
def span(
    name: str,
    *,
    parent_traceparent: str | None,
    attributes: Mapping[str, AttributeValue | None],
    kind: Literal["consumer", "internal"] = "internal",
) -> Iterator[SpanHandle]:
    """A span named ``name``, the child of ``parent_traceparent`` (a new trace when it
    is None or not a valid traceparent), current for the duration of the block."""
    checked = _checked(attributes)
    if not active():
        yield SpanHandle()
        return
    parent = valid_traceparent(parent_traceparent)
    # An explicit empty context, not the ambient one: the span's parent is what the
    # message says, never whatever happened to be current in the consumer's task.
    context = (
        TraceContextTextMapPropagator().extract({"traceparent": parent})
        if parent is not None
        else Context()
    )
    tracer = trace.get_tracer(TRACER_NAME)
    # Exceptions are not recorded: their messages can quote tool input. The caller sets
    # the status from a code instead.
    with tracer.start_as_current_span(
        name,
        context=context,
        kind=SpanKind.CONSUMER if kind == "consumer" else SpanKind.INTERNAL,
        attributes=checked,
        record_exception=False,
        set_status_on_exception=False,
    ) as otel_span:
        yield SpanHandle(otel_span)

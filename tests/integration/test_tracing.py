"""OpenTelemetry across the outbox: decision -> publish -> effect in one trace.

An agent span is current when the decision is recorded; the dispatcher and consumer run
in process; the in-memory exporter shows what a tracing backend would receive.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outbox import OperationState, Registry, Settings, record_decision, tracing
from outbox.fingerprint_key import keyed_fingerprint

from support import otel_helpers
from support.consume_helpers import in_state, running_consumer
from support.db_helpers import execute_admin
from support.dispatch_helpers import counter_value, running_dispatcher
from support.sample_tools import Ledger
from support.waiting import eventually

S = OperationState
CANARY = "canary-7f3e-never-in-a-span"
REFUND = {"payment_id": "pay_1", "amount_cents": 1250, "reason": f"customer said {CANARY}"}


@pytest.fixture(scope="session")
def tracer_provider() -> TracerProvider:
    return otel_helpers.install()


@pytest.fixture
def exporter(tracer_provider: TracerProvider) -> Iterator[InMemorySpanExporter]:
    otel_helpers.EXPORTER.clear()
    yield otel_helpers.EXPORTER
    otel_helpers.EXPORTER.clear()


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.model_copy(update={"reconcile_interval": 0.05, "lease_margin": 0.5})


def traceparent_of(span: trace.Span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def outbox_headers(database_url: str, operation_id: Any) -> dict[str, Any]:
    rows = execute_admin(
        database_url, "SELECT headers FROM outbox WHERE operation_id = %s", (operation_id,)
    )
    assert len(rows) == 1
    headers: dict[str, Any] = rows[0][0]
    return headers


def decide_in_agent_span(engine: Any, registry: Registry, **options: Any) -> tuple[Any, Any]:
    """Record a refund while an agent span is current; returns (operation, agent span)."""
    agent_tracer = trace.get_tracer("agent")
    with agent_tracer.start_as_current_span("agent.turn") as agent_span, engine.begin() as tx:
        recorded = record_decision(tx, registry, "send_refund", REFUND, run_id="run", **options)
    return recorded.operation, agent_span


def named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


async def test_decision_publish_and_effect_are_one_trace(
    fast: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    exporter: InMemorySpanExporter,
) -> None:
    ledger.faults.append("drop_response")  # an unknown outcome, so a reconciliation too
    op, agent_span = decide_in_agent_span(engine, registry)
    agent = agent_span.get_span_context()
    assert outbox_headers(database_url, op.id) == {"traceparent": traceparent_of(agent_span)}

    async with running_dispatcher(fast), running_consumer(fast, registry):
        await eventually(in_state(database_url, op.id, S.COMMITTED), within=30, what="committed")

    spans = exporter.get_finished_spans()
    [attempt] = named(spans, "outbox.attempt send_refund")
    assert attempt.context is not None
    assert attempt.parent is not None
    assert attempt.context.trace_id == agent.trace_id
    assert attempt.parent.span_id == agent.span_id
    assert attempt.kind is SpanKind.CONSUMER
    assert attempt.status.status_code is StatusCode.ERROR
    assert dict(attempt.attributes or {}) == {
        "outbox.operation_id": str(op.id),
        "outbox.tool": "send_refund",
        "outbox.tool_version": 1,
        "outbox.attempt": 1,
        "outbox.fingerprint": keyed_fingerprint(deployment_key(database_url), op.input_fingerprint),
        "outbox.outcome": "outcome_unknown",
        "outbox.code": "connection_lost",
    }

    [reconcile] = named(spans, "outbox.reconcile send_refund")
    assert reconcile.context is not None
    assert reconcile.parent is None  # no message to continue: a trace of its own
    assert reconcile.context.trace_id != agent.trace_id
    attributes = dict(reconcile.attributes or {})
    assert attributes["outbox.operation_id"] == str(op.id)
    assert attributes["outbox.result"] == "committed"
    assert attributes["outbox.provider_reference"] == f"re_{str(op.id)[:8]}"
    assert reconcile.status.status_code is StatusCode.OK

    for span in spans:
        seen = [
            span.name,
            span.status.description or "",
            *map(str, (span.attributes or {}).values()),
        ]
        assert not any(CANARY in text for text in seen), span.name


async def test_each_operation_of_a_chunk_continues_its_own_decisions_trace(
    fast: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    exporter: InMemorySpanExporter,
) -> None:
    decided = []
    for key in ("k1", "k2"):
        op, agent_span = decide_in_agent_span(engine, registry, decision_key=key)
        decided.append((op, agent_span.get_span_context()))
    chunked = fast.model_copy(update={"message_operations": 4})

    # Both rows are waiting before the dispatcher starts: one batch, one message.
    async with running_dispatcher(chunked), running_consumer(chunked, registry) as consumer:
        for op, _ in decided:
            await eventually(in_state(database_url, op.id, S.COMMITTED), within=30, what="done")

    assert counter_value(consumer, "outbox_consumer_deliveries_total", result="processed") == 2
    attempts = {
        dict(span.attributes or {})["outbox.operation_id"]: span
        for span in named(exporter.get_finished_spans(), "outbox.attempt send_refund")
    }
    assert set(attempts) == {str(op.id) for op, _ in decided}
    for op, agent in decided:
        attempt = attempts[str(op.id)]
        assert attempt.context is not None
        assert attempt.parent is not None
        assert attempt.context.trace_id == agent.trace_id
        assert attempt.parent.span_id == agent.span_id


async def test_a_committed_attempt_carries_its_provider_reference(
    fast: Settings,
    registry: Registry,
    engine: Any,
    database_url: str,
    exporter: InMemorySpanExporter,
) -> None:
    op, _ = decide_in_agent_span(engine, registry)

    async with running_dispatcher(fast), running_consumer(fast, registry):
        await eventually(in_state(database_url, op.id, S.COMMITTED), within=30, what="committed")

    [attempt] = named(exporter.get_finished_spans(), "outbox.attempt send_refund")
    attributes = dict(attempt.attributes or {})
    assert attributes["outbox.outcome"] == "committed"
    assert attributes["outbox.provider_reference"] == f"re_{str(op.id)[:8]}"
    assert attempt.status.status_code is StatusCode.OK


def test_an_explicit_traceparent_wins_over_the_active_span(
    registry: Registry, engine: Any, database_url: str, exporter: InMemorySpanExporter
) -> None:
    explicit = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    op, _ = decide_in_agent_span(engine, registry, traceparent=explicit)
    assert outbox_headers(database_url, op.id) == {"traceparent": explicit}


def test_without_an_active_span_the_row_carries_no_traceparent(
    registry: Registry, engine: Any, database_url: str, exporter: InMemorySpanExporter
) -> None:
    with engine.begin() as connection:
        op = record_decision(connection, registry, "send_refund", REFUND, run_id="run").operation
    assert outbox_headers(database_url, op.id) == {}


def test_a_malformed_parent_starts_a_new_trace(exporter: InMemorySpanExporter) -> None:
    agent_tracer = trace.get_tracer("agent")
    with (
        agent_tracer.start_as_current_span("agent.turn") as agent_span,
        tracing.span(
            "outbox.attempt send_refund",
            parent_traceparent="01-not-a-traceparent",
            attributes={"outbox.tool": "send_refund"},
        ),
    ):
        pass
    [attempt] = named(exporter.get_finished_spans(), "outbox.attempt send_refund")
    assert attempt.parent is None  # neither the garbage nor the ambient agent span
    assert attempt.context is not None
    assert attempt.context.trace_id != agent_span.get_span_context().trace_id


def test_attributes_outside_the_allow_list_are_refused(exporter: InMemorySpanExporter) -> None:
    with (
        pytest.raises(ValueError, match="allow-list"),
        tracing.span("outbox.attempt x", parent_traceparent=None, attributes={"reason": "x"}),
    ):
        pass
    with (
        tracing.span("outbox.attempt x", parent_traceparent=None, attributes={}) as handle,
        pytest.raises(ValueError, match="allow-list"),
    ):
        handle.set_attributes({"input.reason": CANARY})
    assert all(CANARY not in str(s.attributes) for s in exporter.get_finished_spans())


def test_without_the_api_tracing_is_a_no_op(
    monkeypatch: pytest.MonkeyPatch, exporter: InMemorySpanExporter
) -> None:
    monkeypatch.setattr(tracing, "AVAILABLE", False)
    with trace.get_tracer("agent").start_as_current_span("agent.turn"):
        assert tracing.current_traceparent() is None
        with tracing.span(
            "outbox.attempt send_refund",
            parent_traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            attributes={"outbox.tool": "send_refund"},
            kind="consumer",
        ) as handle:
            assert not handle.recording
            handle.set_attributes({"outbox.outcome": "committed"})
            handle.set_status(False, "deadline_exceeded")
    assert [span.name for span in exporter.get_finished_spans()] == ["agent.turn"]


def deployment_key(database_url: str) -> str:
    key: str = execute_admin(database_url, "SELECT fingerprint_key FROM outbox_deployment")[0][0]
    return key


NO_SDK_PROBE = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from outbox import tracing

states = [tracing.active()]
with tracing.span("outbox.attempt send_refund", parent_traceparent=None,
                  attributes={"outbox.tool": "send_refund"}, kind="consumer") as handle:
    states.append(handle.recording)
trace.set_tracer_provider(TracerProvider())
states.append(tracing.active())
with tracing.span("outbox.attempt send_refund", parent_traceparent=None,
                  attributes={"outbox.tool": "send_refund"}, kind="consumer") as handle:
    states.append(handle.recording)
print(states)
"""


def test_spans_are_skipped_until_an_sdk_provider_is_set() -> None:
    # In a fresh interpreter: a provider, once set, is global for the whole process.
    result = subprocess.run(
        [sys.executable, "-c", NO_SDK_PROBE], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[False, False, True, True]"

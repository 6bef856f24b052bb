"""The dispatcher's pure parts: the wire message, error classification, retry delays."""

from __future__ import annotations

import argparse
import asyncio
import gc
import uuid
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any, cast

import aiormq.exceptions
import pytest
from pamqp.commands import Basic
from pamqp.header import ContentHeader

import dispatcher.cli
from dispatcher.daemon import GATHER_FROM_DECISIONS, Dispatcher, DrainReport, _Tally
from dispatcher.publisher import Publisher, PublishOutcome, classify, encode
from outbox.broker import BrokerUnavailable, OperationMessage, Topology
from outbox.settings import Settings
from outbox.store import ClaimedRow

OPERATION = uuid.UUID("3f2a4c1e-0d6b-4f7a-9c1e-2b3d4e5f6a7b")


def row(**overrides: object) -> ClaimedRow:
    fields: dict[str, object] = {
        "id": 42,
        "operation_id": OPERATION,
        "routing_key": "send_refund.v1",
        "traceparent": None,
        "publish_attempts": 0,
        "waited_seconds": 0.001,
        "tool_name": "send_refund",
        "tool_version": 3,
        "input_fingerprint": "ab" * 32,
    }
    fields.update(overrides)
    return ClaimedRow(**fields)  # type: ignore[arg-type]


def test_the_body_is_exactly_what_the_consumer_parses() -> None:
    encoded = encode(row())

    parsed = OperationMessage.model_validate_json(encoded.body)

    assert parsed == OperationMessage(
        operation_id=OPERATION,
        outbox_id=42,
        tool="send_refund",
        tool_version=3,
        input_fingerprint="ab" * 32,
    )


def test_properties_identify_the_row_and_persist_the_message() -> None:
    properties = encode(row()).properties

    assert properties.content_type == "application/json"
    assert properties.delivery_mode == 2
    assert properties.message_id == "outbox-42"
    assert properties.correlation_id == str(OPERATION)
    assert properties.message_type == "outbox.operation.v1"
    assert properties.app_id == "effect-outbox"
    assert properties.headers is None


def test_the_traceparent_travels_as_the_only_header() -> None:
    # Which headers a row may hold, and which traceparent is valid, the claim's SQL
    # decides (tests/integration/hostile_values/): the encoder gets text or None.
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

    with_trace = encode(row(traceparent=traceparent)).properties

    assert with_trace.headers == {"traceparent": traceparent}


def returned_message() -> aiormq.abc.DeliveredMessage:
    frame = Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="outbox", routing_key="k")
    return aiormq.abc.DeliveredMessage(
        delivery=frame,
        header=ContentHeader(),
        body=b"",
        channel=None,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (
            aiormq.exceptions.PublishError(returned_message(), Basic.Return(reply_text="NO_ROUTE")),
            "unroutable",
        ),
        (aiormq.exceptions.DeliveryError(None, Basic.Nack(delivery_tag=1)), "nacked"),
        (aiormq.exceptions.ChannelNotFoundEntity("no exchange"), "exchange_missing"),
        (TimeoutError(), "confirm_timeout"),
        (aiormq.exceptions.ConnectionClosed(320, "shutdown"), "connection_lost"),
        (aiormq.exceptions.ChannelInvalidStateError("closed"), "connection_lost"),
        (ValueError("odd"), "unexpected"),
    ],
)
def test_publish_failures_are_classified_without_payload(error: BaseException, reason: str) -> None:
    label, text = classify(error)

    assert label == reason
    assert text.startswith(f"{reason}:")


def test_an_unroutable_failure_names_the_broker_reply() -> None:
    _, text = classify(
        aiormq.exceptions.PublishError(returned_message(), Basic.Return(reply_text="NO_ROUTE"))
    )
    assert "NO_ROUTE" in text
    # What to run, for an operator who reads the outbox row's last_error.
    assert "run `outbox migrate --broker`" in text
    assert "OUTBOX_TOOL_QUEUES" in text


def test_retry_delay_doubles_with_jitter_and_is_capped() -> None:
    dispatcher = Dispatcher(Settings(publish_retry_initial=1.0, publish_retry_max=8.0))

    for attempts, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0), (10_000, 8.0)]:
        delay = dispatcher._retry_delay(attempts)
        assert timedelta(seconds=base * 0.5) <= delay <= timedelta(seconds=base * 1.5)


def test_the_command_freezes_the_start_up_heap_before_it_dispatches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frozen_when_dispatching: list[int] = []

    def fake_run_async(main: Coroutine[Any, Any, Any]) -> DrainReport:
        main.close()
        frozen_when_dispatching.append(gc.get_freeze_count())
        return DrainReport(published=0, failed=0)

    monkeypatch.setattr(dispatcher.cli, "run_async", fake_run_async)
    gc.unfreeze()
    try:
        code = dispatcher.cli.run(argparse.Namespace(once=True), Settings())
    finally:
        gc.unfreeze()  # give this test process's heap back to the collector

    assert code == 0
    assert frozen_when_dispatching
    assert frozen_when_dispatching[0] > 0


class ConfirmingChannel:
    """Stands in for the confirm channel: confirms the rows in ``confirmed``, leaves the
    others' confirms outstanding, and notes whether each publish waited for a drain."""

    def __init__(self, confirmed: set[str], cancelled: frozenset[str] = frozenset()) -> None:
        self.confirmed = confirmed
        self.cancelled = cancelled
        self.waits: list[bool] = []

    async def basic_publish(
        self, body: bytes, *, properties: Basic.Properties, wait: bool = True, **_: Any
    ) -> None:
        self.waits.append(wait)
        if properties.message_id in self.cancelled:
            # What aiormq does to the confirms outstanding on a connection it closes.
            raise asyncio.CancelledError
        if properties.message_id not in self.confirmed:
            await asyncio.Event().wait()  # a confirm that never comes


def publishing_on(
    channel: ConfirmingChannel, monkeypatch: pytest.MonkeyPatch, operations_per_message: int = 1
) -> Publisher:
    """A publisher whose confirm channel is ``channel``."""
    publisher = Publisher(
        "amqp://guest:guest@127.0.0.1/",
        15,
        Topology.from_settings(Settings()),
        "t",
        operations_per_message=operations_per_message,
    )

    async def underlay() -> ConfirmingChannel:
        return channel

    monkeypatch.setattr(Publisher, "usable", property(lambda _: True))
    monkeypatch.setattr(publisher, "_underlay", underlay)
    return publisher


async def test_publishes_skip_the_drain_wait_but_only_confirmed_rows_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    channel = ConfirmingChannel(confirmed={"outbox-1"})
    publisher = publishing_on(channel, monkeypatch)
    outcome = await publisher.publish([row(id=1), row(id=2)], confirm_within=0.05)

    assert channel.waits == [False, False]
    assert [published.id for published in outcome.published] == [1]
    assert [(failed.id, reason) for failed, reason, _ in outcome.failed] == [(2, "confirm_timeout")]
    assert outcome.connection_lost


async def test_a_confirm_cancelled_by_a_closing_connection_is_a_lost_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by the chaos run: the cancellation escaped publish() and the dispatcher
    # exited instead of reconnecting.
    channel = ConfirmingChannel(confirmed={"outbox-1"}, cancelled=frozenset({"outbox-2"}))
    publisher = publishing_on(channel, monkeypatch)
    outcome = await publisher.publish([row(id=1), row(id=2)], confirm_within=5)

    assert [published.id for published in outcome.published] == [1]
    assert [(failed.id, reason) for failed, reason, _ in outcome.failed] == [(2, "connection_lost")]
    assert outcome.connection_lost


async def test_the_rows_of_a_chunk_share_its_confirm_and_its_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    channel = ConfirmingChannel(confirmed={"outbox-1-n2", "outbox-5"})
    publisher = publishing_on(channel, monkeypatch, operations_per_message=2)
    rows = [row(id=n) for n in (1, 2, 3, 4)] + [row(id=5, routing_key="close_ticket.v1")]
    outcome = await publisher.publish(rows, confirm_within=0.05)

    # Three messages: two chunks of two and, under another routing key, a single one.
    assert len(channel.waits) == 3
    assert [published.id for published in outcome.published] == [1, 2, 5]
    assert [(failed.id, reason) for failed, reason, _ in outcome.failed] == [
        (3, "confirm_timeout"),
        (4, "confirm_timeout"),
    ]


class ScriptedBatches:
    """Stands in for ``Dispatcher._batch``: hands out ``backlog`` rows in batches of up to
    ``limit``, notes which connection claimed each, and counts the claims that found
    nothing (each a transaction in the real daemon)."""

    def __init__(self, backlog: int) -> None:
        self.backlog = backlog
        self.claims: list[tuple[str, int]] = []

    async def __call__(self, database: Any, publisher: Any, limit: int) -> PublishOutcome | None:
        await asyncio.sleep(0)  # let the other lanes run, as a round trip would
        taken = min(limit, self.backlog)
        self.backlog -= taken
        self.claims.append((database, taken))
        if not taken:
            return None
        return PublishOutcome(published=[row(id=n) for n in range(taken)])


@pytest.mark.parametrize("rows", [0, 1, 3])
async def test_a_wake_for_less_than_a_batch_claims_on_one_connection_once(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatcher = Dispatcher(Settings(dispatch_lanes=4, batch_size=5))
    batches = ScriptedBatches(rows)
    monkeypatch.setattr(dispatcher, "_batch", batches)
    tally = _Tally()

    await dispatcher._drain_available(
        cast(Any, ["lane-1", "lane-2", "lane-3", "lane-4"]), cast(Any, None), tally
    )

    assert batches.claims == [("lane-1", rows)]
    assert tally.published == rows


async def test_each_full_batch_brings_in_another_lane_up_to_one_per_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dispatcher = Dispatcher(Settings(dispatch_lanes=3, batch_size=5))
    limit = dispatcher.pacing.limit
    batches = ScriptedBatches(limit * 20 + 2)
    monkeypatch.setattr(dispatcher, "_batch", batches)
    tally = _Tally()

    await dispatcher._drain_available(
        cast(Any, ["lane-1", "lane-2", "lane-3"]), cast(Any, None), tally
    )

    assert tally.published == limit * 20 + 2
    assert {database for database, _ in batches.claims} == {"lane-1", "lane-2", "lane-3"}
    # The drain ends with each lane's last claim coming up short: at most one empty each.
    empty = [database for database, taken in batches.claims if not taken]
    assert len(empty) <= 3
    assert len(set(empty)) == len(empty)


async def test_a_lane_that_fails_ends_the_drain_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dispatcher = Dispatcher(Settings(dispatch_lanes=2, batch_size=5))

    async def lost(database: Any, publisher: Any, asked: int) -> PublishOutcome:
        await asyncio.sleep(0)
        return PublishOutcome(published=[row(id=n) for n in range(asked)], connection_lost=True)

    monkeypatch.setattr(dispatcher, "_batch", lost)
    with pytest.raises(BrokerUnavailable):
        await dispatcher._drain_available(
            cast(Any, ["lane-1", "lane-2"]), cast(Any, None), _Tally()
        )


@pytest.mark.parametrize(
    ("gather_ms", "woken", "stopping", "notified_ago", "waited"),
    [
        # The last three decisions came within the window: a burst is forming, it gathers.
        (5, True, False, [0.004, 0.002, 0.0], [0.005]),
        (10, True, False, [0.0099, 0.005, 0.001], [0.010]),
        # Decisions further apart, or too few yet, are claimed at once.
        (10, True, False, [0.0101, 0.005, 0.001], []),
        (5, True, False, [0.006, 0.003, 0.0], []),
        (10, True, False, [0.020, 0.010, 0.0], []),
        (5, True, False, [0.001, 0.0], []),
        (5, True, False, [], []),
        # Never when off, after a poll that nothing woke, or while stopping.
        (0, True, False, [0.002, 0.001, 0.0], []),
        (5, False, False, [0.002, 0.001, 0.0], []),
        (5, True, True, [0.002, 0.001, 0.0], []),
    ],
)
async def test_a_dispatcher_gathers_only_a_burst_that_is_forming(
    monkeypatch: pytest.MonkeyPatch,
    gather_ms: int,
    woken: bool,
    stopping: bool,
    notified_ago: list[float],
    waited: list[float],
) -> None:
    dispatcher = Dispatcher(Settings(dispatch_gather_ms=gather_ms))
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    # A clock that stands still: the ages are exact, however busy the machine.
    loop = asyncio.get_running_loop()
    now = loop.time()
    monkeypatch.setattr(loop, "time", lambda: now)
    dispatcher._notified.extend(now - ago for ago in notified_ago)
    if woken:
        dispatcher._wake.set()
    if stopping:
        dispatcher.stop()

    await dispatcher._gather()

    assert slept == waited


async def test_the_dispatcher_remembers_only_the_latest_notifications() -> None:
    dispatcher = Dispatcher(Settings())

    class Listener:
        async def notifies(self) -> Any:
            for _ in range(5):
                yield object()

    await dispatcher._forward_notifications(cast(Any, Listener()))

    assert len(dispatcher._notified) == GATHER_FROM_DECISIONS == 3
    assert list(dispatcher._notified) == sorted(dispatcher._notified)
    assert dispatcher._wake.is_set()


def test_the_dispatcher_gathers_10_ms_by_default() -> None:
    assert Settings().dispatch_gather_ms == 10

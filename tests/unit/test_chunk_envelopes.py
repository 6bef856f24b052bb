"""Several operations per message (OUTBOX_MESSAGE_OPERATIONS): the chunked envelope the
dispatcher writes, how a batch is cut into chunks, and what the consumer and the
dead-letter tools read back."""

from __future__ import annotations

import json
import uuid

import pydantic
import pytest

from dispatcher.publisher import chunk_size, chunks, encode, encode_chunk
from outbox.broker import (
    CHUNK_BODY_START,
    CHUNK_MESSAGE_TYPE,
    MAX_CHUNK_BODY_BYTES,
    MAX_ENVELOPE_BYTES,
    OperationChunk,
    OperationMessage,
    oversized,
    parse_body,
)
from outbox.settings import MAX_MESSAGE_OPERATIONS, Settings
from outbox.store import ClaimedRow

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def row(
    n: int, *, routing_key: str = "send_refund.v1", traceparent: str | None = None
) -> ClaimedRow:
    return ClaimedRow(
        id=n,
        operation_id=uuid.UUID(int=n),
        routing_key=routing_key,
        traceparent=traceparent,
        publish_attempts=0,
        waited_seconds=0.001,
        tool_name=routing_key.rsplit(".", 1)[0],
        tool_version=1,
        input_fingerprint=f"{n:064x}",
    )


def test_a_chunk_body_is_what_the_consumer_parses_entry_for_entry() -> None:
    rows = [row(1), row(2, traceparent=TRACEPARENT), row(3)]
    encoded = encode_chunk(rows)

    parsed = parse_body(encoded.body)

    assert isinstance(parsed, OperationChunk)
    assert [entry.operation_id for entry in parsed.operations] == [r.operation_id for r in rows]
    assert [entry.outbox_id for entry in parsed.operations] == [1, 2, 3]
    assert [entry.input_fingerprint for entry in parsed.operations] == [
        r.input_fingerprint for r in rows
    ]
    assert [entry.traceparent for entry in parsed.operations] == [None, TRACEPARENT, None]
    # The consumer bounds a body by the chunk limit only when it starts this way.
    assert encoded.body.startswith(CHUNK_BODY_START)
    assert encoded.properties.message_type == CHUNK_MESSAGE_TYPE
    assert encoded.properties.message_id == "outbox-1-n3"
    # A chunk names no single operation, and its trace contexts travel per entry.
    assert encoded.properties.correlation_id is None
    assert encoded.properties.headers is None


def test_a_single_row_is_still_the_first_envelope() -> None:
    parsed = parse_body(encode(row(7)).body)

    assert isinstance(parsed, OperationMessage)
    assert parsed.operation_id == uuid.UUID(int=7)


def test_the_largest_chunk_fits_its_body_limit() -> None:
    rows = [row(10**15 + n, traceparent=TRACEPARENT) for n in range(MAX_MESSAGE_OPERATIONS)]

    body = encode_chunk(rows).body

    assert MAX_ENVELOPE_BYTES < len(body) <= MAX_CHUNK_BODY_BYTES
    assert len(parse_body(body).operations) == MAX_MESSAGE_OPERATIONS  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "body",
    [
        {"v": 2, "operations": []},
        {"v": 2, "operations": "not a list"},
        {"v": 2, "operations": [{"operation_id": "x"}]},
        {"v": 2, "operations": [{}], "extra": 1},
        {"v": 3, "operations": []},
    ],
)
def test_chunk_bodies_that_bend_the_rules_do_not_parse(body: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        parse_body(json.dumps(body).encode())


def test_a_chunk_longer_than_the_limit_does_not_parse() -> None:
    rows = [row(n + 1) for n in range(MAX_MESSAGE_OPERATIONS + 1)]
    entries = json.loads(encode_chunk(rows[:1]).body)["operations"] * len(rows)

    with pytest.raises(pydantic.ValidationError):
        parse_body(json.dumps({"v": 2, "operations": entries}).encode())


def test_an_entry_with_an_oversized_trace_context_does_not_parse() -> None:
    entry = json.loads(encode_chunk([row(1)]).body)["operations"][0]
    entry["traceparent"] = "0" * 65

    with pytest.raises(pydantic.ValidationError):
        parse_body(json.dumps({"v": 2, "operations": [entry]}).encode())


def test_a_batch_is_cut_at_the_size_and_wherever_the_routing_key_changes() -> None:
    batch = [
        row(1),
        row(2),
        row(3),
        row(4, routing_key="close_ticket.v1"),
        row(5),
        row(6),
        row(7),
        row(8),
    ]

    cut = chunks(batch, 3)

    assert [[r.id for r in chunk] for chunk in cut] == [[1, 2, 3], [4], [5, 6, 7], [8]]


def test_a_size_of_one_is_one_message_per_row() -> None:
    assert [[r.id for r in chunk] for chunk in chunks([row(1), row(2)], 1)] == [[1], [2]]


@pytest.mark.parametrize(
    ("batch", "most", "size"),
    [
        # The outbox keeps up: each decision its own message.
        (1, 16, 1),
        (4, 16, 1),
        # A backlog forms: chunks grow with it, spread over at least four messages.
        (5, 16, 2),
        (20, 8, 5),
        (64, 16, 16),
        (200, 16, 16),
        (200, 1, 1),
    ],
)
def test_chunks_grow_with_the_backlog_up_to_the_setting(batch: int, most: int, size: int) -> None:
    assert chunk_size(batch, most) == size


@pytest.mark.parametrize("size", [0, MAX_MESSAGE_OPERATIONS + 1])
def test_a_chunk_size_one_message_cannot_carry_is_refused(size: int) -> None:
    assert Settings().message_operations == 16
    with pytest.raises(pydantic.ValidationError, match="message_operations"):
        Settings(message_operations=size)


def test_a_body_is_oversized_past_the_limit_of_what_it_starts_as() -> None:
    assert not oversized(CHUNK_BODY_START + b"x" * (MAX_CHUNK_BODY_BYTES - len(CHUNK_BODY_START)))
    assert oversized(CHUNK_BODY_START + b"x" * MAX_CHUNK_BODY_BYTES)
    assert not oversized(b"x" * MAX_ENVELOPE_BYTES)
    # Only a body that starts as a chunk gets the chunk's limit.
    assert oversized(b"x" * (MAX_ENVELOPE_BYTES + 1))
    assert oversized(b'{"v": 2, ' + b"x" * MAX_ENVELOPE_BYTES)

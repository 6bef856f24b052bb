"""``outbox dlq discard`` and ``outbox dlq discarded`` against the real broker and Postgres.

Poison reaches the dead-letter queue as in production (a consumer on the operations
queue rejects it), and the commands run as the command line runs them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable

import aio_pika
import psycopg
import pytest

from outbox import Registry
from outbox.broker import OperationMessage, message_id
from outbox.cli import run_command
from outbox.operator import dlq_discard
from outbox.settings import Settings

from support.broker_helpers import message_count, read_raw
from support.console_helpers import dead_letter_one, envelope_of
from support.ops_helpers import Ops
from support.waiting import eventually

CANARY = "CANARY-91c2-do-not-print"
POISON = f'{{"secret": "{CANARY}"}}'.encode()

Cli = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
def cli(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    settings: Settings,
    database_url: str,
) -> Cli:
    monkeypatch.setenv("OUTBOX_AMQP_URL", settings.amqp_url.get_secret_value())
    monkeypatch.setenv("OUTBOX_DEAD_LETTER_QUEUE", settings.dead_letter_queue)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)

    async def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await asyncio.to_thread(run_command, ["dlq", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


async def held(settings: Settings, count: int) -> None:
    url = settings.amqp_url.get_secret_value()

    async def check() -> bool:
        return await message_count(url, settings.dead_letter_queue) == count

    await eventually(check, within=15, what=f"{count} dead letter(s)")


def records(database_url: str) -> list[tuple[object, ...]]:
    with psycopg.connect(database_url) as connection:
        return connection.execute(
            "SELECT message_id, operation_ids, body_sha256, body_bytes, death_reason, "
            "died_at IS NOT NULL, reason, discarded_by FROM discarded_dead_letters ORDER BY id"
        ).fetchall()


async def test_malformed_dead_letters_are_discarded_on_the_record_and_envelopes_stay(
    settings: Settings, database_url: str, registry: Registry, cli: Cli
) -> None:
    # Before: a malformed body could only be requeued (and die again) or purged with
    # everything else, unrecorded.
    operation = Ops(database_url, registry).new()
    await dead_letter_one(settings, POISON, message_id="poison-1")
    await dead_letter_one(
        settings,
        OperationMessage(
            operation_id=operation.id,
            outbox_id=1,
            tool=operation.tool_name,
            tool_version=operation.tool_version,
            input_fingerprint=operation.input_fingerprint,
        ),
        message_id=message_id(1),
    )
    await held(settings, 2)

    # `list` says when each died (x-death's time), which it did not.
    code, out, err = await cli("list")
    assert code == 0, err
    assert out.count("\n  died: ") == 2
    code, out, err = await cli("list", "--json")
    assert all(m["died_at"] is not None for m in json.loads(out)["messages"])

    # A dry run shows what would go and leaves everything where it was.
    code, out, err = await cli(
        "discard", "--malformed", "--reason", "not an envelope", "--by", "oncall@example.com"
    )
    assert code == 0, err
    assert out.startswith(f"would discard 1 dead letter(s) from {settings.dead_letter_queue}")
    assert f"body sha256={hashlib.sha256(POISON).hexdigest()} ({len(POISON)} bytes)" in out
    assert "no operation: the body is not an operation envelope" in out
    assert "dry run: nothing was discarded" in out
    await held(settings, 2)
    assert records(database_url) == []

    code, out, err = await cli(
        "discard",
        "--malformed",
        "--reason",
        "not an envelope",
        "--by",
        "oncall@example.com",
        "--yes",
    )
    assert code == 0, err
    assert out.startswith("discarded 1 dead letter(s)")
    assert "recorded as discard " in out
    assert CANARY not in out + err
    await held(settings, 1)
    [(mid, ops, digest, size, death, died, reason, by)] = records(database_url)
    assert (mid, ops, digest, size, death, died, reason, by) == (
        "poison-1",
        [],
        hashlib.sha256(POISON).hexdigest(),
        len(POISON),
        "rejected",
        True,
        "not an envelope",
        "oncall@example.com",
    )
    [kept] = await read_raw(
        settings.amqp_url.get_secret_value(), settings.dead_letter_queue, expect=1
    )
    assert kept.message_id == message_id(1)

    code, out, err = await cli("discarded", "--json")
    assert code == 0, err
    [record] = json.loads(out)
    assert record["body_sha256"] == hashlib.sha256(POISON).hexdigest()
    assert record["discarded_by"] == "oncall@example.com"
    assert record["reason"] == "not an envelope"
    assert record["died_at"] is not None
    assert CANARY not in out


async def test_discarding_an_operations_dead_letter_says_what_becomes_of_it(
    settings: Settings, database_url: str, registry: Registry, cli: Cli
) -> None:
    ops = Ops(database_url, registry)
    prepared, escalated = ops.new(), ops.escalated_at_claim("undeliverable")
    for outbox_id, operation in ((1, prepared), (2, escalated)):
        await dead_letter_one(
            settings,
            OperationMessage(
                operation_id=operation.id,
                outbox_id=outbox_id,
                tool=operation.tool_name,
                tool_version=operation.tool_version,
                input_fingerprint=operation.input_fingerprint,
            ),
            message_id=message_id(outbox_id),
        )
    await held(settings, 2)

    code, out, err = await cli(
        "discard",
        "--tool",
        "send_refund",
        "--death-reason",
        "rejected",
        "--reason",
        "the tool was renamed",
        "--by",
        "oncall@example.com",
        "--yes",
        "--json",
    )

    assert code == 0, err
    document = json.loads(out)
    assert document["discarded"] == 2
    fates = {m["message_id"]: m["fate"] for m in document["messages"]}
    assert fates[message_id(1)].startswith("its operation is prepared: the consumer queues it")
    assert fates[message_id(2)].startswith("its operation stays escalated (undeliverable)")
    assert all(m["record_id"] is not None for m in document["messages"])
    await held(settings, 0)
    assert sorted(str(r[1]) for r in records(database_url)) == sorted(
        str([operation.id]) for operation in (prepared, escalated)
    )


async def test_a_discard_by_id_takes_only_that_one(
    settings: Settings, database_url: str, cli: Cli
) -> None:
    await dead_letter_one(settings, b"not json", message_id="poison-a")
    await dead_letter_one(settings, b"not json either", message_id="poison-b")

    code, out, err = await cli(
        "discard",
        "--message-id",
        "poison-b",
        "missing-1",
        "--reason",
        "junk",
        "--by",
        "ana",
        "--yes",
    )

    assert code == 0, err
    assert "discarded 1 dead letter(s)" in out
    assert "not found in" in out
    assert "missing-1" in out
    await held(settings, 1)
    assert [r[0] for r in records(database_url)] == ["poison-b"]


async def test_a_discard_walks_window_after_window_and_stops_at_the_limit(
    settings: Settings,
    database_url: str,
    registry: Registry,
    cli: Cli,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two records a window: the limit falls inside the second window, and the envelope
    # met on the way is kept without taking a place in either.
    monkeypatch.setattr(dlq_discard, "DISCARD_WINDOW", 2)
    operation = Ops(database_url, registry).new()
    await dead_letter_one(settings, POISON, message_id="poison-1")
    await dead_letter_one(settings, envelope_of(operation), message_id=message_id(1))
    for n in (2, 3, 4):
        await dead_letter_one(settings, POISON, message_id=f"poison-{n}")
    await held(settings, 5)

    code, out, err = await cli(
        "discard", "--malformed", "--limit", "3", "--reason", "junk", "--by", "ana", "--yes"
    )

    assert code == 0, err
    assert out.startswith(f"discarded 3 dead letter(s) from {settings.dead_letter_queue}, kept 1")
    await held(settings, 2)
    assert [row[0] for row in records(database_url)] == ["poison-1", "poison-2", "poison-3"]
    left = await read_raw(
        settings.amqp_url.get_secret_value(), settings.dead_letter_queue, expect=2
    )
    assert sorted(m.message_id or "" for m in left) == [message_id(1), "poison-4"]


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        (["--malformed", "--reason", "  ", "--by", "ana"], "the reason is empty"),
        (["--malformed", "--reason", "a\x1b[2Jb", "--by", "ana"], "control characters"),
        (["--malformed", "--reason", "x" * 501, "--by", "ana"], "at most 500 are kept"),
        (["--malformed", "--reason", "junk", "--by", " "], "--by must name"),
        (["--reason", "junk", "--by", "ana"], "choose what to discard"),
        (["--malformed", "--tool", "send_refund", "--reason", "r", "--by", "a"], "not both"),
    ],
)
async def test_a_refused_discard_takes_nothing(
    settings: Settings, database_url: str, cli: Cli, flags: list[str], refused: str
) -> None:
    await dead_letter_one(settings, POISON, message_id="poison-1")

    code, _, err = await cli("discard", *flags, "--yes")

    assert code != 0
    assert refused in err
    await held(settings, 1)
    assert records(database_url) == []


async def test_a_database_that_cannot_record_removes_nothing(
    settings: Settings, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    await dead_letter_one(settings, POISON, message_id="poison-1")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")

    code, _, err = await cli("discard", "--malformed", "--reason", "junk", "--by", "ana", "--yes")

    assert code != 0
    assert "could not connect to Postgres" in err
    await held(settings, 1)


async def test_a_broker_that_fails_after_the_record_leaves_the_message_recorded_and_says_so(
    settings: Settings, database_url: str, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The record commits, then the ack is refused (the channel closed under it): the
    # message must stay in the queue, its discard on the record, and the command must
    # say that a re-run removes it, not report a generic broker error.
    await dead_letter_one(settings, POISON, message_id="poison-1")

    async def refused_ack(self: object, multiple: bool = False) -> None:
        raise ConnectionError("the channel closed")

    monkeypatch.setattr(aio_pika.IncomingMessage, "ack", refused_ack)
    code, out, err = await cli("discard", "--malformed", "--reason", "junk", "--by", "ana", "--yes")

    assert code != 0
    assert "1 discard(s) recorded, but the broker failed before 1 of them left" in err
    assert "Run the command again" in err
    assert CANARY not in out + err
    await held(settings, 1)
    assert [row[0] for row in records(database_url)] == ["poison-1"]

    monkeypatch.undo()
    monkeypatch.setenv("OUTBOX_AMQP_URL", settings.amqp_url.get_secret_value())
    monkeypatch.setenv("OUTBOX_DEAD_LETTER_QUEUE", settings.dead_letter_queue)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    code, _, err = await cli("discard", "--malformed", "--reason", "junk", "--by", "ana", "--yes")
    assert code == 0, err
    await held(settings, 0)
    assert [row[0] for row in records(database_url)] == ["poison-1", "poison-1"]

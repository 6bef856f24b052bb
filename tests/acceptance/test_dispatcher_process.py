"""The dispatcher as a real subprocess: killed, stopped, restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from harness.proxy import tcp_proxy
from outbox import Registry, Settings
from outbox.sandbox.processes import DaemonProcess

from support.broker_helpers import read_all
from support.db_helpers import execute_admin
from support.dispatch_helpers import publish_state, record_many
from support.system import connection_environment
from support.waiting import eventually, eventually_sync

OUTBOX = str(Path(sys.executable).parent / "outbox")


def daemon_environment(settings: Settings, **changes: Any) -> dict[str, str]:
    return {
        **os.environ,
        **connection_environment(
            settings,
            poll_interval=0.2,
            metrics_host="127.0.0.1",
            metrics_port=0,
            declare_topology=settings.declare_topology,
            **changes,
        ),
    }


def dispatcher(settings: Settings, *args: str, **changes: Any) -> DaemonProcess:
    """``outbox dispatcher`` (the command an operator runs), its output captured."""
    return DaemonProcess(
        [OUTBOX, "dispatcher", *args],
        environment=daemon_environment(settings, **changes),
        capture=True,
        name="dispatcher",
    )


@pytest.fixture
def daemons() -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for daemon in started:
        daemon.kill()


def published_count(database_url: str) -> int:
    return publish_state(database_url)[1]


def test_a_dispatcher_killed_mid_run_and_restarted_publishes_every_row(
    settings: Settings,
    registry: Registry,
    database_url: str,
    amqp_server_url: str,
    daemons: list[DaemonProcess],
) -> None:
    rows, batch_size, lanes = 3000, 50, 2
    flags = ("--batch-size", str(batch_size), "--dispatch-lanes", str(lanes))
    record_many(database_url, registry, rows)
    first = dispatcher(settings, *flags)
    daemons.append(first)
    eventually_sync(
        lambda: published_count(database_url) >= 300, within=30, what="300 rows published"
    )
    first.kill()
    marked_before_kill = {
        row[0]
        for row in execute_admin(
            database_url, "SELECT id FROM outbox WHERE published_at IS NOT NULL"
        )
    }
    assert len(marked_before_kill) < rows, "the kill must land mid-run"

    second = dispatcher(settings, *flags)
    daemons.append(second)
    eventually_sync(
        lambda: published_count(database_url) == rows, within=60, what="every row published"
    )

    messages = asyncio.run(read_all(amqp_server_url, settings.queue, expect=rows))
    counts = Counter(m.body.outbox_id for m in messages)
    all_ids = {row[0] for row in execute_admin(database_url, "SELECT id FROM outbox")}
    assert set(counts) == all_ids
    duplicated = {outbox_id for outbox_id, n in counts.items() if n > 1}
    # Only batches in hand at the kill may go out twice (published, not yet marked):
    # at most one per lane, and never a row whose publish had been recorded.
    assert len(duplicated) <= batch_size * lanes
    assert not duplicated & marked_before_kill
    assert max(counts.values()) <= 2


def test_sigterm_exits_zero_quickly_and_leaves_no_row_claimed(
    settings: Settings, registry: Registry, database_url: str, daemons: list[DaemonProcess]
) -> None:
    record_many(database_url, registry, 4000)
    daemon = dispatcher(settings, "--batch-size", "20")
    daemons.append(daemon)
    eventually_sync(
        lambda: published_count(database_url) >= 100, within=30, what="publishing under way"
    )

    stopped_at = time.monotonic()
    daemon.signal(signal.SIGTERM)
    exit_code = daemon.wait(10)
    took = time.monotonic() - stopped_at
    output = daemon.output()

    assert exit_code == 0, output
    assert took < 5, f"took {took:.1f}s to stop"
    assert "dispatcher.stopping signal=SIGTERM" in output
    assert "dispatcher.stopped" in output
    # Nothing is locked any more: every pending row can be claimed by someone else.
    pending, lockable = execute_admin(
        database_url,
        "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL), "
        "(SELECT count(*) FROM (SELECT id FROM outbox WHERE published_at IS NULL "
        " FOR UPDATE SKIP LOCKED) AS free)",
    )[0]
    assert pending == lockable
    assert pending > 0, "the stop must land mid-run for the check to mean something"
    assert execute_admin(
        database_url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-dispatcher' "
        "AND datname = current_database()",
    ) == [(0,)]


def test_once_mode_drains_and_reports(
    settings: Settings, registry: Registry, database_url: str, daemons: list[DaemonProcess]
) -> None:
    record_many(database_url, registry, 130)
    daemon = dispatcher(settings, "--once", "--batch-size", "50")
    daemons.append(daemon)

    exit_code = daemon.wait(60)
    output = daemon.output()

    assert exit_code == 0, output
    assert "published=130 failed=0" in output
    assert publish_state(database_url) == (130, 130)


def test_once_mode_gives_up_on_an_unreachable_broker_with_a_clear_exit(
    settings: Settings, registry: Registry, database_url: str, daemons: list[DaemonProcess]
) -> None:
    record_many(database_url, registry, 3)
    unreachable = settings.model_copy(
        update={"amqp_url": type(settings.amqp_url)("amqp://guest:s3cret-canary@127.0.0.1:1/")}
    )
    daemon = dispatcher(unreachable, "--once")
    daemons.append(daemon)

    exit_code = daemon.wait(60)
    output = daemon.output()

    assert exit_code == 1
    assert "dispatcher.connect_retry peer=broker" in output
    assert "error: gave up on the broker after 5 attempts" in output
    assert "Traceback" not in output
    assert "s3cret-canary" not in output
    assert publish_state(database_url) == (3, 0)


async def test_a_second_signal_exits_at_once_while_a_batch_waits_for_confirms(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    target = urlsplit(amqp_server_url)
    async with tcp_proxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        proxied = f"amqp://{target.username}:{target.password}@127.0.0.1:{proxy.port}/"
        daemon = dispatcher(settings, amqp_url=proxied, publish_timeout=60.0)
        # The proxy runs on this event loop: the waits for the daemon go to a thread.
        try:
            await asyncio.to_thread(daemon.wait_for_line, "dispatcher.session_ready")
            proxy.blackhole()
            await asyncio.to_thread(record_many, database_url, registry, 10)

            async def batch_in_hand() -> bool:
                locked = await asyncio.to_thread(
                    execute_admin,
                    database_url,
                    "SELECT count(*) FROM outbox WHERE published_at IS NULL "
                    "AND id NOT IN (SELECT id FROM outbox FOR UPDATE SKIP LOCKED)",
                )
                return bool(locked[0][0] > 0)

            await eventually(batch_in_hand, within=20, what="a batch claimed and unconfirmed")

            daemon.signal(signal.SIGTERM)
            await asyncio.to_thread(daemon.wait_for_line, "dispatcher.stopping signal=SIGTERM")
            assert daemon.running()  # still finishing the batch it holds
            daemon.signal(signal.SIGTERM)
            exit_code = await asyncio.to_thread(daemon.wait, 5)
        finally:
            await asyncio.to_thread(daemon.kill)

    assert exit_code == 1
    # The abandoned batch is neither published nor locked: the next dispatcher takes it.
    assert publish_state(database_url) == (10, 0)
    assert not await batch_in_hand()

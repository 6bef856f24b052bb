"""History retention under load (issue #48 item 2): a day of settled history is moved out
of the hot tables and dropped while a stream of decisions runs through the real
dispatcher and consumer; nothing is lost or repeated, the drop's lock time is printed,
every chain left verifies, and the day's export verifies without a database."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from outbox import OperationState, Settings, record_decision
from outbox.cli import run_command
from outbox.errors import TransientDatabaseError

from support.db_helpers import execute_admin
from support.system import SETTLED, System, running_system
from support.waiting import eventually_sync

S = OperationState
OLD_RUN, STREAM_RUN = "history-old", "history-stream"
OLD = 12


def decide(system: System, run_id: str, key: str) -> tuple[UUID, bool]:
    """One decision (or its retry), as an agent records it; a retry that raced the move
    into history is refused as transient and tried again, as an agent's would be."""
    for _ in range(5):
        try:
            with psycopg.connect(system.database_url) as connection:
                recorded = record_decision(
                    connection,
                    system.registry,
                    "send_refund",
                    {"payment_id": f"pay_{key.replace('-', '_')}", "amount_cents": 100},
                    run_id=run_id,
                    decision_key=key,
                )
            return recorded.operation.id, recorded.created
        except TransientDatabaseError:
            continue
    raise AssertionError(f"{key} could not be recorded")


def backdate(database_url: str, run_id: str, days: int) -> None:
    """As the tables' owner: the run's operations settled ``days`` ago."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET updated_at = now() - make_interval(days => %s) "
            "WHERE run_id = %s",
            (days, run_id),
        )


class Stream(threading.Thread):
    """New decisions, one after another, with a retry of an old (archived) decision key
    every third one, until stopped."""

    def __init__(self, system: System) -> None:
        super().__init__(daemon=True)
        self.system = system
        self.stop = threading.Event()
        self.new: list[UUID] = []
        self.retried: list[tuple[str, UUID, bool]] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            count = 0
            while not self.stop.is_set():
                operation_id, created = decide(self.system, STREAM_RUN, f"new-{count}")
                assert created
                self.new.append(operation_id)
                if count % 3 == 0:
                    key = f"old-{count // 3 % OLD}"
                    self.retried.append((key, *decide(self.system, OLD_RUN, key)))
                count += 1
        except BaseException as error:  # reported by the test, not lost in the thread
            self.failure = error


# Its own deadlines (a minute for the stream, a minute for each decision to settle)
# are the test's; the harness's default minute for a whole test is shorter than they are.
@pytest.mark.timeout(240)
def test_a_day_of_history_leaves_while_decisions_stream(
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with running_system(settings, payment_amount_cents=10_000_000) as system:
        system.start("dispatcher")
        system.start("consumer")
        monkeypatch.setenv("OUTBOX_DATABASE_URL", system.database_url)
        old = {f"old-{i}": decide(system, OLD_RUN, f"old-{i}")[0] for i in range(OLD)}
        for operation_id in old.values():
            assert system.wait_for(operation_id, *SETTLED).state is S.COMMITTED
        eventually_sync(
            lambda: (
                execute_admin(
                    system.database_url,
                    "SELECT count(*) FROM outbox x JOIN operations o ON o.id = x.operation_id "
                    "WHERE o.run_id = %s AND x.published_at IS NULL",
                    (OLD_RUN,),
                )
                == [(0,)]
            ),
            within=30,
            what="the old decisions' messages published",
        )
        backdate(system.database_url, OLD_RUN, 100)
        capsys.readouterr()

        stream = Stream(system)
        stream.start()
        eventually_sync(lambda: len(stream.new) >= 10, within=30, what="the stream running")
        archived = run_command(["history", "archive", "--hot", "1d", "--batch", "5"])
        dropped = run_command(
            ["history", "drop", "--retention", "30d", "--export-dir", str(tmp_path)]
        )
        eventually_sync(lambda: len(stream.new) >= 40, within=60, what="the stream going on")
        stream.stop.set()
        stream.join(30)
        output = capsys.readouterr().out

        assert stream.failure is None, repr(stream.failure)
        settled = {op_id: system.wait_for(op_id, *SETTLED, within=60) for op_id in stream.new}
        exports = sorted(tmp_path.glob("history-*.jsonl"))
        offline = [run_command(["ops", "verify", "--archive", str(path)]) for path in exports]
        verified = run_command(["ops", "verify", "--all"])
        refunds: dict[str, Any] = system.provider.ledger()["refunds_by_key"]

    assert [archived, dropped] == [0, 0], output
    assert f"moved {OLD} settled operation(s)" in output
    lock = re.search(rf"dropped {OLD} operation\(s\), .*lock time ([0-9.]+) ms", output)
    assert lock is not None, output
    # Nothing lost or repeated: every new decision settled once, with one refund; every
    # retried old key answered with its archived operation, and no second one exists.
    assert {state.state for state in settled.values()} == {S.COMMITTED}
    assert all(refunds.get(str(op_id)) == 1 for op_id in stream.new)
    assert all(refunds.get(str(op_id)) == 1 for op_id in old.values())
    assert stream.retried
    assert all(not created and op_id == old[key] for key, op_id, created in stream.retried)
    assert len(refunds) == len(stream.new) + OLD
    assert execute_admin(
        system.database_url, "SELECT count(*) FROM operations WHERE run_id = %s", (OLD_RUN,)
    ) == [(0,)]
    assert execute_admin(system.database_url, "SELECT count(*) FROM history") == [(0,)]
    # What is left still verifies, and what left verifies from its file.
    assert verified == 0
    assert len(exports) == 1
    assert offline == [0]

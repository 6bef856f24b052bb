"""``python -m harness.chaos`` against a database it cannot reach: exit status 2 and one
line that says so, as every ``outbox`` command does, never a traceback. (It used to end
in an UnboundLocalError raised while cleaning up.) And which faults ``--faults`` takes
in, where the schedule leaves the quiet phase, and what a private broker needs. Nothing
is started, so no service is needed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness import chaos
from harness.chaos import build_parser
from harness.faults import CATEGORIES, FAULT_CATEGORIES, FAULTS
from harness.parameters import QUIET_SECONDS
from harness.schedule import decision, fault_schedule

from support.ports import closed_port

REPOSITORY = Path(__file__).resolve().parents[2]
CANARY = "s3cret-canary"


def test_an_unreachable_database_exits_2_with_one_clear_line() -> None:
    port = closed_port()
    result = subprocess.run(
        [sys.executable, "-m", "harness.chaos", "--operations", "5", "--faults", "process"],
        cwd=REPOSITORY,
        env={
            **os.environ,
            "OUTBOX_DATABASE_URL": f"postgresql://postgres:{CANARY}@127.0.0.1:{port}/postgres",
            "OUTBOX_AMQP_URL": f"amqp://guest:{CANARY}@127.0.0.1:{closed_port()}/",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"python -m harness.chaos: configuration error: cannot connect to "
        f"postgresql://postgres:***@127.0.0.1:{port}/postgres: connection refused. Is Postgres "
        "running, and is OUTBOX_DATABASE_URL right?"
    ]
    assert "Traceback" not in result.stdout
    assert CANARY not in result.stdout + result.stderr


def test_all_faults_take_in_overload_and_callbacks() -> None:
    everything = build_parser().parse_args(["--faults", "all"]).faults

    assert {"overload", "callbacks"} <= everything
    assert set(FAULT_CATEGORIES["overload"]) == {
        "cpu_starvation",
        "slow_database",
        "decision_burst",
    }
    assert set(FAULT_CATEGORIES["callbacks"]) == {
        "webhooks_dropped",
        "webhooks_forged",
        "webhooks_duplicated",
        "webhooks_delayed",
    }


def test_every_registered_kind_is_in_one_category_in_the_stated_order() -> None:
    # The kinds register in harness/faults/<category>.py; CATEGORIES orders them for
    # --faults and the schedule, and a category missing from it would never run.
    assert sorted(kind for kinds in FAULT_CATEGORIES.values() for kind in kinds) == sorted(FAULTS)
    assert {entry.category for entry in FAULTS.values()} == set(CATEGORIES)
    assert tuple(FAULT_CATEGORIES) == CATEGORIES


def test_each_fault_kind_is_registered_with_its_own_handler() -> None:
    # Dispatch was getattr(self, f"_fault_{kind}"): a typo surfaced mid-run. The registry
    # is filled where each handler is defined; a handler under another kind's name would
    # inject the wrong fault.
    assert [entry.inject.__name__ for entry in FAULTS.values()] == [
        f"_fault_{kind}" for kind in FAULTS
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_overload_no_fault_comes_before_the_quiet_rate_is_measured(seed: int) -> None:
    with_overload = fault_schedule(seed, 300, frozenset({"overload", "process"}))

    assert min(fault.at for fault in with_overload) >= QUIET_SECONDS


def test_without_overload_faults_may_come_at_once() -> None:
    # Nothing to measure: some seed's schedule starts before the quiet phase would end.
    firsts = [
        min(fault.at for fault in fault_schedule(seed, 300, frozenset({"process"})))
        for seed in range(10)
    ]

    assert min(firsts) < QUIET_SECONDS


def test_the_stream_mixes_emails_into_the_refunds() -> None:
    tools = [decision(n)[0] for n in range(10)]

    assert tools.count("send_email") == 2
    assert set(tools) == {"send_refund", "send_email"}


def test_the_private_broker_needs_rabbitmq_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(chaos, "rabbitmq_installed", lambda: False)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"postgresql://postgres@127.0.0.1:{closed_port()}/x")
    monkeypatch.setenv("OUTBOX_AMQP_URL", f"amqp://guest:guest@127.0.0.1:{closed_port()}/")

    status = chaos.main(["--operations", "5", "--broker", "private"])

    assert status == 2
    assert "needs rabbitmq-server installed; or use --broker shared" in capsys.readouterr().err
    # Refused before it touched anything process-wide (other tests share the process).
    assert logging.getLogger("outbox.sandbox.provider").level == logging.NOTSET
    assert signal.getsignal(signal.SIGTERM) is not chaos._exit_on_terminate


@pytest.mark.parametrize("seed", [1, 2, 7])
def test_every_fault_of_every_schedule_can_be_described(seed: int) -> None:
    for fault in fault_schedule(seed, 300, build_parser().parse_args([]).faults):
        assert fault.kind in fault.describe()

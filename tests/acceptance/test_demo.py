"""The README's first command: `outbox demo`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.demo_runs import CREATED, assert_removed, tag_of
from support.waiting import eventually_sync

OUTBOX = str(Path(sys.executable).parent / "outbox")
# The line the demo prints once its database and queues exist, naming them by its tag.


def demo_environment(postgres_server_url: str, amqp_server_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "OUTBOX_DATABASE_URL": postgres_server_url,
        "OUTBOX_AMQP_URL": amqp_server_url,
    }


def test_the_demo_shows_two_refunds_then_one_and_cleans_up(
    postgres_server_url: str, amqp_server_url: str
) -> None:
    result = subprocess.run(
        [OUTBOX, "demo"],
        capture_output=True,
        text=True,
        env=demo_environment(postgres_server_url, amqp_server_url),
        timeout=120,
        check=False,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    out, third = result.stdout.split("\n3. ", 1)
    assert "provider ledger: 2 refunds for one decision" in out
    assert "provider ledger: 1 refund for one decision" in out
    trace = [
        line.split()[0] for line in out.splitlines() if re.match(r"^\s+(operation|agent)\.", line)
    ]
    # On a loaded machine the sandbox's held answer can outlast the first lookup's
    # backoff: the provider then says the key is still in flight and the lookup is
    # deferred, which is the runtime doing its job, not a different ending.
    deferred = re.findall(r"operation\.reconcile_deferred\s+id=op_\S+ reason=(\S+)", out)
    assert set(deferred) <= {"key_in_flight"}, deferred
    trace = [name for name in trace if name != "operation.reconcile_deferred"]
    assert trace == [
        "operation.prepared",
        "operation.attempted",
        "operation.outcome_unknown",
        "operation.reconciled",
        "agent.completed",
    ]
    assert re.search(r"operation\.outcome_unknown\s+id=op_\S+ reason=deadline_exceeded", out)
    assert re.search(r"operation\.reconciled\s+id=op_\S+ result=committed", out)
    assert re.search(r"agent\.completed\s+id=run_\w+ outcome=refund_confirmed", out)
    third, fourth = third.split("\n4. ", 1)
    assert_settled_by_its_callback(third)
    assert_waited_out(fourth)
    assert "guarantee held" in fourth
    assert_removed(tag_of(out), postgres_server_url, amqp_server_url)


def assert_waited_out(fourth: str) -> None:
    """The fourth scene: the refunds provider down for seconds while six refunds are
    decided; they wait, spending nothing, and settle one refund each with nobody asked."""
    assert fourth.startswith("the provider is down for a few seconds")
    assert re.search(r"provider\.unavailable\s+provider=sandbox after [5-6] refunds", fourth)
    available = re.search(
        r"provider\.available\s+provider=sandbox outage_seconds=\S+ probes=(\d+) "
        r"operations_waited=(\d+)",
        fourth,
    )
    assert available is not None, fourth
    assert int(available[1]) >= 1
    assert int(available[2]) >= 5
    assert "6 of 6 refunds committed, one refund each; 0 asked a person" in fourth


def assert_settled_by_its_callback(third: str) -> None:
    """The third scene: an email whose answer is lost, settled by the provider's signed
    delivery callback (the contract would otherwise send it to a person)."""
    assert third.startswith("an email whose answer is lost")
    trace = [
        line.split()[0] for line in third.splitlines() if re.match(r"^\s+(operation|agent)\.", line)
    ]
    # The callback may land while the attempt is still in flight or after: either way
    # the consumer applies it after the worker's record, and chains it as it does.
    assert trace == [
        "operation.prepared",
        "operation.attempted",
        "operation.outcome_unknown",
        "operation.callback_received",
        "operation.reconciled",
        "agent.completed",
    ]
    assert re.search(r"operation\.prepared\s+id=op_\S+ tool=send_email", third)
    assert re.search(
        r"operation\.callback_received\s+id=op_\S+ provider=sandbox-email status=committed",
        third,
    )
    assert re.search(r"operation\.reconciled\s+id=op_\S+ result=committed method=callback", third)
    assert re.search(r"agent\.completed\s+id=run_\w+ outcome=email_confirmed", third)
    assert "operation.escalated" not in third
    assert "provider log: 1 email sent, its delivery reported by a signed callback" in third


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_demo_removes_what_it_created(
    postgres_server_url: str, amqp_server_url: str, signum: signal.Signals
) -> None:
    demo = subprocess.Popen(
        [OUTBOX, "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=demo_environment(postgres_server_url, amqp_server_url),
    )
    lines: list[str] = []

    def read() -> None:
        assert demo.stdout is not None
        lines.extend(demo.stdout)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        eventually_sync(
            lambda: CREATED.search("".join(lines)) is not None,
            within=60,
            what="the demo to create its database and queues",
        )
        tag = tag_of("".join(lines))
        demo.send_signal(signum)
        code = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
        reader.join(timeout=10)
        if demo.stdout is not None:
            demo.stdout.close()

    output = "".join(lines)
    assert code == 128 + signum, output
    assert f"demo stopped by {signum.name}" in output
    assert "Traceback" not in output
    assert_removed(tag, postgres_server_url, amqp_server_url)

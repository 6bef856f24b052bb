"""The README's first command: `outbox demo`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg

OUTBOX = str(Path(sys.executable).parent / "outbox")


def test_the_demo_shows_two_refunds_then_one_and_cleans_up(
    postgres_server_url: str, amqp_server_url: str
) -> None:
    environment = {
        **os.environ,
        "OUTBOX_DATABASE_URL": postgres_server_url,
        "OUTBOX_AMQP_URL": amqp_server_url,
    }
    result = subprocess.run(
        [OUTBOX, "demo"], capture_output=True, text=True, env=environment, timeout=120, check=False
    )

    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "provider ledger: 2 refunds for one decision" in out
    assert "provider ledger: 1 refund for one decision" in out
    trace = [
        line.split()[0] for line in out.splitlines() if re.match(r"^\s+(operation|agent)\.", line)
    ]
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
    assert "guarantee held" in out
    with psycopg.connect(postgres_server_url, autocommit=True) as connection:
        leftovers = connection.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'outbox_demo_%'"
        ).fetchall()
    assert leftovers == []

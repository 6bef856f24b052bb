"""``python -m harness.chaos`` against a database it cannot reach: exit status 2 and one
line that says so, as every ``outbox`` command does, never a traceback. (It used to end
in an UnboundLocalError raised while cleaning up.) Nothing is started, so no service is
needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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

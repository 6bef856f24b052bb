"""examples/agent_refund.py, as a newcomer runs it: no API key, the local services."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.demo_runs import assert_removed, tag_of

REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLE = REPOSITORY / "examples" / "agent_refund.py"
TRACE = re.compile(r"^\s+((?:operation|agent)\.\w+)\s+id=(\S+)", re.MULTILINE)


@pytest.mark.timeout(180)
def test_the_example_refunds_once_and_the_agent_says_so(
    postgres_server_url: str, amqp_server_url: str
) -> None:
    environment = {
        # No key for any model provider reaches the example: it must not need one.
        **{k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")},
        "OUTBOX_DATABASE_URL": postgres_server_url,
        "OUTBOX_AMQP_URL": amqp_server_url,
    }
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=150,
        check=False,
    )

    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "scripted stand-in for an LLM" in out
    assert re.search(
        r"agent:\s+Your refund of 25\.00 EUR is confirmed \(provider reference re_", out
    )
    assert "provider ledger: 1 refund for one decision" in out
    trace = TRACE.findall(out)
    assert [name for name, _ in trace] == [
        "operation.prepared",
        "operation.attempted",
        "operation.outcome_unknown",
        "operation.reconciled",
        "agent.completed",
    ]
    operation_ids = {identifier for name, identifier in trace if name.startswith("operation.")}
    assert len(operation_ids) == 1  # one decision, one operation
    assert re.search(r"operation\.outcome_unknown\s+id=op_\S+ reason=connection_lost", out)
    assert re.search(r"operation\.reconciled\s+id=op_\S+ result=committed", out)
    assert re.search(r"agent\.completed\s+id=run_\w+ outcome=refund_confirmed$", out, re.MULTILINE)
    assert_removed(tag_of(out), postgres_server_url, amqp_server_url)

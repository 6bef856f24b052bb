"""``python -m bench.load``, the load generator for a staging deployment: it records the
decisions it says it records (rate x seconds, each its own intent, under its run id),
a rerun with the same run id records nothing twice, and a bad tool or input writes
nothing."""

from __future__ import annotations

import psycopg
import pytest

from bench import load

from support.db_helpers import Counts, committed_counts

INPUT = '{"payment_id": "pay_{run}_{n}", "amount_cents": 150}'


def generate(database_url: str, *flags: str) -> int:
    return load.main(["--database-url", database_url, "--tools", "support.sample_tools", *flags])


def test_it_records_rate_times_seconds_decisions_under_its_run_id(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # What is recorded, not how fast: a busy machine may record late, and say so.
    late = ["--max-late", "3600"]
    flags = ["--tool", "send_refund", "--input", INPUT, "--rate", "40", "--seconds", "0.25", *late]

    code = generate(database_url, *flags, "--run-id", "load-test", "--connections", "2")

    out = capsys.readouterr().out
    assert code == 0
    assert "run id load-test" in out.splitlines()[0]
    assert out.splitlines()[1].startswith("recorded 10 decisions in ")
    with psycopg.connect(database_url) as connection:
        rows = connection.execute(
            "SELECT decision_key, input->>'payment_id', input->>'amount_cents', state, "
            "(SELECT count(*) FROM outbox b WHERE b.operation_id = o.id) "
            "FROM operations o WHERE run_id = 'load-test'"
        ).fetchall()
    assert sorted(rows, key=lambda row: int(row[0])) == [
        (str(n), f"pay_load-test_{n}", "150", "prepared", 1) for n in range(10)
    ]

    assert generate(database_url, *flags, "--run-id", "load-test") == 0
    assert "10 were already recorded by an earlier run" in capsys.readouterr().out
    assert committed_counts(database_url) == Counts(operations=10, outbox=10, events=10)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--tool", "send_refund", "--input", '{"payment_id": "p_{n}", "amount_cents": -1}'],
            "refused: the send_refund contract refuses --input: amount_cents: Input should be "
            "greater than 0; nothing was changed",
        ),
        (
            ["--tool", "send_refund", "--input", "[1, 2]"],
            "refused: --input must be a JSON object: the tool's input; nothing was changed",
        ),
        (
            ["--tool", "send_refund", "--input", '{"payment_id": '],
            "refused: --input is not JSON",
        ),
        (
            ["--tool", "launch_rocket", "--input", "{}"],
            "configuration error: no tool 'launch_rocket' in the tools modules given (they "
            "register: open_ticket, send_refund)",
        ),
    ],
    ids=["input the contract refuses", "not an object", "not JSON", "unknown tool"],
)
def test_a_bad_tool_or_input_exits_2_and_writes_nothing(
    database_url: str, capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    code = generate(database_url, *flags, "--rate", "10", "--seconds", "1")

    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines()[-1].startswith(f"python -m bench.load: {said}")
    assert committed_counts(database_url) == Counts(operations=0, outbox=0, events=0)

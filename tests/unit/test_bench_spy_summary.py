"""bench/spy_summary.py: py-spy's collapsed stacks, counted by top frame and package."""

from __future__ import annotations

from bench.spy_summary import summarize

PROFILE = [
    "run (consumer/cli.py:60);handle (/repo/consumer/worker.py:280);"
    "execute (/venv/lib/psycopg/cursor.py:113) 30",
    "run (consumer/cli.py:60);_execute (/repo/consumer/effects.py:70) 10",
    "run (consumer/cli.py:60);dumps (/usr/lib/python3.11/json/__init__.py) 5",
    "process_idle 5",
    "a line that is no sample",
]


def test_samples_are_counted_by_top_function_and_its_package() -> None:
    total, by_function, by_package = summarize(PROFILE)

    assert total == 50
    assert by_function.most_common(2) == [
        ("execute (cursor.py)", 30),
        ("_execute (effects.py)", 10),
    ]
    assert by_function["process_idle"] == 5
    assert by_package == {"psycopg": 30, "consumer": 10, "json": 5, "other": 5}


def test_a_frame_named_from_its_package_root_counts_for_that_package() -> None:
    _, _, by_package = summarize(["f (aiormq/connection.py:738) 3", "g (pamqp/base.py) 2"])

    assert by_package == {"aiormq": 3, "pamqp": 2}

"""Fault injection for this repository's own tests and runs; never part of the wheel.

- :mod:`harness.chaos`: ``python -m harness.chaos``, many refunds through the whole
  system while daemons, the broker, database sessions, links and the provider are broken,
  then a checker's verdict. Cut by job: the run's numbers (:mod:`harness.parameters`),
  the schedule (:mod:`harness.schedule`), the run's loop (:mod:`harness.run`), the
  faults (:mod:`harness.faults`, one module per category), what it prints
  (:mod:`harness.report`) and the verdict (:mod:`harness.checker`);
- :mod:`harness.proxy`: the fault-injecting TCP proxy the chaos run and the partition
  tests put between a daemon and Postgres or RabbitMQ;
- :mod:`harness.diagnostics`: the two statements only the chaos run needs (ending the
  daemons' database sessions, and a snapshot of the sessions as evidence).

They live outside ``outbox`` because an installed ``outbox`` must not be able to stop a
broker or end other sessions: ``pyproject.toml`` builds the wheel from ``outbox``,
``dispatcher`` and ``consumer`` only, and ``tests/unit/test_wheel_contents.py`` proves
it. Run them from a checkout (the editable install puts the repository root on
``sys.path``).
"""

from __future__ import annotations

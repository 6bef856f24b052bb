"""Every daemon session's bounds derive from the lease margin unless set explicitly."""

from __future__ import annotations

import pytest

from outbox.connections import DatabaseBounds, command_parameters
from outbox.settings import Settings


def test_the_bounds_follow_the_lease_margin() -> None:
    bounds = DatabaseBounds.from_settings(Settings(lease_margin=10.0))

    # A record that starts one margin before the lease ends is checked by the client at a
    # quarter margin (cut if its link is silent), cut within half a margin even if the
    # server is working on it, and by the server within half a margin of its last
    # statement.
    assert bounds.transaction == 2.5
    assert bounds.hard_transaction == 5.0
    assert bounds.statement == 5.0
    assert bounds.idle_in_transaction == 5.0
    assert bounds.lock == 2.5
    assert bounds.hard_transaction + bounds.idle_in_transaction <= 10.0


def test_the_default_margin_leaves_a_slow_machine_room() -> None:
    # A transaction that takes a few hundred milliseconds on a quiet machine is never
    # checked five times slower; a silent link is suspected after 5 s, and a working
    # server is cut only after 10 s.
    bounds = DatabaseBounds.from_settings(Settings())

    assert (bounds.transaction, bounds.hard_transaction) == (5.0, 10.0)


def test_a_hard_deadline_is_never_before_the_soft_one() -> None:
    bounds = DatabaseBounds.from_settings(Settings(lease_margin=4.0, db_transaction_timeout=3.0))

    assert (bounds.transaction, bounds.hard_transaction) == (3.0, 3.0)


def test_a_transaction_held_open_for_confirms_gets_that_much_longer() -> None:
    bounds = DatabaseBounds.from_settings(Settings(lease_margin=4.0), held_open_for=10.0)

    assert (bounds.transaction, bounds.hard_transaction, bounds.idle_in_transaction) == (
        11.0,
        12.0,
        12.0,
    )
    assert (bounds.statement, bounds.lock) == (2.0, 1.0)


def test_explicit_settings_win_over_the_derived_defaults() -> None:
    bounds = DatabaseBounds.from_settings(
        Settings(
            db_transaction_timeout=3.0,
            db_transaction_hard_timeout=6.0,
            db_statement_timeout=7.0,
            db_lock_timeout=0.25,
            db_idle_in_transaction_timeout=9.0,
            db_tcp_user_timeout=4.0,
        )
    )

    assert (bounds.transaction, bounds.statement, bounds.lock) == (3.0, 7.0, 0.25)
    assert bounds.hard_transaction == 6.0
    assert (bounds.idle_in_transaction, bounds.tcp_user_timeout) == (9.0, 4.0)


def test_daemon_sessions_carry_keepalives_and_server_timeouts_in_milliseconds() -> None:
    parameters = DatabaseBounds.from_settings(Settings(lease_margin=3.0)).libpq_parameters()

    assert parameters["keepalives"] == 1
    assert parameters["tcp_user_timeout"] == 10_000
    assert parameters["options"] == (
        "-c statement_timeout=1500 -c lock_timeout=750 -c idle_in_transaction_session_timeout=1500"
    )


def test_commands_get_the_keepalives_but_no_server_side_statement_bounds() -> None:
    parameters = command_parameters()

    assert "options" not in parameters
    assert parameters["keepalives_idle"] == 5
    assert parameters["connect_timeout"] == 10


def test_the_environment_sets_every_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DB_TRANSACTION_TIMEOUT", "2.5")
    monkeypatch.setenv("OUTBOX_DB_TCP_USER_TIMEOUT", "6")
    monkeypatch.setenv("OUTBOX_DB_KEEPALIVES_COUNT", "5")

    bounds = DatabaseBounds.from_settings(Settings())

    assert (bounds.transaction, bounds.tcp_user_timeout, bounds.keepalives_count) == (2.5, 6.0, 5)


def test_a_bound_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="db_transaction_timeout"):
        Settings(db_transaction_timeout=0)

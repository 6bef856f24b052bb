"""The chaos run's goodput series is taken on a thread of its own: a fault call that
holds the stream's loop (rabbitmqctl starved beside CPU hogs held it 50 s) must not leave
a hole in the series, which read as a recovery 50 s late."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from harness.background import Sampler

DEADLINE_SECONDS = 30.0


def test_samples_keep_coming_while_the_caller_is_held(database_url: str) -> None:
    taken: list[float] = []
    three = threading.Event()

    def take(connection: psycopg.Connection[Any], now: float) -> None:
        connection.execute("SELECT 1")
        taken.append(now)
        if len(taken) >= 3:
            three.set()

    sampler = Sampler(database_url, take)
    sampler.start()
    try:
        # The caller is held (as by a slow rabbitmqctl) and samples still arrive.
        assert three.wait(DEADLINE_SECONDS), "the sampler took fewer than 3 samples"
    finally:
        sampler.stop()


def test_a_session_ended_under_the_sampler_is_replaced(database_url: str) -> None:
    sessions: list[int] = []
    two_sessions = threading.Event()

    def take(connection: psycopg.Connection[Any], now: float) -> None:
        pid = connection.info.backend_pid
        if pid not in sessions:
            sessions.append(pid)
        if len(sessions) == 1:
            # The run's db_connection_kill faults end the harness's sessions too.
            raise psycopg.OperationalError("terminating connection due to administrator command")
        two_sessions.set()

    sampler = Sampler(database_url, take)
    sampler.start()
    try:
        assert two_sessions.wait(DEADLINE_SECONDS), "the sampler did not reconnect"
    finally:
        sampler.stop()
    assert len(sessions) == 2

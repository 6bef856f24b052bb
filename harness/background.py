"""The chaos run's two threads beside the stream's loop: the sampler that counts what is
settled (the goodput series), and the one that runs the broker's slow CLI calls."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg

from harness.parameters import SAMPLE_SECONDS

T = TypeVar("T")


class Sampler:
    """Counts the run's operations every SAMPLE_SECONDS on a thread and a connection of
    its own. Not in the stream's loop: a fault's own call can hold that loop (rabbitmqctl,
    an Erlang VM of its own, took 50 s beside the CPU hogs of a sweep), and a series with
    a hole where the system recovered read as a recovery 50 s late."""

    def __init__(
        self, database_url: str, take: Callable[[psycopg.Connection[Any], float], None]
    ) -> None:
        self._database_url = database_url
        self._take = take
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        connection: psycopg.Connection[Any] | None = None
        try:
            while True:
                try:
                    if connection is None:
                        connection = psycopg.connect(self._database_url)
                    self._take(connection, time.monotonic())
                except psycopg.Error:
                    # The run's faults may end this session too: a new one next time.
                    if connection is not None:
                        with contextlib.suppress(psycopg.Error):
                            connection.close()
                    connection = None
                if self._stopping.wait(SAMPLE_SECONDS):
                    return
        finally:
            if connection is not None:
                with contextlib.suppress(psycopg.Error):
                    connection.close()


class OffLoop:
    """Calls that may take a minute (rabbitmqctl boots an Erlang VM of its own, slow on a
    busy machine), run one at a time in the order given on a thread of their own. What
    follows each (``then``) runs on the stream's loop, when it asks (``run_finished``);
    a call's exception is raised there, as it would have been in the loop."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chaos-broker")
        self._under_way: list[tuple[Future[Any], Callable[[Any], None]]] = []

    def submit(self, call: Callable[[], T], then: Callable[[T], None]) -> None:
        self._under_way.append((self._executor.submit(call), then))

    def busy(self) -> bool:
        """A call under way, or finished with its ``then`` still to run."""
        return bool(self._under_way)

    def run_finished(self) -> None:
        # In submission order: a later call's result never overtakes an earlier one's.
        while self._under_way and self._under_way[0][0].done():
            future, then = self._under_way.pop(0)
            then(future.result())

    def close(self) -> None:
        """Wait for the calls under way (their ``then`` is not run)."""
        self._executor.shutdown(wait=True)
        self._under_way.clear()

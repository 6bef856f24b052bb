"""Where the tests find real Postgres and RabbitMQ.

1. ``OUTBOX_TEST_DATABASE_URL`` / ``OUTBOX_TEST_AMQP_URL`` when set (CI, and any
   machine with local services);
2. otherwise containers started with testcontainers, when a Docker engine answers;
3. otherwise a failure that names the variables to set. Never a silent skip.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

DATABASE_VARIABLE = "OUTBOX_TEST_DATABASE_URL"
AMQP_VARIABLE = "OUTBOX_TEST_AMQP_URL"


class ServicesUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class ServiceChoice:
    url: str | None
    use_container: bool


def choose(variable: str, docker_answers: Callable[[], bool]) -> ServiceChoice:
    """The URL from the environment, else a container if Docker answers, else an error."""
    url = os.environ.get(variable, "").strip()
    if url:
        return ServiceChoice(url=url, use_container=False)
    if docker_answers():
        return ServiceChoice(url=None, use_container=True)
    raise ServicesUnavailable(
        f"{variable} is not set and no Docker engine answers. Point {variable} at a real "
        "service (for this machine: OUTBOX_TEST_DATABASE_URL=postgresql://postgres@127.0.0.1:5432"
        "/postgres and OUTBOX_TEST_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/), or start "
        "Docker so testcontainers can run one"
    )


def docker_answers() -> bool:
    """True when a Docker engine answers ``GET /_ping`` on its socket (or DOCKER_HOST)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: str | tuple[str, int] = host.removeprefix("unix://")
        elif host.startswith("tcp://"):
            name, _, port = host.removeprefix("tcp://").partition(":")
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            address = (name, int(port or 2375))
        else:
            return False
        with probe:
            probe.settimeout(3)
            probe.connect(address)
            probe.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            status_line = probe.recv(64).split(b"\r\n", 1)[0]
            return status_line.startswith(b"HTTP/1.") and b" 200" in status_line
    except OSError:
        return False


@contextlib.contextmanager
def postgres_url() -> Iterator[str]:
    choice = choose(DATABASE_VARIABLE, docker_answers)
    if choice.url is not None:
        yield choice.url
        return
    from testcontainers.postgres import PostgresContainer

    with PostgresContainer("postgres:16-alpine", driver=None) as container:
        yield str(container.get_connection_url())


@contextlib.contextmanager
def amqp_url() -> Iterator[str]:
    choice = choose(AMQP_VARIABLE, docker_answers)
    if choice.url is not None:
        yield choice.url
        return
    from testcontainers.rabbitmq import RabbitMqContainer

    with RabbitMqContainer("rabbitmq:3.13-management-alpine") as container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(5672)
        yield f"amqp://guest:guest@{host}:{port}/"

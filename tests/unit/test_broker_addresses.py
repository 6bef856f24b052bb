"""Several broker addresses in OUTBOX_AMQP_URL: how they are read, refused, redacted,
and in which order a connect tries them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import aiormq.exceptions
import pytest
from pydantic import SecretStr

import outbox.broker
from outbox.broker import attempt_order, broker_urls, connect, connect_for_command
from outbox.errors import ConfigurationError, ServiceUnavailable
from outbox.settings import Settings, load_settings
from outbox.urls import redact_amqp_urls, split_amqp_urls

from support.ports import closed_port

CANARY = "pw-CANARY-5e1d"


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Settings read OUTBOX_* variables; a developer's or CI's own values must not leak in.
    for name in list(os.environ):
        if name.upper().startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    # Which address failed last is remembered per process: no test may inherit another's.
    outbox.broker.forget_failed_addresses()
    yield
    outbox.broker.forget_failed_addresses()


# --- reading ----------------------------------------------------------------------------


def test_one_url_is_one_address_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_AMQP_URL", "amqps://app:secret@mq.internal:5671/prod")

    settings = load_settings()

    assert settings.amqp_url.get_secret_value() == "amqps://app:secret@mq.internal:5671/prod"
    assert settings.amqp_urls == ["amqps://app:secret@mq.internal:5671/prod"]


def test_comma_separated_urls_are_the_addresses_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "OUTBOX_AMQP_URL",
        "amqp://app:a@mq-1:5672/prod, amqp://app:b@mq-2:5673/prod ,amqps://app:c@mq-3/prod",
    )

    settings = load_settings()

    assert settings.amqp_urls == [
        "amqp://app:a@mq-1:5672/prod",
        "amqp://app:b@mq-2:5673/prod",
        "amqps://app:c@mq-3/prod",
    ]


def test_several_addresses_survive_the_trip_to_a_child_process() -> None:
    value = "amqp://app:a@mq-1:5672/,amqp://app:b@mq-2:5672/"
    settings = Settings(amqp_url=SecretStr(value))

    assert settings.to_environment()["OUTBOX_AMQP_URL"] == value


def test_each_address_gets_the_heartbeat_unless_it_names_its_own() -> None:
    urls = broker_urls("amqp://mq-1/,amqp://mq-2/?heartbeat=5", 15)

    assert urls == ["amqp://mq-1/?heartbeat=15", "amqp://mq-2/?heartbeat=5"]


# --- refusing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (f"amqp://app:{CANARY}@mq-1/,http://app:{CANARY}@mq-2/", "address 2 of 2"),
        (f"amqp://app:{CANARY}@mq-1/,,amqp://app:{CANARY}@mq-3/", "address 2 of 3: the URL is"),
        (f"amqp://app:{CANARY}@mq-1/,", "address 2 of 2: the URL is empty"),
        (f"amqp://app:{CANARY}@mq-1:port/,amqp://mq-2/", "address 1 of 2: the URL's port"),
        # An unencoded comma in a password splits it: what follows looks like a scheme.
        (f"amqp://app:123,{CANARY}:x@mq-1/", "address 2 of 2"),
        (f"amqp://app:pw,{CANARY}@mq-1/", "address 1 of 2"),
    ],
    ids=["bad-scheme", "empty-middle", "trailing-comma", "bad-port", "comma-scheme", "comma"],
)
def test_a_bad_address_is_named_by_its_place_never_by_its_password(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: str
) -> None:
    monkeypatch.setenv("OUTBOX_AMQP_URL", value)

    with pytest.raises(ConfigurationError) as info:
        load_settings()

    message = str(info.value)
    assert "OUTBOX_AMQP_URL" in message
    assert expected in message
    assert "%2C" in message  # how to write a comma that belongs to a password
    assert CANARY.lower() not in message.lower()  # urlsplit lowercases a scheme
    assert len(message.splitlines()) == 1


def test_a_single_bad_url_reads_as_it_always_did(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_AMQP_URL", f"http://app:{CANARY}@mq.internal/")

    with pytest.raises(ConfigurationError) as info:
        load_settings()

    assert "'http' is not supported" in str(info.value)
    assert "address" not in str(info.value)
    assert CANARY not in str(info.value)


def test_every_address_is_redacted() -> None:
    value = f"amqp://app:{CANARY}@mq-1:5672/, amqp://app:{CANARY}@mq-2:5672/"

    assert redact_amqp_urls(value) == "amqp://app:***@mq-1:5672/, amqp://app:***@mq-2:5672/"
    assert split_amqp_urls(value)[1] == f"amqp://app:{CANARY}@mq-2:5672/"


async def test_a_command_that_reaches_no_address_names_them_all_without_passwords() -> None:
    first, second = closed_port(), closed_port()
    settings = Settings(
        amqp_url=SecretStr(
            f"amqp://guest:{CANARY}@127.0.0.1:{first}/,amqp://guest:{CANARY}@127.0.0.1:{second}/"
        )
    )

    with pytest.raises(ServiceUnavailable) as info:
        await connect_for_command(settings)

    message = str(info.value)
    assert f"amqp://guest:***@127.0.0.1:{first}/" in message
    assert f"amqp://guest:***@127.0.0.1:{second}/" in message
    assert CANARY not in message


# --- the order of attempts --------------------------------------------------------------


@pytest.mark.parametrize(
    ("last_failed", "order"),
    [(None, [0, 1, 2]), (0, [1, 2, 0]), (1, [2, 0, 1]), (2, [0, 1, 2])],
)
def test_attempts_start_after_the_address_that_failed_last(
    last_failed: int | None, order: list[int]
) -> None:
    assert attempt_order(3, last_failed) == order


class FakeConnection:
    """What connect() touches of an aio-pika connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.close_called = False
        self.callbacks: list[Any] = []

    @property
    def close_callbacks(self) -> FakeConnection:
        return self

    def add(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def lost(self) -> None:
        """The broker or the network ended it: nobody here called close()."""
        for callback in self.callbacks:
            callback(self, ConnectionResetError())


class Addresses:
    """A stand-in for the network: which addresses refuse, and every attempt made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, refusing: set[str]) -> None:
        self.refusing = refusing
        self.attempts: list[str] = []
        monkeypatch.setattr(outbox.broker, "_connect_one", self._connect_one)

    async def _connect_one(self, url: str, connection_name: str | None) -> FakeConnection:
        self.attempts.append(url)
        if url in self.refusing:
            raise ConnectionRefusedError(111, f"refused: {url}")
        return FakeConnection(url)


URLS = ["amqp://mq-1/", "amqp://mq-2/", "amqp://mq-3/"]


async def test_the_first_address_is_tried_first_and_kept_while_it_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    network = Addresses(monkeypatch, refusing=set())

    for _ in range(3):
        connection = await connect(URLS)
        assert connection.url == URLS[0]  # type: ignore[attr-defined]

    assert network.attempts == [URLS[0]] * 3


async def test_a_refusing_address_is_passed_over_and_tried_last_afterwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    network = Addresses(monkeypatch, refusing={URLS[0]})

    first = await connect(",".join(URLS))
    again = await connect(",".join(URLS))

    assert first.url == again.url == URLS[1]  # type: ignore[attr-defined]
    assert network.attempts == [URLS[0], URLS[1], URLS[1]]


async def test_a_connection_the_broker_ends_moves_the_next_connect_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    network = Addresses(monkeypatch, refusing=set())

    connection = await connect(URLS)
    connection.lost()  # type: ignore[attr-defined]
    after_loss = await connect(URLS)
    after_loss.close_called = True  # type: ignore[misc]
    after_loss.lost()  # type: ignore[attr-defined] # a close of ours: the node is fine
    after_own_close = await connect(URLS)

    assert network.attempts == [URLS[0], URLS[1], URLS[1]]
    assert after_own_close.url == URLS[1]  # type: ignore[attr-defined]


async def test_when_every_address_refuses_the_last_error_is_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    network = Addresses(monkeypatch, refusing=set(URLS))

    with pytest.raises(ConnectionRefusedError, match="mq-3"):
        await connect(URLS)
    # The next round starts after the one that failed last: the first again.
    with pytest.raises(ConnectionRefusedError, match="mq-3"):
        await connect(URLS)

    assert network.attempts == URLS + URLS


async def test_an_error_that_is_no_connection_failure_is_not_passed_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken(url: str, connection_name: str | None) -> FakeConnection:
        raise RuntimeError("a bug, not a broker that is down")

    monkeypatch.setattr(outbox.broker, "_connect_one", broken)

    with pytest.raises(RuntimeError):
        await connect(URLS)


async def test_a_handshake_refusal_is_a_connection_failure_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[str] = []

    async def first_cuts(url: str, connection_name: str | None) -> FakeConnection:
        attempts.append(url)
        if url == URLS[0]:
            raise aiormq.exceptions.AMQPConnectionError("closed during the handshake")
        return FakeConnection(url)

    monkeypatch.setattr(outbox.broker, "_connect_one", first_cuts)

    connection = await connect(URLS)

    assert connection.url == URLS[1]  # type: ignore[attr-defined]
    assert attempts == URLS[:2]

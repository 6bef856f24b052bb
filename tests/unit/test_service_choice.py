"""How the suite finds its services: environment first, Docker second, else a clear failure."""

from __future__ import annotations

import pytest

from support import services


def docker_up() -> bool:
    return True


def docker_down() -> bool:
    return False


def docker_must_not_be_asked() -> bool:
    raise AssertionError("an explicit URL must win without probing Docker")


def test_an_environment_url_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(services.DATABASE_VARIABLE, "postgresql://db.internal/x")

    choice = services.choose(services.DATABASE_VARIABLE, docker_must_not_be_asked)

    assert choice == services.ServiceChoice(url="postgresql://db.internal/x", use_container=False)


def test_without_a_url_a_container_is_used_when_docker_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(services.AMQP_VARIABLE, raising=False)

    choice = services.choose(services.AMQP_VARIABLE, docker_up)

    assert choice == services.ServiceChoice(url=None, use_container=True)


@pytest.mark.parametrize("variable", [services.DATABASE_VARIABLE, services.AMQP_VARIABLE])
def test_without_a_url_or_docker_the_failure_names_the_variables(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "  ")

    with pytest.raises(services.ServicesUnavailable) as raised:
        services.choose(variable, docker_down)

    message = str(raised.value)
    assert f"{variable} is not set" in message
    assert services.DATABASE_VARIABLE in message
    assert services.AMQP_VARIABLE in message

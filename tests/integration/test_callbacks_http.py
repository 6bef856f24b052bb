"""`outbox callbacks serve` over real HTTP: every verification failure is refused before
anything is recorded (forged, stale, replayed, oversized, another secret, a rotated
secret accepted), a redelivery is a 200 that changes nothing, and the server's metrics
count each outcome from 0. The application connects as a login of the outbox_callbacks
role, which proves its one grant is enough."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from outbox import OperationState, Registry, Settings
from outbox.cli import run_command
from outbox.metrics import MetricNames

from support.callback_helpers import (
    FOREIGN_SECRET,
    PAYMENTS_ROTATED,
    PAYMENTS_SECRET,
    SECRETS,
    TICKETS_SECRET,
    Receiving,
    callback_registry,
    event,
    receiving,
    signed,
)
from support.db_helpers import execute_admin
from support.logins import Login, group_logins
from support.ops_helpers import Ops
from support.sample_tools import Ledger
from support.scraping import scrape, value

S = OperationState
CANARY = f"canary-{uuid.uuid4().hex}"


@pytest.fixture
def login(postgres_server_url: str, database_url: str) -> Iterator[Login]:
    with group_logins(postgres_server_url, database_url) as make:
        yield make


@pytest.fixture
def callbacks_registry(ledger: Ledger) -> Registry:
    return callback_registry(ledger)


@pytest.fixture
def server(settings: Settings, login: Login, callbacks_registry: Registry) -> Iterator[Receiving]:
    with receiving(settings, login("outbox_callbacks"), callbacks_registry) as running:
        yield running


@pytest.fixture
def ops(database_url: str, callbacks_registry: Registry) -> Ops:
    return Ops(database_url, callbacks_registry)


def inbox(database_url: str) -> list[tuple[Any, ...]]:
    return execute_admin(database_url, "SELECT provider, event_id, status FROM callbacks")


def port_of(server: Receiving) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.mark.parametrize("provider", ["payments", "tickets"])
def test_a_signed_callback_is_recorded_and_answered_200(
    server: Receiving, ops: Ops, database_url: str, provider: str
) -> None:
    operation = ops.at(S.OUTCOME_UNKNOWN)
    payload = event("effect.committed", operation.id, reference="re_1")

    answer = server.send(provider, payload, delivery="msg_fixed")

    assert answer.status_code == 200
    assert answer.json() == {"result": "recorded"}
    event_id = payload["id"] if provider == "payments" else "msg_fixed"
    assert inbox(database_url) == [(provider, event_id, "committed")]
    # In the inbox, not yet in the chain: the consumer chains it when it applies it.
    assert "operation.callback_received" not in ops.event_names(operation.id)
    # Recording moves nothing: the consumer's reconciler applies it.
    assert ops.get(operation.id).state is S.OUTCOME_UNKNOWN


@pytest.mark.parametrize("provider", ["payments", "tickets"])
def test_a_replayed_request_inside_the_window_is_a_200_duplicate_that_changes_nothing(
    server: Receiving, ops: Ops, database_url: str, provider: str
) -> None:
    operation = ops.at(S.OUTCOME_UNKNOWN)
    body, headers = signed(provider, event("effect.committed", operation.id))
    first = server.post(provider, body, headers)
    rows, events = inbox(database_url), ops.event_names(operation.id)

    again = server.post(provider, body, headers)

    assert (first.json(), again.json()) == ({"result": "recorded"}, {"result": "duplicate"})
    assert again.status_code == 200
    assert inbox(database_url) == rows
    assert ops.event_names(operation.id) == events
    samples = scrape(port_of(server))
    assert (
        value(samples, "outbox_callbacks_duplicates_total", provider=provider, payload="same") == 1
    )


def test_a_redelivery_signed_again_later_is_a_duplicate_too(
    server: Receiving, ops: Ops, database_url: str
) -> None:
    # What a provider's retry looks like: the same event, a new signature and timestamp.
    operation = ops.at(S.OUTCOME_UNKNOWN)
    payload = event("effect.committed", operation.id)
    server.send("payments", payload, timestamp=time.time() - 60)

    again = server.send("payments", payload)

    assert again.json() == {"result": "duplicate"}
    assert len(inbox(database_url)) == 1


@pytest.mark.parametrize("provider", ["payments", "tickets"])
def test_a_forged_body_is_refused_400_and_nothing_is_recorded(
    server: Receiving, ops: Ops, database_url: str, provider: str
) -> None:
    operation = ops.at(S.OUTCOME_UNKNOWN)
    body, headers = signed(provider, event("effect.rejected", operation.id))
    forged = body.replace(b"effect.rejected", b"effect.committed")

    answer = server.post(provider, forged, headers)

    assert (answer.status_code, answer.json()) == (400, {"error": "signature"})
    assert inbox(database_url) == []
    assert ops.event_names(operation.id)[-1] == "operation.outcome_unknown"


@pytest.mark.parametrize("provider", ["payments", "tickets"])
def test_a_callback_signed_with_another_secret_is_refused(
    server: Receiving, database_url: str, provider: str
) -> None:
    secret = "whsec_someone_elses_secret_0123" if provider == "payments" else FOREIGN_SECRET
    answer = server.send(provider, event("effect.committed", uuid.uuid4()), secrets=(secret,))

    assert (answer.status_code, answer.json()) == (400, {"error": "signature"})
    assert inbox(database_url) == []


@pytest.mark.parametrize("provider", ["payments", "tickets"])
@pytest.mark.parametrize("age", [-400.0, 400.0])
def test_a_stale_or_future_timestamp_is_refused(
    server: Receiving, database_url: str, provider: str, age: float
) -> None:
    # A request captured more than five minutes ago and replayed now, or dated ahead.
    answer = server.send(
        provider, event("effect.committed", uuid.uuid4()), timestamp=time.time() - age
    )

    assert (answer.status_code, answer.json()) == (400, {"error": "timestamp"})
    assert inbox(database_url) == []


def test_an_oversized_body_is_refused_413_before_it_is_read(
    server: Receiving, database_url: str
) -> None:
    payload = event("effect.committed", uuid.uuid4(), padding="x" * (64 * 1024))
    body, headers = signed("payments", payload)

    declared = server.post("payments", body, headers)

    def chunks() -> Iterator[bytes]:
        # No Content-Length: the limit holds for a streamed body too.
        for start in range(0, len(body), 4096):
            yield body[start : start + 4096]

    streamed = httpx.post(
        f"{server.url}/callbacks/payments", content=chunks(), headers=headers, timeout=20
    )

    assert (declared.status_code, declared.json()) == (413, {"error": "too_large"})
    assert (streamed.status_code, streamed.json()) == (413, {"error": "too_large"})
    assert inbox(database_url) == []
    refused = value(
        scrape(port_of(server)),
        "outbox_callbacks_refused_total",
        provider="payments",
        reason="too_large",
    )
    assert refused == 2


def test_a_rotated_secret_is_accepted_with_either_secret_during_the_rotation(
    settings: Settings, login: Login, callbacks_registry: Registry, database_url: str
) -> None:
    rotating = {**SECRETS, "payments": (PAYMENTS_SECRET, PAYMENTS_ROTATED)}
    with receiving(settings, login("outbox_callbacks"), callbacks_registry, rotating) as server:
        old = server.send("payments", event("effect.pending", uuid.uuid4()))
        new = server.send(
            "payments", event("effect.pending", uuid.uuid4()), secrets=(PAYMENTS_ROTATED,)
        )
        # A provider rotating on its side signs with both; one suffices.
        both = server.send(
            "payments",
            event("effect.pending", uuid.uuid4()),
            secrets=(PAYMENTS_ROTATED, "whsec_the_next_one_0123456789"),
        )
    # And once the rotation ends, the old secret is refused.
    with receiving(
        settings,
        login("outbox_callbacks"),
        callbacks_registry,
        {**SECRETS, "payments": (PAYMENTS_ROTATED,)},
    ) as rotated:
        retired = rotated.send("payments", event("effect.pending", uuid.uuid4()))

    assert [a.json()["result"] for a in (old, new, both)] == ["unmatched"] * 3
    assert (retired.status_code, retired.json()) == (400, {"error": "signature"})
    assert len(inbox(database_url)) == 3


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b'{"type": "effect.committed"}', b"[" * 100 + b"]" * 100],
)
def test_a_verified_body_that_reads_as_no_callback_is_refused_422(
    server: Receiving, database_url: str, body: bytes
) -> None:
    answer = server.post("payments", *signed("payments", body))

    assert (answer.status_code, answer.json()) == (422, {"error": "malformed"})
    assert inbox(database_url) == []


def test_an_event_id_outside_the_inbox_bounds_is_refused_422(
    server: Receiving, database_url: str
) -> None:
    answer = server.send("payments", event("effect.committed", None, event_id="evt with spaces"))

    assert (answer.status_code, answer.json()) == (422, {"error": "malformed"})
    assert inbox(database_url) == []


def test_an_event_about_no_effect_is_answered_200_and_not_recorded(
    server: Receiving, database_url: str
) -> None:
    answer = server.send("tickets", event("account.updated", None))

    assert (answer.status_code, answer.json()) == (200, {"result": "ignored"})
    assert inbox(database_url) == []


def test_a_callback_for_no_operation_is_kept_and_counted_unmatched(
    server: Receiving, database_url: str
) -> None:
    answer = server.send("payments", event("effect.committed", uuid.uuid4(), reference="re_x"))

    assert answer.json() == {"result": "unmatched"}
    assert execute_admin(database_url, "SELECT outcome FROM callbacks") == [("unmatched",)]
    assert (
        value(scrape(port_of(server)), "outbox_callbacks_unmatched_total", provider="payments") == 1
    )


def test_only_the_declared_providers_have_a_route(server: Receiving) -> None:
    assert httpx.post(f"{server.url}/callbacks/stripe", content=b"{}").status_code == 404
    assert httpx.get(f"{server.url}/callbacks/payments").status_code == 405
    assert httpx.get(f"{server.url}/healthz").text == "ok\n"


def test_every_label_set_is_exported_at_0_and_each_outcome_is_counted(
    server: Receiving, ops: Ops
) -> None:
    before = scrape(port_of(server))
    operation = ops.at(S.OUTCOME_UNKNOWN)
    server.send("payments", event("effect.committed", operation.id))
    server.send("payments", event("effect.committed", operation.id), timestamp=0)
    server.send("tickets", event("ping", None))
    after = scrape(port_of(server))

    for provider in ("payments", "tickets"):
        for status in ("committed", "rejected", "pending"):
            assert (
                value(before, "outbox_callbacks_received_total", provider=provider, status=status)
                == 0
            )
        for reason in ("signature", "timestamp", "too_large", "malformed"):
            assert (
                value(before, "outbox_callbacks_refused_total", provider=provider, reason=reason)
                == 0
            )
        assert value(before, "outbox_callbacks_unmatched_total", provider=provider) == 0
        assert value(before, "outbox_callbacks_ignored_total", provider=provider) == 0
    assert (
        value(after, "outbox_callbacks_received_total", provider="payments", status="committed")
        == 1
    )
    assert (
        value(after, "outbox_callbacks_refused_total", provider="payments", reason="timestamp") == 1
    )
    assert value(after, "outbox_callbacks_ignored_total", provider="tickets") == 1
    names = {name for name, _ in after}
    assert {f"{MetricNames.CALLBACKS_RECEIVED}_total", "outbox_build_info"} <= names


def test_nothing_a_request_carries_reaches_a_log_line(
    server: Receiving, ops: Ops, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    operation = ops.at(S.OUTCOME_UNKNOWN)
    payload = event("effect.committed", operation.id, reference=f"re_{CANARY}", note=CANARY)
    body, headers = signed("payments", payload)

    server.post("payments", body, {**headers, "x-canary": CANARY})
    server.post("payments", body.replace(b"note", b"nope"), headers)  # refused
    server.post("payments", body, {**headers, "stripe-signature": f"t=1,v1={CANARY}"})

    lines = "\n".join(f"{record.getMessage()} {vars(record)}" for record in caplog.records)
    assert "callbacks.recorded" in lines
    assert "callbacks.refused" in lines
    assert CANARY not in lines
    assert PAYMENTS_SECRET not in lines


def test_a_database_that_is_away_is_a_503_the_provider_retries(
    settings: Settings, callbacks_registry: Registry, database_url: str
) -> None:
    nowhere = "postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=2"
    with receiving(settings, nowhere, callbacks_registry) as server:
        answer = server.send("payments", event("effect.committed", uuid.uuid4()))

    assert (answer.status_code, answer.json()) == (503, {"error": "unavailable"})
    assert inbox(database_url) == []


# --- the command's refusals, before it serves anything --------------------------------


def serve(monkeypatch: pytest.MonkeyPatch, database_url: str, **environ: str) -> int:
    monkeypatch.delenv("OUTBOX_CALLBACK_SECRETS", raising=False)
    monkeypatch.delenv("OUTBOX_CALLBACK_SECRETS_FILE", raising=False)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    for name, setting in environ.items():
        monkeypatch.setenv(name, setting)
    return run_command(["callbacks", "serve", "--tools", "outbox.sandbox.tools", "--port", "0"])


def test_serve_refuses_to_start_without_a_secret_for_each_provider(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], database_url: str
) -> None:
    code = serve(
        monkeypatch, database_url, OUTBOX_CALLBACK_SECRETS=f"sandbox-payments:{PAYMENTS_SECRET}"
    )

    assert code == 2
    err = capsys.readouterr().err
    assert "no secret for the callbacks of sandbox-email" in err
    assert PAYMENTS_SECRET not in err


def test_serve_refuses_a_secret_no_contract_declares(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], database_url: str
) -> None:
    secrets = (
        f"sandbox-payments:{PAYMENTS_SECRET},sandbox-email:{FOREIGN_SECRET},"
        f"sandbox-emial:{TICKETS_SECRET}"
    )

    code = serve(monkeypatch, database_url, OUTBOX_CALLBACK_SECRETS=secrets)

    assert code == 2
    assert "secrets are configured for sandbox-emial, which no registered contract" in (
        capsys.readouterr().err
    )


def test_serve_refuses_a_database_without_the_inbox(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], empty_database_url: str
) -> None:
    secrets = f"sandbox-payments:{PAYMENTS_SECRET},sandbox-email:{FOREIGN_SECRET}"

    code = serve(monkeypatch, empty_database_url, OUTBOX_CALLBACK_SECRETS=secrets)

    assert code == 1
    assert "run `outbox migrate --roles`" in capsys.readouterr().err

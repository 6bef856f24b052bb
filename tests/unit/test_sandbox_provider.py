"""The payment-provider sandbox: its API, its idempotency rules and each injected fault.

Other tests judge the runtime by the sandbox's ledger, so the ledger must count exactly
the effects that happened, including the ones whose response was lost.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox.sandbox import cli
from outbox.sandbox.provider import Faults, SandboxProvider

from support.logs import rendered
from support.waiting import eventually_sync

REPOSITORY = Path(__file__).resolve().parents[2]
LOST_RESPONSE = (httpx.RemoteProtocolError, httpx.ReadError)
REFUND_ID = re.compile(r"re_[0-9a-f]{24}")
WITHIN = 10.0


@pytest.fixture
def provider() -> Iterator[SandboxProvider]:
    with SandboxProvider() as running:
        yield running


@pytest.fixture
def client(provider: SandboxProvider) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=provider.url, timeout=WITHIN) as http:
        yield http


def refund(
    client: httpx.Client,
    key: str | None,
    amount_cents: int = 500,
    payment_id: str = "pay_1",
    **extra: Any,
) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    body = {"payment_id": payment_id, "amount_cents": amount_cents, "currency": "EUR", **extra}
    return client.post("/refunds", json=body, headers=headers)


def lookup(client: httpx.Client, key: str) -> httpx.Response:
    return client.get("/refunds", params={"idempotency_key": key})


def email(client: httpx.Client, key: str | None = None) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    body = {"to": "customer@example.com", "subject": "Your refund", "body": "Sent today."}
    return client.post("/emails", json=body, headers=headers)


def totals(client: httpx.Client) -> dict[str, int]:
    counts: dict[str, int] = client.get("/ledger").json()["totals"]
    return counts


# --- refunds ---------------------------------------------------------------------------


def test_a_refund_is_created_and_can_be_read_back(client: httpx.Client) -> None:
    created = refund(client, "key-1", amount_cents=1234, reason="damaged")

    assert created.status_code == 201
    body = created.json()
    assert REFUND_ID.fullmatch(body["id"])
    assert body == {
        "id": body["id"],
        "status": "succeeded",
        "payment_id": "pay_1",
        "amount_cents": 1234,
        "currency": "EUR",
        "idempotency_key": "key-1",
    }
    fetched = client.get(f"/refunds/{body['id']}")
    assert fetched.status_code == 200
    assert fetched.json() == body
    ledger = client.get("/ledger").json()
    assert ledger["refunds"] == [body]
    assert ledger["refunds_by_payment"] == {"pay_1": 1}
    assert ledger["refunds_by_key"] == {"key-1": 1}
    assert ledger["totals"] == {"refunds": 1, "emails": 0}


def test_same_key_and_parameters_replay_the_original_and_create_nothing(
    client: httpx.Client,
) -> None:
    first = refund(client, "key-1")
    second = refund(client, "key-1")

    assert second.status_code == first.status_code == 201
    assert second.json() == first.json()
    assert client.get("/ledger").json()["refunds_by_key"] == {"key-1": 1}


@pytest.mark.parametrize(
    "changed",
    [{"amount_cents": 501}, {"payment_id": "pay_2"}, {"reason": "other"}],
    ids=["amount", "payment", "reason"],
)
def test_same_key_with_other_parameters_is_refused(
    client: httpx.Client, changed: dict[str, Any]
) -> None:
    assert refund(client, "key-1").status_code == 201

    reused = refund(client, "key-1", **{"amount_cents": 500, "payment_id": "pay_1", **changed})

    assert reused.status_code == 422
    assert reused.json() == {"error": "idempotency_key_reused"}
    assert totals(client)["refunds"] == 1


@pytest.mark.parametrize("key", [None, ""], ids=["missing", "empty"])
def test_a_refund_without_idempotency_key_is_refused(client: httpx.Client, key: str | None) -> None:
    response = refund(client, key)

    assert response.status_code == 400
    assert response.json() == {"error": "idempotency_key_required"}
    assert totals(client)["refunds"] == 0


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        b'{"payment_id": "pay_1", "currency": "EUR"}',
        b'{"payment_id": "pay_1", "amount_cents": 0, "currency": "EUR"}',
        b'{"payment_id": "pay_1", "amount_cents": -5, "currency": "EUR"}',
        b'{"payment_id": "pay_1", "amount_cents": "500", "currency": "EUR"}',
        b'{"payment_id": "pay_1", "amount_cents": 5.5, "currency": "EUR"}',
        b'{"payment_id": "pay_1", "amount_cents": true, "currency": "EUR"}',
        b'{"payment_id": "pay_1", "amount_cents": 500, "currency": "eur"}',
        b'{"payment_id": "pay_1", "amount_cents": 500, "currency": "EURO"}',
        b'{"payment_id": 1, "amount_cents": 500, "currency": "EUR"}',
        b'{"payment_id": "pay_1", "amount_cents": 500, "currency": "EUR", "reason": 3}',
        b'{"payment_id": "pay_1", "amount_cents": 500, "currency": "EUR", "extra": 1}',
    ],
)
def test_a_malformed_refund_is_refused(client: httpx.Client, content: bytes) -> None:
    response = client.post(
        "/refunds",
        content=content,
        headers={"Idempotency-Key": "key-1", "Content-Type": "application/json"},
    )

    assert response.status_code == 400
    assert response.json() == {"error": "invalid_request"}
    # Validation failed before execution, so the key is still free.
    assert refund(client, "key-1").status_code == 201


@pytest.mark.parametrize(
    "payment_id", ["card_1", "pay_", "pay_a-b", "PAY_1", "pay_" + "a" * 61, "pay_1\n"]
)
def test_a_payment_id_of_unknown_format_is_not_found(client: httpx.Client, payment_id: str) -> None:
    response = refund(client, "key-1", payment_id=payment_id)

    assert response.status_code == 404
    assert response.json() == {"error": "payment_not_found"}
    assert totals(client)["refunds"] == 0


def test_any_payment_id_of_the_right_format_exists(client: httpx.Client) -> None:
    assert refund(client, "key-1", payment_id="pay_" + "Az09_" * 12).status_code == 201


def test_refunds_may_not_exceed_the_captured_amount_in_total() -> None:
    with (
        SandboxProvider(payment_amount_cents=10_000) as provider,
        httpx.Client(base_url=provider.url) as client,
    ):
        too_much = refund(client, "key-1", amount_cents=10_001)
        assert too_much.status_code == 402
        assert too_much.json() == {"error": "amount_exceeds_payment"}
        assert totals(client)["refunds"] == 0

        assert refund(client, "key-2", amount_cents=6_000).status_code == 201
        assert refund(client, "key-3", amount_cents=4_001).status_code == 402
        assert refund(client, "key-4", amount_cents=4_000).status_code == 201
        assert refund(client, "key-5", amount_cents=1).status_code == 402
        # Each payment has its own captured amount.
        assert refund(client, "key-6", amount_cents=10_000, payment_id="pay_2").status_code == 201

        ledger = client.get("/ledger").json()
        assert ledger["refunds_by_payment"] == {"pay_1": 2, "pay_2": 1}
        assert sum(r["amount_cents"] for r in ledger["refunds"] if r["payment_id"] == "pay_1") == (
            10_000
        )


def test_a_declined_refund_replays_its_decline(client: httpx.Client) -> None:
    declined = refund(client, "key-1", amount_cents=100_001)

    replayed = refund(client, "key-1", amount_cents=100_001)

    assert declined.status_code == replayed.status_code == 402
    assert replayed.json() == {"error": "amount_exceeds_payment"}
    assert lookup(client, "key-1").status_code == 404
    assert totals(client)["refunds"] == 0


# --- lookups ---------------------------------------------------------------------------


def test_a_lookup_by_key_finds_the_refund_or_says_definitively_not_found(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    created = refund(client, "key-1").json()

    found = lookup(client, "key-1")
    assert found.status_code == 200
    assert found.json() == created

    missing = lookup(client, "key-never-used")
    assert missing.status_code == 404
    assert missing.json() == {"error": "not_found"}

    provider.set_faults(lookups_unavailable=True)
    unavailable = lookup(client, "key-1")
    assert unavailable.status_code == 503
    assert unavailable.json() == {"error": "lookups_unavailable"}
    # Only lookups are down: refunds still go through.
    assert refund(client, "key-2").status_code == 201

    provider.set_faults(lookups_unavailable=False)
    assert lookup(client, "key-1").json() == created


def test_a_lookup_needs_exactly_one_key(client: httpx.Client) -> None:
    assert client.get("/refunds").status_code == 400
    assert client.get("/refunds", params={"idempotency_key": ""}).status_code == 400
    assert client.get("/refunds?idempotency_key=a&idempotency_key=b").status_code == 400


def test_an_unknown_refund_id_is_not_found(client: httpx.Client) -> None:
    response = client.get("/refunds/re_000000000000000000000000")

    assert response.status_code == 404
    assert response.json() == {"error": "not_found"}


# --- faults ----------------------------------------------------------------------------


def test_during_a_delay_the_key_is_in_progress_for_posts_and_lookups(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(delay_ms=60_000)

    def first_request() -> httpx.Response:
        with httpx.Client(base_url=provider.url, timeout=WITHIN * 3) as own:
            return refund(own, "key-1")

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(first_request)
        eventually_sync(
            lambda: lookup(client, "key-1").status_code == 409,
            within=WITHIN,
            what="the first request is executing",
        )

        concurrent = refund(client, "key-1")
        assert concurrent.status_code == 409
        assert concurrent.json() == {"error": "request_in_progress"}
        assert lookup(client, "key-1").json() == {"error": "request_in_progress"}
        # The delay comes after the commit: the effect already happened.
        assert totals(client)["refunds"] == 1
        assert not first.done()

        provider.set_faults(delay_ms=0)
        original = first.result(timeout=WITHIN)

    assert original.status_code == 201
    assert lookup(client, "key-1").json() == original.json()
    assert refund(client, "key-1").json() == original.json()
    assert totals(client)["refunds"] == 1


def test_a_delay_holds_the_response_at_least_that_long(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(delay_ms=300)

    started = time.monotonic()
    response = refund(client, "key-1")

    assert response.status_code == 201
    assert time.monotonic() - started >= 0.3


def test_a_dropped_response_still_commits_the_refund(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(drop_response_every=1)

    with pytest.raises(LOST_RESPONSE):
        refund(client, "key-1")

    ledger = client.get("/ledger").json()
    assert ledger["refunds_by_key"] == {"key-1": 1}
    committed = ledger["refunds"][0]
    assert lookup(client, "key-1").json() == committed
    # A replay of the key returns the refund the lost response was about.
    provider.set_faults(drop_response_every=0)
    assert refund(client, "key-1").json() == committed
    assert totals(client)["refunds"] == 1


def test_every_n_counts_from_one_and_repeats(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(drop_response_every=3)
    lost = []
    for number in range(1, 8):
        try:
            refund(client, f"key-{number}")
        except LOST_RESPONSE:
            lost.append(number)

    assert lost == [3, 6]
    assert totals(client)["refunds"] == 7


def test_setting_an_every_fault_restarts_its_count(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(drop_response_every=5)
    for number in range(3):
        assert refund(client, f"early-{number}").status_code == 201

    provider.set_faults(drop_response_every=2)

    assert refund(client, "late-1").status_code == 201
    with pytest.raises(LOST_RESPONSE):
        refund(client, "late-2")


def test_fail_before_commit_creates_nothing_and_a_retry_succeeds_once(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(fail_before_commit_every=2)
    assert refund(client, "key-1").status_code == 201

    failed = refund(client, "key-2", amount_cents=700)
    assert failed.status_code == 503
    assert failed.json() == {"error": "unavailable"}
    assert client.get("/ledger").json()["refunds_by_key"] == {"key-1": 1}
    assert lookup(client, "key-2").status_code == 404

    retried = refund(client, "key-2", amount_cents=700)
    assert retried.status_code == 201
    assert refund(client, "key-3").status_code == 503
    assert refund(client, "key-2", amount_cents=700).json() == retried.json()
    assert client.get("/ledger").json()["refunds_by_key"] == {"key-1": 1, "key-2": 1}


def test_an_injected_conflict_commits_nothing_and_leaves_the_key_unused(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(conflict_every=1)

    conflict = refund(client, "key-1")
    assert conflict.status_code == 409
    assert conflict.json() == {"error": "request_in_progress"}
    assert totals(client)["refunds"] == 0

    provider.set_faults(conflict_every=0)
    # Other parameters are accepted: the refused request never bound the key.
    assert refund(client, "key-1", amount_cents=900).status_code == 201


def test_a_pruned_key_replayed_creates_a_second_refund(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    """The trap the runtime avoids: past the provider's dedupe window a key no longer
    deduplicates, so the runtime reconciles by lookup instead of replaying the key
    (docs/design.md section 12). The lookup still finds the refund."""
    provider.set_faults(prune_keys_older_than_s=0.0)

    first = refund(client, "key-1").json()
    second = refund(client, "key-1").json()

    assert second["id"] != first["id"]
    ledger = client.get("/ledger").json()
    assert ledger["refunds_by_key"] == {"key-1": 2}
    assert ledger["refunds_by_payment"] == {"pay_1": 2}
    assert lookup(client, "key-1").json() == first


def test_keys_younger_than_the_prune_age_still_replay(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(prune_keys_older_than_s=3600.0)

    first = refund(client, "key-1").json()

    assert refund(client, "key-1").json() == first
    assert totals(client)["refunds"] == 1


def outcomes(provider: SandboxProvider, count: int) -> list[str]:
    seen = []
    with httpx.Client(base_url=provider.url, timeout=WITHIN) as client:
        for number in range(count):
            try:
                seen.append(str(refund(client, f"key-{number}", amount_cents=1).status_code))
            except LOST_RESPONSE:
                seen.append("lost")
    return seen


def test_seeded_probabilities_replay_the_same_outcomes() -> None:
    faults = Faults(
        seed=7,
        fail_before_commit_probability=0.2,
        conflict_probability=0.2,
        drop_response_probability=0.2,
    )
    with SandboxProvider(faults=faults) as provider:
        first_run = outcomes(provider, 40)
        committed = provider.ledger()["totals"]["refunds"]
        provider.reset()
        after_reset = outcomes(provider, 40)
    with SandboxProvider(faults=faults.model_copy(update={"seed": 8})) as provider:
        other_seed = outcomes(provider, 40)
    with SandboxProvider(faults=faults) as provider:
        same_seed = outcomes(provider, 40)

    assert set(first_run) == {"201", "503", "409", "lost"}
    assert committed == first_run.count("201") + first_run.count("lost")
    assert after_reset == first_run
    assert same_seed == first_run
    assert other_seed != first_run


# --- an outage and a rate limit (#44) -------------------------------------------------


def get_refund(client: httpx.Client, refund_id: str) -> httpx.Response:
    return client.get(f"/refunds/{refund_id}")


def test_an_outage_answers_503_to_every_call_and_lookup_and_commits_nothing(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    created = refund(client, "key-1").json()
    provider.set_faults(unavailable=True)

    answers = [
        refund(client, "key-2"),
        email(client),
        lookup(client, "key-1"),
        get_refund(client, created["id"]),
        # Down is down: even a request it would refuse gets the outage's answer.
        refund(client, None),
        client.post("/emails", json={"to": "x"}),
        client.get("/refunds"),
    ]

    assert [answer.status_code for answer in answers] == [503] * 7
    assert [answer.json() for answer in answers] == [{"error": "service_unavailable"}] * 7
    assert all("Retry-After" not in answer.headers for answer in answers)
    assert totals(client) == {"refunds": 1, "emails": 0}
    # The ledger and the admin routes stay up: the evidence is not part of the outage.
    assert client.get("/healthz").status_code == 200

    provider.set_faults(unavailable=False)
    # The refused request bound nothing: its key is free, other parameters and all.
    assert refund(client, "key-2", amount_cents=900).status_code == 201
    assert lookup(client, "key-1").json() == created


def test_an_outage_may_say_when_to_come_back(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(unavailable=True, unavailable_retry_after_s=7)

    down = refund(client, "key-1")

    assert down.status_code == 503
    assert down.headers["Retry-After"] == "7"
    assert lookup(client, "key-1").headers["Retry-After"] == "7"


def test_an_outage_moves_no_every_n_counter(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(drop_response_every=2, unavailable=True)
    for number in range(3):
        assert refund(client, f"down-{number}").status_code == 503

    provider.set_faults(unavailable=False)

    assert refund(client, "up-1").status_code == 201
    with pytest.raises(LOST_RESPONSE):
        refund(client, "up-2")


def test_a_rate_limit_answers_429_with_retry_after_and_commits_nothing(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(rate_limit_every=2, rate_limit_retry_after_s=3)

    assert refund(client, "key-1").status_code == 201
    limited = refund(client, "key-2")
    assert limited.status_code == 429
    assert limited.json() == {"error": "rate_limited"}
    assert limited.headers["Retry-After"] == "3"
    assert client.get("/ledger").json()["refunds_by_key"] == {"key-1": 1}
    # Each kind counts apart: emails and lookups are limited every 2nd too.
    assert email(client).status_code == 202
    assert email(client).status_code == 429
    assert lookup(client, "key-1").status_code == 200
    assert lookup(client, "key-1").status_code == 429
    assert totals(client) == {"refunds": 1, "emails": 1}

    provider.set_faults(rate_limit_every=0)
    # The limited request bound nothing.
    assert refund(client, "key-2", amount_cents=900).status_code == 201


def test_a_rate_limit_comes_before_the_other_faults_and_may_omit_retry_after(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(
        rate_limit_probability=1.0, rate_limit_retry_after_s=None, fail_before_commit_every=1
    )

    limited = refund(client, "key-1")

    assert limited.status_code == 429
    assert "Retry-After" not in limited.headers
    assert get_refund(client, "re_000000000000000000000000").status_code == 429
    provider.set_faults(rate_limit_probability=0.0)
    # fail_before_commit's count did not move while the rate limit answered.
    assert refund(client, "key-1").status_code == 503


def test_the_request_log_says_when_each_call_arrived_and_what_it_got(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    before = time.monotonic()
    created = refund(client, "key-1").json()
    provider.set_faults(rate_limit_every=1, rate_limit_retry_after_s=2)
    email(client)
    provider.set_faults(rate_limit_every=0, unavailable=True, unavailable_retry_after_s=5)
    lookup(client, "key-1")
    get_refund(client, created["id"])
    provider.set_faults(unavailable=False)
    client.get("/ledger")
    client.get("/admin/faults")
    after = time.monotonic()

    logged = provider.requests()

    assert [(r["endpoint"], r["status"], r["retry_after_s"]) for r in logged] == [
        ("POST /refunds", 201, None),
        ("POST /emails", 429, 2),
        ("GET /refunds?idempotency_key=", 503, 5),
        ("GET /refunds/{id}", 503, 5),
    ]
    arrivals = [r["monotonic"] for r in logged]
    assert before <= arrivals[0] <= arrivals[-1] <= after
    assert arrivals == sorted(arrivals)
    assert all(abs(r["at"] - time.time()) < WITHIN for r in logged)
    assert not any(r["dropped"] for r in logged)
    assert provider.requests("POST /emails") == [logged[1]]
    assert client.get("/admin/requests").json() == {"requests": logged}


def test_the_request_log_counts_a_dropped_response_and_a_refused_request(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(drop_response_every=1)
    with pytest.raises(LOST_RESPONSE):
        refund(client, "key-1")
    client.post("/refunds", content=b"{", headers={"Idempotency-Key": "key-2"})

    assert [(r["status"], r["dropped"]) for r in provider.requests()] == [
        (201, True),
        (400, False),
    ]


def test_reset_empties_the_request_log(provider: SandboxProvider, client: httpx.Client) -> None:
    refund(client, "key-1")
    provider.reset()

    assert provider.requests() == []


# --- emails ----------------------------------------------------------------------------


def test_emails_are_not_deduplicated(client: httpx.Client) -> None:
    first = email(client, key="key-1")
    second = email(client, key="key-1")

    assert first.status_code == second.status_code == 202
    assert first.json()["status"] == second.json()["status"] == "sent"
    assert first.json()["id"] != second.json()["id"]
    assert first.json()["id"].startswith("em_")
    ledger = client.get("/ledger").json()
    assert ledger["emails"] == [
        {
            "id": first.json()["id"],
            "to": "customer@example.com",
            "subject": "Your refund",
            "reference": None,
        },
        {
            "id": second.json()["id"],
            "to": "customer@example.com",
            "subject": "Your refund",
            "reference": None,
        },
    ]
    assert ledger["totals"] == {"refunds": 0, "emails": 2}


def test_the_ledger_lists_each_email_with_its_reference(client: httpx.Client) -> None:
    body = {"to": "customer@example.com", "subject": "Your refund", "body": "Sent today."}
    sent = [
        client.post("/emails", json=body, headers={"X-Reference": reference}).json()["id"]
        for reference in ("op_a", "op_b", "op_a")
    ]
    unreferenced = email(client).json()["id"]

    emails = client.get("/ledger").json()["emails"]

    assert [(e["id"], e["reference"]) for e in emails] == [
        (sent[0], "op_a"),
        (sent[1], "op_b"),
        (sent[2], "op_a"),
        (unreferenced, None),
    ]


def test_a_malformed_email_is_refused(client: httpx.Client) -> None:
    response = client.post("/emails", json={"to": "customer@example.com", "subject": "x"})

    assert response.status_code == 400
    assert response.json() == {"error": "invalid_request"}
    assert totals(client)["emails"] == 0


def test_faults_apply_to_emails(provider: SandboxProvider, client: httpx.Client) -> None:
    provider.set_faults(fail_before_commit_every=1)
    assert email(client).status_code == 503
    assert totals(client)["emails"] == 0

    provider.set_faults(fail_before_commit_every=0, drop_response_every=1)
    with pytest.raises(LOST_RESPONSE):
        email(client)
    assert totals(client)["emails"] == 1


def test_every_n_counts_each_endpoint_kind_separately(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    provider.set_faults(drop_response_every=2)

    assert refund(client, "key-1").status_code == 201
    assert email(client).status_code == 202
    with pytest.raises(LOST_RESPONSE):
        refund(client, "key-2")
    with pytest.raises(LOST_RESPONSE):
        email(client)


# --- admin, routes, lifecycle ----------------------------------------------------------


def test_faults_are_read_and_partially_updated_over_http(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    assert client.get("/admin/faults").json() == Faults().model_dump()

    updated = client.post("/admin/faults", json={"conflict_every": 2, "delay_ms": 5})
    assert updated.status_code == 200
    assert updated.json() == Faults(conflict_every=2, delay_ms=5).model_dump()

    client.post("/admin/faults", json={"lookups_unavailable": True})
    assert provider.faults == Faults(conflict_every=2, delay_ms=5, lookups_unavailable=True)


@pytest.mark.parametrize(
    "content",
    [
        b"{",
        b"[1]",
        b'{"no_such_fault": 1}',
        b'{"delay_ms": -1}',
        b'{"conflict_probability": 2}',
        b'{"rate_limit_retry_after_s": -1}',
        b'{"unavailable_retry_after_s": "soon"}',
    ],
)
def test_an_invalid_fault_update_is_refused_and_changes_nothing(
    provider: SandboxProvider, client: httpx.Client, content: bytes
) -> None:
    response = client.post("/admin/faults", content=content)

    assert response.status_code == 400
    assert response.json() == {"error": "invalid_request"}
    assert provider.faults == Faults()


def test_reset_clears_the_books_and_keeps_the_faults(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    refund(client, "key-1")
    email(client)
    provider.set_faults(prune_keys_older_than_s=3600.0)

    assert client.post("/admin/reset").status_code == 200

    assert client.get("/ledger").json() == {
        "refunds": [],
        "emails": [],
        "refunds_by_payment": {},
        "refunds_by_key": {},
        "emails_by_reference": {},
        "totals": {"refunds": 0, "emails": 0},
    }
    assert provider.faults.prune_keys_older_than_s == 3600.0
    assert lookup(client, "key-1").status_code == 404
    # The key is forgotten with its refund, and the payment is fully refundable again.
    assert refund(client, "key-1", amount_cents=100_000).status_code == 201


def test_health_routes_and_methods(provider: SandboxProvider, client: httpx.Client) -> None:
    health = client.get("/healthz")
    assert health.status_code == 200
    assert health.text == "ok"
    assert client.get("/nowhere").status_code == 404
    assert client.get("/emails").status_code == 405
    assert client.delete("/refunds/re_1").status_code == 405
    assert client.get("/ledger").json() == provider.ledger()


def test_a_stopped_provider_refuses_connections_and_restarts_with_its_books(
    provider: SandboxProvider, client: httpx.Client
) -> None:
    created = refund(client, "key-1").json()
    port = provider.port

    provider.stop()
    with pytest.raises(httpx.ConnectError):
        client.get("/healthz")

    assert provider.start() == port
    assert lookup(client, "key-1").json() == created


def test_logs_carry_ids_and_codes_never_request_text(
    provider: SandboxProvider, client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    canary = "CANARY-user-text-5d1"
    provider.set_faults(drop_response_every=2)

    created = refund(client, "key-1", reason=canary).json()
    with pytest.raises(LOST_RESPONSE):
        refund(client, "key-2", reason=canary)
    client.post("/emails", json={"to": f"{canary}@x", "subject": canary, "body": canary})
    client.post("/refunds", content=canary.encode(), headers={"Idempotency-Key": "key-3"})

    assert created["id"] in rendered(caplog)
    assert "provider.response.dropped" in rendered(caplog)
    assert canary not in rendered(caplog)


# --- command line ----------------------------------------------------------------------


def test_fault_flags_beat_the_faults_json() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--faults",
            json.dumps({"seed": 3, "conflict_every": 2}),
            "--seed",
            "5",
            "--lookups-unavailable",
            "--prune-keys-older-than-s",
            "0.5",
        ]
    )

    assert cli.faults_from(args) == Faults(
        seed=5, conflict_every=2, lookups_unavailable=True, prune_keys_older_than_s=0.5
    )


def test_the_outage_and_rate_limit_have_flags() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--unavailable",
            "--unavailable-retry-after-s",
            "30",
            "--rate-limit-every",
            "3",
            "--rate-limit-retry-after-s",
            "2",
        ]
    )

    assert cli.faults_from(args) == Faults(
        unavailable=True,
        unavailable_retry_after_s=30,
        rate_limit_every=3,
        rate_limit_retry_after_s=2,
    )


def test_the_provider_command_is_registered_with_its_handler() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))

    args = parser.parse_args(["provider", "--port", "0", "--delay-ms", "10"])

    assert args.handler is cli.run
    assert args.port == 0
    assert cli.faults_from(args) == Faults(delay_ms=10)


def _provider_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "outbox.sandbox.provider", *flags]


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("OUTBOX_")}


@pytest.mark.timeout(60)
def test_the_module_serves_until_sigterm_and_exits_zero() -> None:
    command = _provider_command("--port", "0", "--faults", '{"lookups_unavailable": true}')
    with subprocess.Popen(
        command, cwd=REPOSITORY, env=_environment(), stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stderr is not None
        stderr = process.stderr
        lines: queue.Queue[str] = queue.Queue()

        def read_lines() -> None:
            for line in stderr:
                lines.put(line)

        # A thread, so the wait for the listening line can have a deadline.
        reader = threading.Thread(target=read_lines, daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 30
            listening = None
            while listening is None:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
                listening = re.fullmatch(r"provider\.listening host=(\S+) port=(\d+)\n", line)
            host, port = listening.group(1), int(listening.group(2))
            assert host == "127.0.0.1"
            assert port > 0

            with httpx.Client(base_url=f"http://{host}:{port}", timeout=WITHIN) as client:
                assert client.get("/healthz").text == "ok"
                assert client.get("/admin/faults").json()["lookups_unavailable"] is True

            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=WITHIN) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        reader.join(timeout=WITHIN)


@pytest.mark.timeout(60)
def test_the_module_refuses_invalid_faults_with_exit_code_two() -> None:
    result = subprocess.run(
        _provider_command("--port", "0", "--faults", '{"no_such_fault": 1}'),
        cwd=REPOSITORY,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )

    assert result.returncode == 2
    assert "invalid faults: no_such_fault" in result.stderr
    assert "provider.listening" not in result.stderr

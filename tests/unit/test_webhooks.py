"""outbox/callbacks/verify.py: verifying a provider's signed callbacks, and where the secrets come
from. Standard Webhooks is checked against the `standardwebhooks` package's own signing,
the Stripe-style scheme against the `stripe` package's signing and verifying, both ways."""

from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import standardwebhooks
import stripe

from outbox.callback_policy import Scheme
from outbox.callbacks.verify import (
    MAX_TOLERANCE_SECONDS,
    SECRETS_ENV,
    SECRETS_FILE_ENV,
    StandardWebhooksVerifier,
    StripeVerifier,
    secrets_from_environment,
    sign_standard_webhooks,
    sign_stripe,
    verifier_for,
)
from outbox.errors import CallbackRefused, ConfigurationError

OLD = "whsec_" + base64.b64encode(b"o" * 32).decode()
NEW = "whsec_" + base64.b64encode(b"n" * 32).decode()
OTHER = "whsec_" + base64.b64encode(b"x" * 32).decode()
STRIPE_OLD = "whsec_stripe_old_0123456789abcdef"
STRIPE_NEW = "whsec_stripe_new_0123456789abcdef"
BODY = json.dumps({"type": "refund.succeeded", "data": {"id": "re_1"}}).encode()


def refused(verify: object, *args: object) -> str:
    assert callable(verify)
    with pytest.raises(CallbackRefused) as refusal:
        verify(*args)
    return refusal.value.reason


# --- Standard Webhooks ---------------------------------------------------------------------


def library_headers(secret: str, body: bytes, when: float, msg_id: str = "msg_1") -> dict[str, str]:
    """What a sender using the standardwebhooks package itself sends."""
    moment = datetime.fromtimestamp(when, tz=UTC)
    signature = standardwebhooks.Webhook(secret).sign(msg_id, moment, body.decode())
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(when)),
        "webhook-signature": signature,
    }


def test_a_callback_the_library_signed_is_verified_and_its_id_returned() -> None:
    verifier = StandardWebhooksVerifier((NEW,))
    assert verifier.verify(BODY, library_headers(NEW, BODY, time.time())) == "msg_1"


def test_what_the_sandbox_signs_the_library_verifies() -> None:
    headers = sign_standard_webhooks((NEW,), "msg_2", BODY, time.time())
    assert standardwebhooks.Webhook(NEW).verify(BODY, headers) == json.loads(BODY)


def test_a_rotated_secret_verifies_with_either_secret_configured() -> None:
    # The receiver holds the old and the new secret while the sender moves over.
    verifier = StandardWebhooksVerifier((OLD, NEW))
    for secret in (OLD, NEW):
        assert verifier.verify(BODY, library_headers(secret, BODY, time.time())) == "msg_1"
    # A sender that signs with both during its own rotation, to a receiver that knows one.
    both = sign_standard_webhooks((OLD, NEW), "msg_3", BODY, time.time())
    assert len(both["webhook-signature"].split(" ")) == 2
    assert StandardWebhooksVerifier((NEW,)).verify(BODY, both) == "msg_3"


def test_a_callback_signed_with_another_secret_is_refused() -> None:
    verifier = StandardWebhooksVerifier((OLD, NEW))
    assert refused(verifier.verify, BODY, library_headers(OTHER, BODY, time.time())) == "signature"


def test_a_forged_body_is_refused() -> None:
    headers = library_headers(NEW, BODY, time.time())
    forged = BODY.replace(b"re_1", b"re_2")
    assert refused(StandardWebhooksVerifier((NEW,)).verify, forged, headers) == "signature"


@pytest.mark.parametrize("offset", [-400.0, 400.0])
def test_a_timestamp_outside_the_tolerance_is_refused_before_the_signature(offset: float) -> None:
    headers = library_headers(NEW, BODY, time.time() + offset)
    assert refused(StandardWebhooksVerifier((NEW,)).verify, BODY, headers) == "timestamp"


def test_a_tolerance_shorter_than_the_librarys_own_is_kept() -> None:
    # standardwebhooks checks 5 minutes itself; a receiver may demand less.
    headers = library_headers(NEW, BODY, time.time() - 120)
    assert StandardWebhooksVerifier((NEW,)).verify(BODY, headers) == "msg_1"
    strict = StandardWebhooksVerifier((NEW,), tolerance=60)
    assert refused(strict.verify, BODY, headers) == "timestamp"


@pytest.mark.parametrize(
    "change",
    [
        {"webhook-signature": "garbage"},  # the library's own split raises ValueError
        {"webhook-signature": "v1,not*base64!"},  # and b64decode raises binascii.Error
        {"webhook-signature": "v1a,abc v2,def"},
        {"webhook-signature": ""},
        {"webhook-id": ""},
        {"webhook-timestamp": "soon"},
        {"webhook-timestamp": "nan"},
        {"webhook-timestamp": "1e400"},
    ],
)
def test_a_malformed_header_is_refused_and_never_an_exception_of_the_library(
    change: dict[str, str],
) -> None:
    headers = {**library_headers(NEW, BODY, time.time()), **change}
    assert refused(StandardWebhooksVerifier((NEW,)).verify, BODY, headers) in {
        "signature",
        "timestamp",
    }


def test_a_body_that_is_no_text_is_malformed() -> None:
    body = b"\xff\xfe"
    headers = {
        "webhook-id": "m",
        "webhook-timestamp": str(int(time.time())),
        "webhook-signature": "v1,AAAA",
    }
    assert refused(StandardWebhooksVerifier((NEW,)).verify, body, headers) == "malformed"


def test_header_names_are_read_in_any_case() -> None:
    headers = {k.upper(): v for k, v in library_headers(NEW, BODY, time.time()).items()}
    assert StandardWebhooksVerifier((NEW,)).verify(BODY, headers) == "msg_1"


# --- Stripe's t=…,v1=… ---------------------------------------------------------------------


def test_a_header_stripes_library_made_is_verified() -> None:
    header = stripe.WebhookSignature.generate_signature_header(BODY.decode(), STRIPE_NEW)
    StripeVerifier((STRIPE_NEW,)).verify(BODY, {"Stripe-Signature": header})


def test_what_the_sandbox_signs_stripes_library_verifies() -> None:
    headers = sign_stripe((STRIPE_NEW,), BODY, time.time())
    assert stripe.WebhookSignature.verify_header(
        BODY.decode(), headers["Stripe-Signature"], STRIPE_NEW, tolerance=300
    )


def test_stripe_rotation_either_secret_and_a_header_with_two_signatures() -> None:
    for secret in (STRIPE_OLD, STRIPE_NEW):
        header = stripe.WebhookSignature.generate_signature_header(BODY.decode(), secret)
        StripeVerifier((STRIPE_OLD, STRIPE_NEW)).verify(BODY, {"stripe-signature": header})
    both = sign_stripe((STRIPE_OLD, STRIPE_NEW), BODY, time.time())["Stripe-Signature"]
    assert both.count("v1=") == 2
    StripeVerifier((STRIPE_NEW,)).verify(BODY, {"Stripe-Signature": both})


def test_stripe_wrong_secret_and_forged_body_are_refused() -> None:
    header = {"Stripe-Signature": sign_stripe((STRIPE_OLD,), BODY, time.time())["Stripe-Signature"]}
    assert refused(StripeVerifier((STRIPE_NEW,)).verify, BODY, header) == "signature"
    forged = BODY.replace(b"re_1", b"re_9")
    assert refused(StripeVerifier((STRIPE_OLD,)).verify, forged, header) == "signature"


def test_a_v0_signature_is_never_accepted() -> None:
    t = int(time.time())
    v1 = sign_stripe((STRIPE_NEW,), BODY, t)["Stripe-Signature"].split("v1=")[1]
    header = {"Stripe-Signature": f"t={t},v0={v1}"}
    assert refused(StripeVerifier((STRIPE_NEW,)).verify, BODY, header) == "signature"


@pytest.mark.parametrize("offset", [-301.0, 301.0])
def test_stripe_stale_or_future_timestamps_are_refused(offset: float) -> None:
    # Stripe's own library refuses only the stale side; a timestamp from the future is a
    # replay window that never closes, so it is refused too.
    header = sign_stripe((STRIPE_NEW,), BODY, time.time() + offset)
    assert refused(StripeVerifier((STRIPE_NEW,)).verify, BODY, header) == "timestamp"


@pytest.mark.parametrize(
    "header",
    ["", "v1=abc", "t=,v1=abc", "t=12x,v1=abc", "t=1,t=2,v1=abc", "garbage", "t=" + "9" * 40],
)
def test_a_malformed_stripe_header_is_refused(header: str) -> None:
    assert refused(StripeVerifier((STRIPE_NEW,)).verify, BODY, {"Stripe-Signature": header}) in {
        "signature",
        "timestamp",
    }


def test_a_missing_stripe_header_is_refused() -> None:
    assert refused(StripeVerifier((STRIPE_NEW,)).verify, BODY, {}) == "signature"


# --- building verifiers, and their secrets ------------------------------------------------


def test_verifier_for_each_scheme() -> None:
    assert isinstance(verifier_for(Scheme.STANDARD_WEBHOOKS, (NEW,)), StandardWebhooksVerifier)
    assert isinstance(verifier_for(Scheme.STRIPE, (STRIPE_NEW,)), StripeVerifier)


def test_no_secret_ever_shows_in_a_verifiers_repr() -> None:
    for verifier in (StandardWebhooksVerifier((NEW,)), StripeVerifier((STRIPE_NEW,))):
        assert NEW not in repr(verifier)
        assert STRIPE_NEW not in repr(verifier)


def test_a_tolerance_beyond_the_librarys_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="at most 300"):
        StandardWebhooksVerifier((NEW,), tolerance=MAX_TOLERANCE_SECONDS + 1)


def test_a_standard_webhooks_secret_that_is_no_base64_is_refused_by_position() -> None:
    with pytest.raises(ConfigurationError) as refusal:
        verifier_for(Scheme.STANDARD_WEBHOOKS, (NEW, "whsec_%%%"), where="payments")
    assert "secret 2 of payments" in str(refusal.value)
    assert "%%%" not in str(refusal.value)


def test_secrets_come_from_the_environment_one_or_more_per_provider() -> None:
    found = secrets_from_environment(
        {SECRETS_ENV: f"payments:{STRIPE_OLD}, payments:{STRIPE_NEW},email:{NEW}"}
    )
    assert found == {"payments": (STRIPE_OLD, STRIPE_NEW), "email": (NEW,)}


def test_secrets_come_from_a_file_one_per_line(tmp_path: Path) -> None:
    path = tmp_path / "callbacks"
    path.write_text(f"# rotated 2026-11\npayments:{STRIPE_OLD}\n\npayments:{STRIPE_NEW}\n")
    found = secrets_from_environment({SECRETS_FILE_ENV: str(path)})
    assert found == {"payments": (STRIPE_OLD, STRIPE_NEW)}


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({SECRETS_ENV: "payments"}, f"{SECRETS_ENV} entry 1 is not name:secret"),
        ({SECRETS_ENV: f"pay ments:{NEW}"}, f"{SECRETS_ENV} entry 1: a provider name"),
        ({SECRETS_ENV: "payments:short"}, f"{SECRETS_ENV} entry 1: the secret must be"),
        ({SECRETS_ENV: f"a:{NEW},b:{NEW}"}, f"{SECRETS_ENV} entry 2: two entries share"),
        ({SECRETS_ENV: f"a:{NEW}", SECRETS_FILE_ENV: "/x"}, "set one of"),
        ({SECRETS_FILE_ENV: "/nonexistent/callbacks"}, "cannot read"),
    ],
)
def test_bad_secrets_are_named_by_position_never_shown(environ: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigurationError) as refusal:
        secrets_from_environment(environ)
    message = str(refusal.value)
    assert words in message
    assert NEW not in message
    assert "short" not in message


def test_a_line_of_the_secrets_file_holding_a_comma_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "callbacks"
    path.write_text(f"payments:{STRIPE_OLD},{STRIPE_NEW}\n")
    with pytest.raises(ConfigurationError, match=f"{SECRETS_FILE_ENV} line 1 holds a comma"):
        secrets_from_environment({SECRETS_FILE_ENV: str(path)})


def test_no_secrets_anywhere_is_an_empty_set() -> None:
    assert secrets_from_environment({}) == {}

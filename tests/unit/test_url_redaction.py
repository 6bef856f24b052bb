"""Every libpq parameter that carries a secret is hidden wherever a URL is shown,
however its name is spelled: percent-encoded (libpq decodes it), in capitals, or
encoded twice."""

from __future__ import annotations

import string
from urllib.parse import quote

from hypothesis import given
from hypothesis import strategies as st

from outbox.urls import SECRET_PARAMETERS, redact_url

SECRET_ALPHABET = string.ascii_letters + string.digits + "!$'()*+,;:@/?~-._"


@st.composite
def spelled(draw: st.DrawFn, name: str) -> str:
    """``name`` as a URL may spell it: any letter in capitals or percent-encoded (upper
    or lower hex), and sometimes the whole of it encoded again."""
    letters = []
    for letter in name:
        form = draw(st.sampled_from(["plain", "capital", "upper-hex", "lower-hex"]))
        if form == "capital":
            letters.append(letter.upper())
        elif form == "plain":
            letters.append(letter)
        else:
            encoded = f"%{ord(letter):02X}"
            letters.append(encoded if form == "upper-hex" else encoded.lower())
    spelling = "".join(letters)
    return quote(spelling, safe="") if draw(st.booleans()) else spelling


@st.composite
def urls_with_a_secret(draw: st.DrawFn) -> tuple[str, str]:
    secret = "Zq" + draw(st.text(SECRET_ALPHABET, min_size=10, max_size=30))
    name = draw(spelled(draw(st.sampled_from(sorted(SECRET_PARAMETERS)))))
    value = quote(secret, safe="") if draw(st.booleans()) else quote(secret, safe="!$'()*+,;:@/~")
    others = ["application_name=billing", "sslmode=require", "connect_timeout=5"]
    position = draw(st.integers(min_value=0, max_value=len(others)))
    parameters = [*others[:position], f"{name}={value}", *others[position:]]
    hosts = draw(st.sampled_from(["db:5432", "db-1:5432,db-2:5432", "[::1]:5432"]))
    return f"postgresql://app@{hosts}/outbox?{'&'.join(parameters)}", secret


@given(urls_with_a_secret())
def test_a_secret_parameter_is_hidden_in_any_spelling(url_and_secret: tuple[str, str]) -> None:
    url, secret = url_and_secret

    shown = redact_url(url)

    assert secret not in shown
    assert quote(secret, safe="") not in shown
    assert secret[:12] not in shown
    # What is not secret is still there to read.
    for kept in ("application_name=billing", "sslmode=require", "connect_timeout=5"):
        assert kept in shown
    assert "=***" in shown


def test_the_two_spellings_found_printed_are_hidden() -> None:
    assert redact_url("postgresql://app@db/outbox?sslpassword=k3y-pass&sslmode=verify-full") == (
        "postgresql://app@db/outbox?sslpassword=***&sslmode=verify-full"
    )
    assert redact_url("postgresql://app@db/outbox?pass%77ord=s3cret") == (
        "postgresql://app@db/outbox?pass%77ord=***"
    )


def test_a_parameter_that_only_looks_secret_is_kept() -> None:
    # passfile and sslkey name files, not secrets; a name that merely contains
    # "password" is not libpq's.
    url = "postgresql://app@db/outbox?passfile=/etc/pgpass&sslkey=/k.pem&password_hint=x"
    assert redact_url(url) == url

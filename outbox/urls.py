"""The database and broker URLs: how they are read, checked, converted and redacted.

Checked as libpq and aio-pika will read them, before anything connects, with messages
that never quote the URL (a misread one often puts its password where a host or port
should be). :mod:`outbox.settings` validates its URL settings with these.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox.errors import ConfigurationError

_ENCODE_IT = (
    "percent-encode spaces and the characters @ : / ? # [ ] in the user name and password "
    "(a space is %20, # is %23)"
)


def split_amqp_urls(value: str) -> list[str]:
    """``OUTBOX_AMQP_URL`` as its addresses: one URL, or several separated by commas
    (spaces around a comma are ignored). Empty ones are kept for validation to refuse."""
    return [url.strip() for url in value.split(",")]


def redact_amqp_urls(value: str) -> str:
    """Every address of ``OUTBOX_AMQP_URL`` with its password replaced. redact_url alone
    would hide the first address's password only: urlsplit reads the rest as a path."""
    return ", ".join(redact_url(url) for url in split_amqp_urls(value))


def check_amqp_url(url: str, *, first: bool) -> None:
    """Refuse an AMQP address aio-pika cannot use; a later address is never quoted."""
    if not url:
        raise ValueError("the URL is empty")
    scheme = url_scheme(url)
    if scheme not in ("amqp", "amqps"):
        if not first:
            # What precedes a ":" in a later address may be the tail of a password that
            # held an unencoded comma: never quote it.
            raise ValueError("the URL does not start with amqp:// or amqps://")
        raise ValueError(f"AMQP URL scheme {scheme!r} is not supported; use amqp:// or amqps://")
    try:
        _ = urlsplit(url).port  # raises on a port that is no number
    except ValueError:
        # Its message quotes the "port", which is part of the password when an
        # unencoded "#", "?", "/" or "," cut the URL short.
        raise ValueError(f"the URL's port is not a number; {_ENCODE_IT}") from None


def url_scheme(url: str) -> str:
    """The URL's scheme; ValueError, quoting nothing, if it cannot be parsed."""
    try:
        return urlsplit(url).scheme
    except ValueError:
        # An unclosed "[" reads as an IPv6 host; the message is ours either way.
        raise ValueError(f"the URL cannot be parsed; {_ENCODE_IT}") from None


def check_libpq_reads(url: str) -> None:
    """Refuse a URL libpq cannot read, or reads otherwise than we do (we redact what
    urlsplit calls the password), before anything connects with it. The messages are
    ours: libpq's quote the offending part of the URL, often the password itself."""
    url = libpq_url(url)
    try:
        parsed = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        raise ValueError(f"libpq cannot read this URL; {_ENCODE_IT}") from None
    parts = urlsplit(url)
    in_query = dict(parse_qsl(parts.query))
    for key, ours in (("user", parts.username), ("password", parts.password)):
        if key not in in_query and parsed.get(key) != (None if ours is None else unquote(ours)):
            raise ValueError(f"libpq reads the {key} of this URL differently; {_ENCODE_IT}")


# What a URL naming several hosts must ask libpq for: a daemon that landed on a standby
# (libpq's default, "any", takes the first host that answers) would fail every write
# there, and reconnect to that same standby each time.
WRITABLE_SESSION_ATTRS = ("read-write", "primary")


@dataclass(frozen=True)
class DatabaseHost:
    host: str
    port: int | None


def database_hosts(url: str) -> list[DatabaseHost]:
    """The hosts of a libpq URL, in the order libpq tries them: one, or the several of
    the multi-host form ``postgresql://u@h1:5432,h2:5432/db``. A host with no port has
    None (libpq's default, 5432, or the URL's ``port`` parameter). Raises ValueError
    naming the host by its place, never quoting the URL."""
    places = urlsplit(libpq_url(url)).netloc.rpartition("@")[2].split(",")
    hosts = []
    for number, place in enumerate(places, start=1):
        where = f"host {number} of {len(places)}" if len(places) > 1 else "the host"
        host, port = place, ""
        if place.startswith("["):  # [IPv6]:port
            host, _, rest = place[1:].partition("]")
            port = rest.removeprefix(":")
        elif ":" in place:
            host, _, port = place.rpartition(":")
        if not host and len(places) > 1:
            raise ValueError(f"{where} is empty")
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{where}: the port is not a number from 1 to 65535")
        hosts.append(DatabaseHost(host=host, port=int(port) if port else None))
    return hosts


def _host_and_port(host: DatabaseHost) -> str:
    name = f"[{host.host}]" if ":" in host.host else host.host  # an IPv6 address
    return f"{name}:{host.port}" if host.port else name


def check_database_hosts(url: str) -> None:
    """Several hosts are checked one by one and named by place ("host 2 of 2"), as the
    broker addresses are; a host list must ask for the writable one."""
    hosts = database_hosts(url)
    if len(hosts) == 1:
        return
    attrs = dict(parse_qsl(urlsplit(url).query)).get("target_session_attrs")
    if attrs not in WRITABLE_SESSION_ATTRS:
        raise ValueError(
            f"the URL names {len(hosts)} hosts without ?target_session_attrs=read-write: "
            "libpq would connect to the first that answers, a standby included, where every "
            "write fails. Add target_session_attrs=read-write (or primary)"
        )


def sqlalchemy_url(url: str) -> str:
    """The URL with the psycopg 3 driver named, as SQLAlchemy wants it. SQLAlchemy reads
    one host in the URL's authority; several go to its ``host=`` query parameters, which
    its psycopg dialect hands to libpq as the same host list."""
    parts = urlsplit(url)
    if parts.scheme in ("postgresql", "postgres"):
        parts = parts._replace(scheme="postgresql+psycopg")
    credentials, at, netloc = parts.netloc.rpartition("@")
    if "," in netloc:
        hosts = [("host", _host_and_port(h)) for h in database_hosts(url)]
        query = urlencode([*hosts, *parse_qsl(parts.query)], safe=":[]")
        parts = parts._replace(netloc=f"{credentials}{at}", query=query)
    return urlunsplit(parts)


def libpq_url(url: str) -> str:
    """The URL without a SQLAlchemy driver suffix, as psycopg and libpq want it."""
    parts = urlsplit(url)
    if parts.scheme in ("postgresql+psycopg", "postgres"):
        parts = parts._replace(scheme="postgresql")
    return urlunsplit(parts)


# The libpq connection parameters whose value is a secret: the password, and the one
# that unlocks the client's SSL key. (sslkey, passfile and the like name files.)
SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def _is_secret_parameter(name: str) -> bool:
    """Whether a query parameter's name is a secret one, as libpq reads it (percent-
    decoded) or in any spelling that decodes to one: case and further percent-encoding
    cost nothing to hide as well."""
    for _ in range(5):
        decoded = unquote(name)
        if decoded.strip().lower() in SECRET_PARAMETERS:
            return True
        if decoded == name:
            return False
        name = decoded
    return True  # encoded five times over: hidden rather than read further


def _redacted_parameters(query: str) -> str:
    """``query`` (``a=1&password=x``) with the value of every secret parameter hidden."""
    pieces = []
    for piece in query.split("&"):
        name, equals, _ = piece.partition("=")
        pieces.append(f"{name}=***" if equals and _is_secret_parameter(name) else piece)
    return "&".join(pieces)


def redact_url(url: str) -> str:
    """The URL with its password and every secret libpq parameter (:data:`SECRET_PARAMETERS`,
    however spelled) replaced, fit for a log line or an error message."""
    parts = urlsplit(url)
    if parts.password is None and "@" not in parts.netloc and "@" in url.partition("://")[2]:
        # An unencoded "#", "?" or "/" in the password ends urlsplit's netloc early, but
        # libpq reads credentials up to the "@": hide everything from the user's ":" to
        # the last "@" rather than print the tail of a password. (An "@" in a query
        # value, after a netloc that has its own, is not one of those.)
        scheme, _, rest = url.partition("://")
        credentials, _, host = rest.rpartition("@")
        if ":" in credentials:
            return f"{scheme}://{credentials.split(':', 1)[0]}:***@{redact_url(host)}"
    query, fragment = _redacted_parameters(parts.query), _redacted_parameters(parts.fragment)
    if parts.password is None and (query, fragment) == (parts.query, parts.fragment):
        return url
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{netloc}")
    return urlunsplit(parts._replace(query=query, fragment=fragment))


def database_name(url: str) -> str:
    name = urlsplit(url).path.lstrip("/")
    if not name:
        raise ConfigurationError("the database URL names no database (add /outbox to it)")
    return name


def with_database(url: str, name: str) -> str:
    """The same server URL pointing at another database."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address to bind) reaches only this machine: the
    servers that take requests (`outbox mcp`, `outbox console`) bind nothing else
    without being told to."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

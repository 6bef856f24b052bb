"""Who may use the console and how they prove it; read from the environment only.

Credentials never come from flags (``ps`` shows flags to every user of the machine) and
are never logged or printed: an error names the variable, never its value. An operator's
name comes from the credential they presented, never from anything they typed.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from outbox import credentials
from outbox.credentials import Credential as Credential  # re-exported: the console's operators
from outbox.errors import ConfigurationError
from outbox.settings import is_loopback as is_loopback  # re-exported: the console's bind check

OPERATORS_ENV = "OUTBOX_CONSOLE_OPERATORS"
PROXY_HEADER_ENV = "OUTBOX_CONSOLE_PROXY_HEADER"
TRUSTED_PROXIES_ENV = "OUTBOX_CONSOLE_TRUSTED_PROXIES"
HOSTS_ENV = "OUTBOX_CONSOLE_HOSTS"
# A token a person could guess or shoulder-surf is not a credential for settling money.
MIN_TOKEN_LENGTH = 16
MAX_NAME_LENGTH = 120
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8740
# Host names a console answers to without being told more. Any other name is a page
# the browser thinks belongs to some other site (DNS rebinding): it must not read or
# drive this one.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_HEADER_NAME = re.compile(r"^[A-Za-z0-9]+(-[A-Za-z0-9]+)*$")
# A DNS name, an IPv4 address, or an IPv6 address with or without its brackets.
_HOST_NAME = re.compile(
    r"^(\[[0-9a-f:.]+\]|[0-9a-f:]*:[0-9a-f:.]*|[a-z0-9]([a-z0-9.-]*[a-z0-9])?)$"
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# The addresses a process on this machine can send from without privileges: loopback,
# and loopback written IPv4-mapped (how a dual-stack socket may report it).
_LOCAL_NETWORKS = tuple(
    ipaddress.ip_network(network) for network in ("127.0.0.0/8", "::1/128", "::ffff:127.0.0.0/104")
)

# Header names that cannot carry the operator's identity, and why. The identity header is
# believed because the proxy sets it and strips whatever the client sent; that holds only
# for a header nothing else has a say in. These each have another author on the way:
_SETS_ITSELF = "HTTP itself frames or routes the request with it, and every hop reads it"
_CLIENT_SENDS = "the client sends it on its own (credentials and state), and proxies pass it on"
_APPENDED = "proxies add to it rather than replace it, so what the client sent survives in it"
_BROWSER_SETS = "browsers set it on their own requests, and a web page chooses some of it"
_RESERVED_HEADERS = {
    **dict.fromkeys(
        (
            "host",
            "content-length",
            "content-type",
            "content-encoding",
            "transfer-encoding",
            "te",
            "trailer",
            "connection",
            "keep-alive",
            "upgrade",
            "expect",
            "date",
        ),
        _SETS_ITSELF,
    ),
    **dict.fromkeys(("authorization", "cookie", "cookie2"), _CLIENT_SENDS),
    **dict.fromkeys(
        (
            "forwarded",
            "x-forwarded-for",
            "x-forwarded-host",
            "x-forwarded-proto",
            "x-forwarded-port",
            "x-forwarded-prefix",
            "x-real-ip",
            "true-client-ip",
            "x-client-ip",
            "via",
        ),
        _APPENDED,
    ),
    **dict.fromkeys(
        (
            "origin",
            "referer",
            "user-agent",
            "accept",
            "accept-charset",
            "accept-encoding",
            "accept-language",
            "cache-control",
            "pragma",
            "range",
            "if-match",
            "if-none-match",
            "if-modified-since",
            "if-unmodified-since",
            "if-range",
            "dnt",
            "priority",
            "upgrade-insecure-requests",
            "x-requested-with",
            "x-csrf-token",
            "x-xsrf-token",
        ),
        _BROWSER_SETS,
    ),
}
# Whole families: Sec-* are set by browsers alone (Fetch metadata, client hints); Proxy-*
# are addressed to proxies (credentials among them).
_RESERVED_PREFIXES = {"sec-": _BROWSER_SETS, "proxy-": _CLIENT_SENDS}


@dataclass(frozen=True)
class ProxyIdentity:
    """Trust ``header`` as the operator's name, only on requests from ``proxies``."""

    header: str
    proxies: tuple[Network, ...]

    def local_networks(self) -> tuple[Network, ...]:
        """The trusted networks that hold an address of this machine's loopback: from
        there any local process, not only the proxy, can send the identity header."""
        return tuple(
            network
            for network in self.proxies
            if any(
                local.version == network.version and network.overlaps(local)
                for local in _LOCAL_NETWORKS
            )
        )

    def trusts(self, address: str | None) -> bool:
        if address is None:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.proxies)


@dataclass(frozen=True)
class AuthConfig:
    credentials: tuple[Credential, ...] = ()
    proxy: ProxyIdentity | None = None

    def __post_init__(self) -> None:
        if not self.credentials and self.proxy is None:
            raise ConfigurationError(
                "the console serves nobody without authentication: set "
                f"{OPERATORS_ENV}=name:token[,name:token...] (tokens of at least "
                f"{MIN_TOKEN_LENGTH} characters), or {PROXY_HEADER_ENV} and "
                f"{TRUSTED_PROXIES_ENV} for a reverse proxy that authenticates"
            )


def operator_name(text: str) -> str:
    """A name fit to record as an operator's identity, or ConfigurationError."""
    name = text.strip()
    if not name or len(name) > MAX_NAME_LENGTH or not name.isprintable():
        raise ConfigurationError(
            f"an operator name must be 1-{MAX_NAME_LENGTH} printable characters"
        )
    return name


def parse_credentials(text: str) -> tuple[Credential, ...]:
    return credentials.parse_credentials(
        text, variable=OPERATORS_ENV, min_length=MIN_TOKEN_LENGTH, name=operator_name
    )


def parse_proxies(text: str) -> tuple[Network, ...]:
    networks: list[Network] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            network = ipaddress.ip_network(part, strict=False)
        except ValueError:
            raise ConfigurationError(
                f"{TRUSTED_PROXIES_ENV}: {part!r} is not an IP address or network"
            ) from None
        if network.prefixlen == 0:
            raise ConfigurationError(
                f"{TRUSTED_PROXIES_ENV}: {part!r} is every address: anyone who reaches the "
                "console could name themselves any operator; name the proxy's own address "
                "(or the network of the proxies)"
            )
        networks.append(network)
    return tuple(networks)


def auth_from_environment(environ: Mapping[str, str] | None = None) -> AuthConfig:
    env = os.environ if environ is None else environ
    credentials = parse_credentials(env.get(OPERATORS_ENV, ""))
    header = env.get(PROXY_HEADER_ENV, "").strip()
    proxies = parse_proxies(env.get(TRUSTED_PROXIES_ENV, ""))
    if bool(header) != bool(proxies):
        raise ConfigurationError(
            f"{PROXY_HEADER_ENV} and {TRUSTED_PROXIES_ENV} go together: a name header is "
            "trusted only from the proxy addresses named"
        )
    if header and not _HEADER_NAME.fullmatch(header):
        # Dashes only: a name with "_" is dropped by some proxies and merged with its
        # dashed twin by others, so which copy arrives is the deployment's accident.
        raise ConfigurationError(
            f"{PROXY_HEADER_ENV}: a header name of letters, digits and dashes, like "
            "X-Forwarded-User"
        )
    reason = header and _reserved(header)
    if reason:
        raise ConfigurationError(
            f"{PROXY_HEADER_ENV}: {header} cannot name the operator: {reason}. Use a header "
            "only your proxy sets, such as X-Forwarded-User, and have it strip that header "
            "from its clients' requests"
        )
    proxy = ProxyIdentity(header=header, proxies=proxies) if header else None
    return AuthConfig(credentials=credentials, proxy=proxy)


def _reserved(header: str) -> str | None:
    """Why ``header`` cannot carry an identity, or None when it can."""
    name = header.lower()
    found = _RESERVED_HEADERS.get(name)
    if found is None:
        found = next((why for p, why in _RESERVED_PREFIXES.items() if name.startswith(p)), None)
    return found


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def served_hosts(
    bind_host: str, loopback: tuple[str, ...], environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The Host names the console answers to: the loopback names, the address it is
    bound to (unless that is every address), and the names in ``OUTBOX_CONSOLE_HOSTS``,
    which a console reached through a DNS name or a proxy that passes its own Host
    needs. Anything else is refused, so a page of another site that rebinds its name to
    this address cannot use the console."""
    env = os.environ if environ is None else environ
    names = list(loopback)
    bound = bind_host.strip().lower().strip("[]")
    # Every address (a wildcard bind) is no name a browser uses.
    if bound and not _is_wildcard(bound):
        names.append(bound)
    for part in env.get(HOSTS_ENV, "").split(","):
        name = part.strip().lower()
        if not name:
            continue
        if not _HOST_NAME.fullmatch(name):
            raise ConfigurationError(
                f"{HOSTS_ENV}: {name!r} is not a host name or address (no port, no scheme)"
            )
        names.append(name.strip("[]"))
    return tuple(dict.fromkeys(names))

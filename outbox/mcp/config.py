"""How ``outbox mcp`` is configured: the server's defaults and options, and who may call
it over HTTP. Imports nothing of the ``mcp`` SDK, so the subcommand can offer itself,
and say what to install, without it."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from outbox.credentials import Credential, parse_credentials
from outbox.errors import ConfigurationError
from outbox.urls import is_loopback

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_WAIT_SECONDS = 20.0
# The run of calls that name none. Decision keys are unique per run, so a default that
# changed between restarts would let a retry after a restart become a second decision.
DEFAULT_RUN_ID = "mcp"

# Over HTTP, the callers: name:token[,name:token...], each name the principal whose runs
# its token's calls belong to (the form of the console's OUTBOX_CONSOLE_OPERATORS).
TOKENS_ENV = "OUTBOX_MCP_TOKENS"
# A bearer token is all a caller shows, on every request, to an address that may be
# reachable from anywhere: one a person could type or guess is no credential.
MIN_TOKEN_LENGTH = 32
# The principal of the single token --bearer-token-env names, as before several tokens
# could be named: its decisions' run ids stay what they were.
BEARER_PRINCIPAL = "bearer"
# Whoever reaches a loopback address when no token is configured.
LOOPBACK_PRINCIPAL = "loopback"
# Where the HTTP guard leaves the authenticated principal for the handlers: the name
# the caller's token maps to, or LOOPBACK_PRINCIPAL when no token is configured.
PRINCIPAL_SCOPE_KEY = "outbox.mcp.principal"
# A principal prefixes run ids ("<principal>:<run id>"): no ":" in it, or two callers'
# runs could read alike; an id, not a person's name, since run ids reach log lines.
_CALLER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ServerOptions:
    run_id: str = DEFAULT_RUN_ID
    """The run a call belongs to when its `_meta` names none; decision keys are unique
    per run, so it must stay the same across restarts for a retry to find its decision."""
    wait: float = DEFAULT_WAIT_SECONDS
    """How long a call waits for the outcome before it answers ``pending``."""
    require_key: bool = False
    """Refuse keyless calls of every class, reads and idempotent writes included."""


def bearer_credentials(
    variable: str | None, environ: Mapping[str, str] | None = None
) -> tuple[Credential, ...]:
    """Who may call over HTTP: the one token in ``$variable`` (``--bearer-token-env``),
    principal ``bearer``, or the callers of ``OUTBOX_MCP_TOKENS``; none when neither is
    set. Errors name the variable and never a token."""
    env = os.environ if environ is None else environ
    listed = env.get(TOKENS_ENV, "")
    if variable is None:
        return parse_credentials(
            listed, variable=TOKENS_ENV, min_length=MIN_TOKEN_LENGTH, name=caller_name
        )
    if listed.strip():
        raise ConfigurationError(
            f"set {TOKENS_ENV} or --bearer-token-env, not both: which callers were meant "
            f"cannot be told. {TOKENS_ENV}=name:token[,...] names each caller; a token of "
            f"--bearer-token-env is the one caller `{BEARER_PRINCIPAL}`"
        )
    token = env.get(variable, "").strip()
    if not token:
        # The variable's name only; its value is never printed.
        raise ConfigurationError(
            f"--bearer-token-env names {variable!r}, which is unset or empty; put the token there"
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(
            f"--bearer-token-env {variable}: the token must be at least {MIN_TOKEN_LENGTH} "
            "characters (`openssl rand -base64 32` makes one)"
        )
    return (Credential(name=BEARER_PRINCIPAL, token=token),)


def caller_name(text: str) -> str:
    """A name fit to be a caller's principal, or ConfigurationError."""
    name = text.strip()
    if not _CALLER_NAME.fullmatch(name):
        raise ConfigurationError(
            "a caller's name is 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it prefixes the caller's run ids)"
        )
    if name == LOOPBACK_PRINCIPAL:
        raise ConfigurationError(
            f"{name!r} is the principal of calls without a token; name the caller otherwise"
        )
    return name


def check_exposure(host: str, credentials: Sequence[Credential]) -> None:
    """Refuse to serve HTTP beyond loopback without bearer tokens."""
    if not credentials and not is_loopback(host):
        raise ConfigurationError(
            f"--host {host} is not a loopback address and no bearer token is configured: "
            "anyone who reaches it could record decisions. Serve on 127.0.0.1, or give "
            f"each caller a token: {TOKENS_ENV}=name:token[,name:token...] (or "
            "--bearer-token-env NAME for one token in that variable)"
        )

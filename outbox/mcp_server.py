"""``outbox mcp``: serve the tool registry as MCP tools (see :mod:`outbox.mcp_tools`).

This module is what ``outbox`` loads to offer the subcommand, so it imports nothing from
the optional ``mcp`` SDK: without the ``mcp`` extra every other command keeps working,
and ``outbox mcp`` says what to install.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from outbox.cli import add_setting_flags, add_tools_flag, run_async, seconds
from outbox.connections import DATABASE_BOUND_SETTINGS
from outbox.credentials import Credential, parse_credentials
from outbox.errors import ConfigurationError
from outbox.loading import load_registry, module_list
from outbox.settings import Settings, is_loopback

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
# A principal prefixes run ids ("<principal>:<run id>"): no ":" in it, or two callers'
# runs could read alike; an id, not a person's name, since run ids reach log lines.
_CALLER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "mcp",
        help="serve the tools of a tools module as MCP tools, each call recorded exactly once",
        description="Serve every tool of the given tools modules as an MCP tool (latest "
        "version). A call records the decision, waits up to --wait seconds for its outcome "
        "and answers with it: committed, rejected, pending, awaiting_approval or escalated. "
        "Clients send a decision key in the request _meta under "
        '"io.effect-outbox/decision-key" and send it again when they retry: the same key is '
        "the same decision, never a second effect. Writes that must not happen twice are "
        "refused without one. Approvals are never asked of the client: a person grants them "
        "with `outbox approvals grant`. Needs the mcp extra (pip install 'effect-outbox[mcp]').",
    )
    add_tools_flag(parser, used_for="each of their tools is served")
    parser.add_argument(
        "--transport",
        choices=("stdio", "http"),
        default="stdio",
        help="stdio (the host starts this process) or streamable HTTP [stdio]",
    )
    parser.add_argument(
        "--host",
        default=None,
        help=f"HTTP: address to bind; anything but loopback needs a bearer token [{DEFAULT_HOST}]",
    )
    parser.add_argument(
        "--port", type=int, default=None, help=f"HTTP: port to bind [{DEFAULT_PORT}]"
    )
    parser.add_argument(
        "--bearer-token-env",
        metavar="NAME",
        default=None,
        help="HTTP: require `Authorization: Bearer <token>`, one token (32 characters or "
        "more, principal `bearer`) read from the environment variable NAME (never from a "
        f"flag, which others can read). For several callers, each its own principal, set "
        f"{TOKENS_ENV}=name:token[,name:token...] instead",
    )
    parser.add_argument(
        "--wait",
        type=seconds,
        default=DEFAULT_WAIT_SECONDS,
        metavar="SECONDS",
        help="how long a call waits for the outcome before it answers pending; an MCP "
        f"client's own timeout must be longer [{DEFAULT_WAIT_SECONDS:g}]",
    )
    parser.add_argument(
        "--run-id",
        default=DEFAULT_RUN_ID,
        metavar="ID",
        help='the run of calls whose _meta names none ("io.effect-outbox/run-id"); decision '
        "keys are unique per run, so keep it across restarts. Over HTTP the run is always "
        f"prefixed with the caller's principal [{DEFAULT_RUN_ID}]",
    )
    parser.add_argument(
        "--require-key",
        action="store_true",
        help="refuse every call without a decision key, reads and idempotent writes too",
    )
    add_setting_flags(parser, "database_url", *DATABASE_BOUND_SETTINGS)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    http = args.transport == "http"
    if not http and (
        args.host is not None or args.port is not None or args.bearer_token_env is not None
    ):
        raise ConfigurationError("--host, --port and --bearer-token-env apply to --transport http")
    host = args.host or DEFAULT_HOST
    port = DEFAULT_PORT if args.port is None else args.port
    if not 0 <= port <= 65535:
        raise ConfigurationError("--port must be between 0 and 65535")
    # Checked before anything is loaded or bound: an open door must never start serving.
    credentials = bearer_credentials(args.bearer_token_env) if http else ()
    if http:
        check_exposure(host, credentials)
    registry = load_registry(module_list([settings.tools]))
    try:
        from outbox import mcp_tools, mcp_transports
    except ImportError as missing:
        raise ConfigurationError(
            f"`outbox mcp` needs the MCP SDK ({getattr(missing, 'name', None) or 'mcp'} is "
            "not installed): pip install 'effect-outbox[mcp]'"
        ) from None
    server = mcp_tools.build_server(
        registry,
        settings,
        mcp_tools.ServerOptions(run_id=args.run_id, wait=args.wait, require_key=args.require_key),
    )
    if http:
        run_async(mcp_transports.serve_http(server, host=host, port=port, credentials=credentials))
    else:
        run_async(mcp_transports.serve_stdio(server))
    return 0


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

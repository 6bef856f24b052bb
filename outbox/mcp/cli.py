"""``outbox mcp``: the subcommand (the server is :mod:`outbox.mcp.server`).

This module is what ``outbox`` loads to offer the subcommand, so it imports nothing from
the optional ``mcp`` SDK: without the ``mcp`` extra every other command keeps working,
and ``outbox mcp`` says what to install.
"""

from __future__ import annotations

import argparse
from typing import Any

from outbox.cli import add_setting_flags, add_tools_flag, run_async, seconds
from outbox.connections import DATABASE_BOUND_SETTINGS
from outbox.errors import ConfigurationError
from outbox.loading import registry_from
from outbox.mcp.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_RUN_ID,
    DEFAULT_WAIT_SECONDS,
    TOKENS_ENV,
    ServerOptions,
    bearer_credentials,
    check_exposure,
)
from outbox.serving import SERVING_SETTINGS, Limits, add_bind_flags, check_port, needs_extra
from outbox.settings import Settings


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
    add_bind_flags(
        parser,
        DEFAULT_HOST,
        DEFAULT_PORT,
        unset=True,
        prefix="HTTP: ",
        host_note="; anything but loopback needs a bearer token",
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
    add_setting_flags(parser, "database_url", *DATABASE_BOUND_SETTINGS, *SERVING_SETTINGS)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    http = args.transport == "http"
    if not http and (
        args.host is not None or args.port is not None or args.bearer_token_env is not None
    ):
        raise ConfigurationError("--host, --port and --bearer-token-env apply to --transport http")
    host = args.host or DEFAULT_HOST
    port = DEFAULT_PORT if args.port is None else args.port
    check_port(port)
    # Checked before anything is loaded or bound: an open door must never start serving.
    credentials = bearer_credentials(args.bearer_token_env) if http else ()
    if http:
        check_exposure(host, credentials)
    registry = registry_from(settings, required=True)
    with needs_extra("outbox mcp", "mcp", "the MCP SDK"):
        from outbox.mcp import server as mcp_server
        from outbox.mcp import transports
    server = mcp_server.build_server(
        registry,
        settings,
        ServerOptions(run_id=args.run_id, wait=args.wait, require_key=args.require_key),
    )
    if http:
        limits = Limits.from_settings(settings, max_body=transports.MAX_BODY)
        run_async(
            transports.serve_http(
                server, host=host, port=port, credentials=credentials, limits=limits
            )
        )
    else:
        run_async(transports.serve_stdio(server))
    return 0

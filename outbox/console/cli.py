"""``outbox console``: the subcommand. Imports nothing of the web stack until it runs, so
without the ``console`` extra every other command keeps working and this one says what
to install."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import psycopg

from outbox import store
from outbox.cli import add_setting_flags, add_tools_flag
from outbox.connections import command_transaction
from outbox.console.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    LOOPBACK_HOSTS,
    OPERATORS_ENV,
    PROXY_HEADER_ENV,
    TRUSTED_PROXIES_ENV,
    AuthConfig,
    auth_from_environment,
    is_loopback,
    served_hosts,
)
from outbox.contracts import Registry
from outbox.errors import ConfigurationError
from outbox.loading import registry_from
from outbox.logs import log_fields
from outbox.serving import SERVING_SETTINGS, Limits, add_bind_flags, check_port, needs_extra
from outbox.settings import Settings, redact_url
from outbox.store import Store

logger = logging.getLogger(__name__)


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "console",
        help="the operator console: a web UI for operations, escalations, approvals, dead letters",
        description="Serve the operator console: an overview, operations with their "
        "timelines and contract cards, escalations to resolve, approvals to grant or deny, "
        "and dead letters to requeue, with the same guards as `outbox ops`. Connect as a "
        "login that is a member of outbox_operator. Operators authenticate with a token "
        f"from {OPERATORS_ENV} (name:token[,name:token...]) or through a reverse proxy "
        f"named by {PROXY_HEADER_ENV} and {TRUSTED_PROXIES_ENV}; credentials are read from "
        "the environment only. Needs the console extra (pip install 'effect-outbox[console]').",
    )
    add_bind_flags(parser, DEFAULT_HOST, DEFAULT_PORT)
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --host that is not loopback (put TLS in front: tokens and session "
        "cookies cross the network)",
    )
    parser.add_argument(
        "--secure-cookie",
        action="store_true",
        help="mark the session cookie Secure (on by default with --allow-remote)",
    )
    add_tools_flag(
        parser,
        used_for="the operation pages show their contract cards, and they say whether a "
        "retry is allowed",
    )
    add_setting_flags(
        parser,
        "database_url",
        "amqp_url",
        "exchange",
        "dead_letter_queue",
        *SERVING_SETTINGS,
    )
    parser.set_defaults(handler=run)


def check_bind(host: str, allow_remote: bool) -> None:
    if not is_loopback(host) and not allow_remote:
        raise ConfigurationError(
            f"--host {host} is not a loopback address: the console settles escalations and "
            "grants approvals, so it serves beyond this machine only with --allow-remote "
            "(and TLS in front of it)"
        )


def check_login(settings: Settings) -> store.ConsoleLogin:
    """Refuse a database login that is not an operator: the console must not be able to
    do more than `outbox ops` can."""
    try:
        with command_transaction(settings) as connection:
            login = Store(connection).run(store.console_login())
    except psycopg.Error as error:
        raise ConfigurationError(
            f"could not ask {redact_url(settings.libpq_url)} who the console's login is "
            f"(SQLSTATE {error.sqlstate or 'unknown'})"
        ) from None
    if not login.operator:
        raise ConfigurationError(
            f"database login {login.login!r} is not a member of outbox_operator: run "
            "`outbox migrate --roles`, then GRANT outbox_operator TO the console's login"
        )
    return login


def tools(settings: Settings) -> Registry | None:
    return registry_from(settings, required=False)


def warn_of_a_local_proxy(auth: AuthConfig) -> None:
    """Say loudly, in the log and in the startup output, when a trusted proxy address is
    this machine's loopback: the identity header is then as good as any local process's
    word. Allowed, since a proxy on the same host is common, but never silently."""
    local = auth.proxy.local_networks() if auth.proxy else ()
    if not local or auth.proxy is None:
        return
    networks = ", ".join(map(str, local))
    log_fields(
        logger,
        logging.WARNING,
        "console.local_proxy",
        "a trusted proxy address is local: any process on this machine can name itself any "
        "operator",
        networks=networks,
    )
    print(
        f"outbox console: WARNING: {TRUSTED_PROXIES_ENV} holds local addresses ({networks}): "
        "any process on this machine can name itself any operator by sending "
        f"{auth.proxy.header}. Trust a proxy on another host, or keep every other process "
        f"off this one, or log in with {OPERATORS_ENV} tokens instead",
        flush=True,
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    # Checked before anything is loaded or bound: an open door must never start serving.
    auth = auth_from_environment()
    check_bind(args.host, args.allow_remote)
    hosts = served_hosts(args.host, LOOPBACK_HOSTS)
    check_port(args.port)
    registry = tools(settings)
    with needs_extra("outbox console", "console"):
        from outbox.console.app import MAX_BODY_BYTES, Console, create_app
        from outbox.console.server import ConsoleServer
    login = check_login(settings)
    console = Console(
        settings=settings,
        auth=auth,
        registry=registry,
        secure_cookie=args.secure_cookie or args.allow_remote,
        allowed_hosts=hosts,
    )
    server = ConsoleServer(
        create_app(console),
        host=args.host,
        port=args.port,
        limits=Limits.from_settings(settings, max_body=MAX_BODY_BYTES),
    )
    warn_of_a_local_proxy(auth)
    superuser = (
        " (a superuser: give it a login that is only an operator)" if login.superuser else ""
    )
    print(
        f"outbox console: serving on {server.url} as database login {login.login}{superuser}",
        flush=True,
    )
    server.serve()
    return 0

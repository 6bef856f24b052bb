"""How an ``outbox`` command runs: its event loop, its settings and logging, its JSON
output, and how its errors become one line on stderr and an exit code.

A leaf: it imports no command group, so the operator layer and every other front end can
import it without loading the ``outbox`` command (:mod:`outbox.cli`), which imports them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import psycopg

from outbox.cli.arguments import settings_from
from outbox.errors import (
    ConfigurationError,
    InputRefused,
    MalformedOperationId,
    OutboxError,
    connect_failure,
)
from outbox.logs import configure_logging
from outbox.settings import Settings
from outbox.text import printable

Command = Callable[[argparse.Namespace, Settings], int]
T = TypeVar("T")

EXIT_OK = 0
# Anything the runtime refused or could not do (a database error, a broker that said no).
EXIT_FAILED = 1
# The settings or flags are wrong: nothing was tried. argparse exits 2 for a bad flag too.
EXIT_CONFIGURATION = 2
# What a shell reports for a process killed by SIGPIPE (128 + 13), as for coreutils in
# `cat big | head`. Not 0: the output was cut short, and a `set -o pipefail` script
# should see that as it does for any other command.
EXIT_BROKEN_PIPE = 141


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a daemon's coroutine on uvloop where it is installed (it measured 25-58%
    faster here, docs/design.md section 14), else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def print_json(document: object) -> None:
    """A command's ``--json`` output: one indented document, as every command prints it."""
    print(json.dumps(document, indent=2))


def run_parsed(args: argparse.Namespace, name: str) -> int:
    """Run ``args.handler`` as ``outbox`` does (:func:`outbox.cli.run_command`); ``name``
    heads error messages. Shared with commands that are not in the wheel (``python -m
    harness.chaos``), so they load settings and fail the same way."""
    try:
        settings = settings_from(args)
        configure_logging(settings.log_level, settings.log_format)
        handler: Command = args.handler
        code = handler(args, settings)
        # Flushed here rather than at exit, so that a reader gone away is met below.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _reader_gone()
    except InputRefused as error:
        # The sentence the console shows for the same value, as a usage error.
        _report(name, f"refused: {error}; nothing was changed")
        return EXIT_CONFIGURATION
    except MalformedOperationId as error:
        # A usage error, as argparse's own: the text given cannot name any operation.
        _report(name, f"error: {error}")
        return EXIT_CONFIGURATION
    except ConfigurationError as error:
        _report(name, f"configuration error: {error}")
        return EXIT_CONFIGURATION
    except OutboxError as error:
        _report(name, f"error: {error}")
        return EXIT_FAILED
    except psycopg.Error as error:
        # A driver error no command translated: its text can quote the connection string.
        sqlstate = f"SQLSTATE {error.sqlstate}, " if error.sqlstate else ""
        _report(name, f"error: database error ({sqlstate}{connect_failure(error)})")
        return EXIT_FAILED


def _report(name: str, message: str) -> None:
    # One line, and nothing a terminal would act on: messages can carry names and ids
    # someone else chose.
    print(f"{name}: {printable(message)}", file=sys.stderr)


def _reader_gone() -> int:
    """The reader of stdout (``| head``) went away: stop quietly, as Python's docs on
    SIGPIPE advise. Python ignores SIGPIPE, so the write raised instead of killing us;
    stdout goes to /dev/null so that the flush at exit cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE

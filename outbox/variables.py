"""The OUTBOX_* environment variables that are not settings, and who reads each: a name in
the prefix that nobody reads is refused (outbox.settings.check_variables)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from datetime import timedelta

from pydantic import JsonValue, SecretStr, TypeAdapter

# Every OUTBOX_* variable something in this project reads besides the settings (outbox/settings.py),
# and who reads it. The prefix is ours: a name in it that nobody reads is a typo, and a
# typo leaves the default in force while the operator believes otherwise, so every
# command refuses it (check_variables). tests/unit/test_settings_refusals.py fails when
# the repository names one that is not listed here.
OTHER_VARIABLES: Mapping[str, str] = {
    "OUTBOX_FINGERPRINT_KEY": "the key of the short fingerprints (outbox.fingerprint_key)",
    "OUTBOX_MCP_TOKENS": "outbox mcp over HTTP: its callers, name:token[,name:token...]",
    "OUTBOX_CONSOLE_OPERATORS": "outbox console: its operators, name:token[,name:token...]",
    "OUTBOX_CONSOLE_PROXY_HEADER": "outbox console: the trusted proxy's identity header",
    "OUTBOX_CONSOLE_TRUSTED_PROXIES": "outbox console: the trusted proxy's addresses",
    "OUTBOX_CONSOLE_HOSTS": "outbox console: the host names it answers to",
    "OUTBOX_CALLBACK_SECRETS": "provider callbacks: the secrets, provider:secret[,...]",
    "OUTBOX_CALLBACK_SECRETS_FILE": "provider callbacks: a file of provider:secret lines",
    "OUTBOX_SANDBOX_URL": "the payment sandbox's example tools: where the sandbox listens",
    "OUTBOX_SANDBOX_REFUND_DEADLINE": "the payment sandbox's example tools: the refund deadline",
    "OUTBOX_SANDBOX_CALLBACK_WAIT": "the payment sandbox's example tools: the email callback wait",
    "OUTBOX_SANDBOX_OUTAGE_TOLERANCE": "the payment sandbox's example tools: how long a refund "
    "waits for the sandbox before a person is asked",
    "OUTBOX_TEST_DATABASE_URL": "the test suite: the Postgres server to test against",
    "OUTBOX_TEST_AMQP_URL": "the test suite: the RabbitMQ to test against",
    "OUTBOX_TEST_REQUIRE_RABBITMQCTL": "the test suite (.ci/run): broker-fault tests must run",
    "OUTBOX_TEST_PROVIDER_OUTAGE_SECONDS": "the test suite: how long the acceptance test's "
    "provider outage lasts (60)",
    "OUTBOX_TEST_MCP_TOKEN": "the test suite: the bearer token of `outbox mcp` under test",
    "OUTBOX_CONSOLE_SCREENSHOTS": "the browser tests: where to write the console screenshots",
    "OUTBOX_BENCH_DATABASE_URL": "bench/: the Postgres server to measure against",
    "OUTBOX_BENCH_AMQP_URL": "bench/: the RabbitMQ to measure against",
}


def unknown_variable(name: str, known: frozenset[str], prefix: str) -> str:
    """Why ``name`` (in ``prefix``, read by nothing) is refused, naming the known variable
    nearest to it when one is near."""
    # Compared without the prefix, which every candidate shares and which would make
    # any two names look alike.
    suffixes = {variable.removeprefix(prefix): variable for variable in known}
    nearest = difflib.get_close_matches(name.upper().removeprefix(prefix), suffixes, n=1)
    if nearest:
        return f"{name} is not a setting; did you mean {suffixes[nearest[0]]}?"
    return (
        f"{name} is not a setting of effect-outbox, which reads every {prefix}* variable: "
        "correct its name (docs/operating.md lists them), or give a variable of your own "
        "another prefix"
    )


TIMEDELTA_FORM: TypeAdapter[timedelta] = TypeAdapter(timedelta)


def environment_value(value: object) -> str:
    """A setting's value as the text of its ``OUTBOX_*`` variable (secrets revealed)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):  # before int: a bool is one
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same float
    if isinstance(value, timedelta):
        # ISO 8601 is exact to the microsecond; seconds as a float would not be.
        return str(TIMEDELTA_FORM.dump_python(value, mode="json"))
    if isinstance(value, int | str):
        return str(value)
    # A new field of another type must say here how its variable is written.
    raise TypeError(f"no environment form for a {type(value).__name__} setting")


# A setting's groups live on its field (json_schema_extra, read by settings_in), so a new
# setting joins them where it is declared, not in lists kept apart from it:
#   broker          where the broker's topology is: every command that talks to it offers them
#   database_bound  a bound of a daemon's database session (outbox.connections)
#   duration        a length of time, in seconds or as a timedelta: refused below MIN_SECONDS
#                   (tests/unit/test_settings_refusals.py checks that none is missing)
#   lease_bounded   the server-side bounds and the client's transaction deadline: each must
#                   end before the lease does (docs/design.md section 9), or a session whose
#                   client went silent could still hold an operation's row when the
#                   reconciler comes to take it over
#   serving         a bound of the front doors (outbox.serving): every command that serves
#                   HTTP offers them
SETTING_GROUPS = ("broker", "database_bound", "duration", "lease_bounded", "serving")


def in_groups(*groups: str) -> dict[str, JsonValue]:
    """A setting's ``json_schema_extra``: the groups it is in."""
    assert set(groups) <= set(SETTING_GROUPS), groups
    return {"groups": list(groups)}


ENV_PREFIX = "OUTBOX_"


def setting_variable(name: str) -> str:
    """The environment variable of the setting (field) ``name``."""
    return f"{ENV_PREFIX}{name.upper()}"

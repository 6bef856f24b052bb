"""rabbitmqctl as the chaos run uses it: on the shared broker, or aimed at the run's own
node; and a start_app that tries again, so that a run never leaves a broker stopped."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from harness.rabbit_node import ClusterError, Node, RabbitCluster
from harness.report import say

START_APP_TRIES = 3
# rabbitmqctl: a command's arguments in, its output out (None, with a line, if it failed).
BrokerControl = Callable[..., "str | None"]


def start_app(control: BrokerControl) -> None:
    # A CLI call is an Erlang VM of its own, which a starved machine may not boot
    # within its timeout: a broker left stopped would fail the run for the harness's
    # sake, so try again before giving up.
    for _ in range(START_APP_TRIES):
        if control("start_app") is not None:
            return
    raise RuntimeError("rabbitmqctl start_app failed; start the broker by hand")


def shared_broker_control(executable: str) -> BrokerControl:
    """rabbitmqctl on PATH, acting on the broker it finds by default: the shared one."""

    def control(*args: str) -> str | None:
        return _rabbitmqctl(executable, *args)

    return control


def private_broker_control(cluster: RabbitCluster, node: Node) -> BrokerControl:
    """rabbitmqctl aimed at the run's own node (by name, with the node's own cookie): a
    mistake here cannot reach the shared broker, whose cookie differs."""

    def control(*args: str) -> str | None:
        try:
            return cluster.ctl(node, *args)
        except ClusterError as failure:
            first_line = (str(failure).strip().splitlines() or [""])[0]
            say(f"  (rabbitmqctl {args[0]} failed: {first_line[:200]})")
            return None

    return control


def _rabbitmqctl(executable: str, *args: str) -> str | None:
    """What the command printed; None (and a line saying why) if it failed."""
    # The executable is the one found on PATH; the arguments are this module's own.
    result = subprocess.run(  # noqa: S603
        [executable, *args], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        first_line = (result.stderr.strip().splitlines() or [""])[0]
        say(f"  (rabbitmqctl {args[0]} failed: {first_line[:200]})")
        return None
    return result.stdout

"""``outbox consumer --processes N``: one host's cores for one consumer deployment.

A consumer is one Python process, so it uses one core however many the host has. With
``--processes N`` the command starts N consumer processes (each a complete consumer with
its own connections, prefetch and reconciler: the claim's fencing keeps them apart as it
keeps apart consumers on different hosts) and supervises them:

- each child serves its metrics on the given port plus its index (port 0 stays 0);
- the first SIGTERM or SIGINT is passed on to every child, which finishes the effects
  in its hands; a second one is passed on too, and the children exit at once;
- a child that exits on its own ends the group: the others are stopped gracefully and
  the command exits with status 1, so that whatever restarts the service restarts it
  whole, rather than running on with fewer processes than it was given.

The children run in a process group of their own, so a terminal's Ctrl-C reaches them
once (from the supervisor), not twice (a second signal would drop the work in hand), and
on Linux each child is sent SIGTERM if the supervisor itself dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from types import FrameType

from outbox.logs import log_fields
from outbox.settings import Settings

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_STOPPED = {0, -signal.SIGTERM, -signal.SIGINT}


def child_command(index: int, metrics_port: int) -> list[str]:
    """The command of child ``index``: a plain consumer serving metrics on its own port.
    Everything else it is told through its environment (:func:`child_environment`)."""
    port = metrics_port + index if metrics_port else 0
    return [sys.executable, "-m", "consumer", "--metrics-port", str(port)]


def child_environment(settings: Settings) -> dict[str, str]:
    """This process's environment with every setting as resolved here (flags included),
    so that each child reads back exactly the settings the supervisor was given."""
    return {**os.environ, **settings.to_environment()}


def _death_signal() -> Callable[[], None] | None:
    """What a child runs before its program (Linux): be sent SIGTERM when the supervisor
    dies. Looked up here, in the parent: between fork and exec only the call is safe."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # libc's, in the process's namespace

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return set_death_signal


def supervise(settings: Settings, processes: int, metrics_port: int) -> int:
    """Run ``processes`` consumers until they are stopped; the command's exit status."""
    environment = child_environment(settings)
    death_signal = _death_signal()
    children = [
        subprocess.Popen(  # noqa: S603  (this interpreter running this package)
            child_command(index, metrics_port),
            env=environment,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=death_signal,
        )
        for index in range(processes)
    ]
    log_fields(
        logger,
        logging.INFO,
        "consumer.supervisor_started",
        "consumer processes started",
        processes=processes,
        pids=",".join(str(child.pid) for child in children),
    )
    # Children not yet reaped, by pid: only the loop below reaps them (os.wait), so a
    # pid found here is never one the kernel has handed to another process.
    running = {child.pid: child for child in children}
    stopping = False

    def pass_on(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(running):
            os.kill(pid, signum)

    previous = {
        signum: signal.signal(signum, pass_on) for signum in (signal.SIGTERM, signal.SIGINT)
    }
    failed = False
    try:
        while running:
            pid, status = os.wait()
            child = running.pop(pid, None)
            if child is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            child.returncode = code
            # A child the stop reached before it had set up its own handling ends by
            # the signal itself: that too is the stop asked for.
            if stopping and code in _STOPPED:
                continue
            failed = True
            log_fields(
                logger,
                logging.ERROR,
                "consumer.process_exited",
                "a consumer process exited; stopping the others",
                pid=pid,
                status=code,
            )
            if not stopping:
                stopping = True
                for other in list(running):
                    os.kill(other, signal.SIGTERM)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    log_fields(
        logger,
        logging.INFO,
        "consumer.supervisor_stopped",
        "consumer processes stopped",
        failed=failed,
    )
    return 1 if failed else 0

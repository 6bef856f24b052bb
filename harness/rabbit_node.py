"""RabbitMQ nodes of our own on this machine, beside the main broker: a cluster for the
test that stops one of its nodes under the daemons, and one node for a chaos run whose
broker faults (connections closed, ``stop_app``) must reach no one else's broker.

Each node is ``rabbitmq-server`` in the foreground as a child of the test (its own
process group, its output in a file), with its own name, AMQP and distribution ports,
data, log and configuration under one temporary directory. Nothing is shared with the
main broker ``rabbit@localhost`` but the machine's epmd:

* ``RABBITMQ_CONF_ENV_FILE`` and ``RABBITMQ_CONFIG_FILE`` point at files of ours, so
  ``/etc/rabbitmq`` (which names the main node and binds port 5672) is never read;
* the enabled-plugins file is empty: no management listener to clash on 15672;
* ``HOME`` is the temporary directory, so the nodes and every ``rabbitmqctl`` call
  share an Erlang cookie of their own. A mistyped node name can then never reach the
  main broker: its cookie differs, and it refuses the CLI.

Foreground children rather than ``rabbitmq-server -detached``: a detached start returns
at once, before the node has even registered with epmd, and (tried here with 3.10) left
no pid file to find it by. As children, the test holds each node's pid from the start,
sees at once when one dies during its boot, and can kill it like a crash would.

On Debian the ``/usr/sbin`` commands are wrappers that switch to the ``rabbitmq`` user
(and its cookie) when run as root; the scripts they wrap are used directly.

It lives in ``harness`` (never in the wheel) so that ``python -m harness.chaos`` and the
tests (``tests/support/rabbit_cluster.py``) start nodes the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Where Debian keeps the real scripts behind its /usr/sbin wrappers.
DEBIAN_SCRIPTS = Path("/usr/lib/rabbitmq/bin")
# One node boots in 5-15 s on two cores; the cluster is the first, then two at once.
BOOT_SECONDS = 90.0
# A rabbitmqctl call starts an Erlang VM of its own: about a second before it acts.
CTL_SECONDS = 60.0
STOP_SECONDS = 30.0
POLL_SECONDS = 0.1


class ClusterError(RuntimeError):
    """A node did not start, join or stop; the message carries the tail of its log."""


def script(name: str) -> str | None:
    """The path of a RabbitMQ command (the real script, not Debian's wrapper), or None
    when RabbitMQ is not installed."""
    direct = DEBIAN_SCRIPTS / name
    if direct.exists():
        return str(direct)
    return shutil.which(name)


def installed() -> bool:
    return all(script(name) for name in ("rabbitmq-server", "rabbitmqctl"))


def free_port() -> int:
    """A local port nothing listens on: bound once to find it free, then released."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@dataclass
class Node:
    name: str
    """The Erlang node name, ``outbox_ct1_<tag>@localhost``."""
    amqp_port: int
    dist_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``: how the daemons' log lines name a broker."""
        return f"127.0.0.1:{self.amqp_port}"

    @property
    def url(self) -> str:
        # guest may connect over loopback, which is the only interface the node uses.
        return f"amqp://guest:guest@{self.address}/"

    @property
    def log(self) -> Path:
        return self.directory / "output.log"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return "(no output)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class RabbitCluster:
    directory: Path
    nodes: list[Node] = field(default_factory=list)

    @property
    def amqp_url(self) -> str:
        """Every node's URL, comma-separated: ``OUTBOX_AMQP_URL`` for the cluster."""
        return ",".join(node.url for node in self.nodes)

    # --- life ---------------------------------------------------------------------------

    def start(self) -> None:
        """Boot the first node, then the others at once: each finds the first in its
        configuration (classic peer discovery) and joins it as it boots. That saves
        the six ``stop_app``, ``join_cluster``, ``start_app`` calls, a second or two
        each, that joining by hand takes."""
        first, *others = self.nodes
        deadline = time.monotonic() + BOOT_SECONDS
        self._launch(first)
        self._await_listening(first, deadline)
        for node in others:
            self._launch(node)
        for node in others:
            self._await_listening(node, deadline)
        if not others:
            # Listening for AMQP is the last step of a boot, and one node is a cluster
            # of one: no rabbitmqctl to ask. Its own Erlang VM took more than a minute
            # to answer beside a sweep's CPU hogs and aborted the sweep.
            return
        # Every node booted (listening for AMQP is the last step of a boot) and all
        # of them in the one cluster, as the first sees it.
        self.ctl(
            first, "await_online_nodes", str(len(self.nodes)), "--timeout", str(int(CTL_SECONDS))
        )
        running = self.running_nodes(first)
        if sorted(running) != sorted(node.name for node in self.nodes):
            raise ClusterError(f"the cluster formed with {running} only")

    def kill(self, node: Node) -> None:
        """End a node as a crash would: SIGKILL to its VM, no goodbye to its clients or
        its peers."""
        if node.process is None or not node.running():
            return
        # The VM is the script's child: killed alone, it is reaped by the script, which
        # then exits. Killing the script as well would leave the VM's remains to init,
        # which reaps them seconds later.
        for vm in _children(node.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm, signal.SIGKILL)
        try:
            node.process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(STOP_SECONDS)

    def stop(self, node: Node) -> None:
        """Stop a node as an operator would (``rabbitmqctl stop``): it closes its client
        connections and leaves the cluster's quorum queues to their other members."""
        self.ctl(node, "stop")
        if node.process is not None:
            node.process.wait(STOP_SECONDS)

    def remove(self) -> None:
        """Kill every node that still runs and delete every file: nothing is kept, so
        nothing needs a graceful stop."""
        for node in self.nodes:
            if node.running():
                self.kill(node)
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- questions ----------------------------------------------------------------------

    def ctl(self, node: Node, *args: str, command: str = "rabbitmqctl") -> str:
        """Run ``command -n <node> args`` and return its output; :class:`ClusterError`
        (with the node's log tail) when it fails."""
        path = script(command)
        if path is None:
            raise ClusterError(f"{command} is not installed")
        try:
            # RabbitMQ's own script; the arguments are this module's callers' own.
            done = subprocess.run(  # noqa: S603
                [path, "-n", node.name, *args],
                env=self._environment(),
                capture_output=True,
                text=True,
                timeout=CTL_SECONDS,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{command} {' '.join(args)} on {node.name} hung") from None
        if done.returncode != 0:
            raise ClusterError(
                f"{command} {' '.join(args)} on {node.name} failed ({done.returncode}): "
                f"{done.stdout.strip()} {done.stderr.strip()}\n-- its log:\n{node.tail()}"
            )
        return done.stdout

    def running_nodes(self, asked: Node) -> list[str]:
        status = json.loads(self.ctl(asked, "cluster_status", "--formatter", "json"))
        return [str(name) for name in status.get("running_nodes", [])]

    def queue(self, asked: Node, name: str) -> dict[str, Any]:
        """One queue's ``leader`` and ``members`` (node names), as ``asked`` sees them."""
        listed = json.loads(
            self.ctl(
                asked, "list_queues", "name", "type", "leader", "members", "--formatter", "json"
            )
        )
        found = [queue for queue in listed if queue.get("name") == name]
        if not found:
            raise ClusterError(f"{asked.name} has no queue {name!r}")
        return dict(found[0])

    # --- the parts ----------------------------------------------------------------------

    def _environment(self, node: Node | None = None) -> dict[str, str]:
        """A clean environment: inherited RABBITMQ_* or ERL_* variables (a developer's,
        the main broker's) must not redirect a node or a CLI call."""
        environment = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/bin"),
            # The Erlang cookie is $HOME/.erlang.cookie: ours, not the main broker's.
            "HOME": str(self.directory),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_CONF_ENV_FILE": str(self.directory / "rabbitmq-env.conf"),
        }
        if node is None:
            return environment
        return environment | {
            "RABBITMQ_NODENAME": node.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(node.amqp_port),
            # Pinned: the default (AMQP port + 20000) may be taken.
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.directory / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(node.directory / "mnesia"),
            "RABBITMQ_MNESIA_DIR": str(node.directory / "mnesia" / node.name),
            "RABBITMQ_LOG_BASE": str(node.directory / "log"),
            "RABBITMQ_PID_FILE": str(node.directory / "pid"),
            # Distribution on loopback only, as the main broker's.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def _launch(self, node: Node) -> None:
        path = script("rabbitmq-server")
        if path is None:
            raise ClusterError("rabbitmq-server is not installed")
        node.directory.mkdir(parents=True, exist_ok=True)
        with node.log.open("wb") as output:
            # RabbitMQ's own script, with no arguments.
            node.process = subprocess.Popen(  # noqa: S603
                [path],
                env=self._environment(node),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=node.directory,
                # Its own process group: the script, the VM and its helpers die together.
                start_new_session=True,
            )

    def _await_listening(self, node: Node, deadline: float) -> None:
        """Until the node listens for AMQP; fails at once if it exits."""
        while not accepts(node.amqp_port):
            if not node.running():
                raise ClusterError(f"{node.name} exited while booting:\n{node.tail()}")
            if time.monotonic() >= deadline:
                raise ClusterError(f"{node.name} did not boot in time:\n{node.tail()}")
            time.sleep(POLL_SECONDS)


def _children(pid: int) -> list[int]:
    try:
        listed = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in listed.split()]


def _prepare(directory: Path, seed: Node) -> None:
    cookie = directory / ".erlang.cookie"
    cookie.write_text(secrets.token_hex(16).upper())
    cookie.chmod(0o400)  # Erlang refuses a cookie others can read
    (directory / "rabbitmq-env.conf").write_text("")
    (directory / "enabled_plugins").write_text("[].\n")
    (directory / "rabbitmq.conf").write_text(
        # Every node looks for the first as it boots and joins its cluster; the first
        # finds only itself and starts the cluster.
        "cluster_formation.peer_discovery_backend = classic_config\n"
        f"cluster_formation.classic_config.nodes.1 = {seed.name}\n"
        # A quorum queue's leader goes to the node its declaration came through: the
        # test declares through the first node, so the node it stops holds the leader
        # as well as both daemons' connections.
        "queue_leader_locator = client-local\n"
    )


@contextlib.contextmanager
def rabbit_cluster(size: int = 3, *, prefix: str = "outbox_ct") -> Iterator[RabbitCluster]:
    """``size`` nodes clustered together, killed and deleted when the block ends (however
    it ends, a failed start included)."""
    directory = Path(tempfile.mkdtemp(prefix=f"outbox-rabbit-{prefix}-"))
    tag = secrets.token_hex(2)  # a leftover or a concurrent run keeps its own names
    ports = _distinct_ports(2 * size)
    cluster = RabbitCluster(
        directory=directory,
        nodes=[
            Node(
                name=f"{prefix}{number}_{tag}@localhost",
                amqp_port=ports[2 * (number - 1)],
                dist_port=ports[2 * (number - 1) + 1],
                directory=directory / f"node{number}",
            )
            for number in range(1, size + 1)
        ],
    )
    try:
        _prepare(directory, cluster.nodes[0])
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


def _distinct_ports(count: int) -> Sequence[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@contextlib.contextmanager
def private_broker(*, prefix: str = "outbox_chaos") -> Iterator[tuple[RabbitCluster, Node]]:
    """One node of our own (free ports, its own cookie and data directory), killed and
    deleted when the block ends: a broker a run may stop and close connections on while
    other work uses the main one."""
    with rabbit_cluster(1, prefix=prefix) as cluster:
        yield cluster, cluster.nodes[0]

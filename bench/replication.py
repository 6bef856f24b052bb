"""The cost of a synchronous standby: bench/record_decision.py against a private primary
whose streaming standby is synchronous, then asynchronous, on this machine.

    .venv/bin/python -m bench.replication [--seconds 10] [--connections 1,8]

Each mode gets a fresh primary and standby (tests/support/pg_replication.py: initdb and
pg_basebackup -R of the installed major version, loopback ports, fsync off on both), and
one run of record_decision from sync threads per connection count. One connection gives
the latency of a commit (1 / tx/s); several give throughput. Both servers run on the same
two cores as the client, and with fsync off neither waits on a disk, so the difference
between the modes is the replication round trip on loopback alone: a standby in another
zone adds its network round trip to every commit. The load average before and after
is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.pg_replication import replicated_pair  # noqa: E402


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f}/{five:.2f} (1/5 min) on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", default="1,8", help="comma-separated counts")
    args = parser.parse_args()
    counts = [int(count) for count in args.connections.split(",") if count.strip()]
    for synchronous in (True, False):
        mode = "synchronous" if synchronous else "asynchronous"
        with replicated_pair(synchronous=synchronous) as pair:
            for connections in counts:
                before = load()
                done = subprocess.run(  # noqa: S603 - this interpreter, fixed arguments
                    [
                        sys.executable,
                        "-m",
                        "bench.record_decision",
                        "--database-url",
                        pair.primary.url("outbox_bench"),
                        "--seconds",
                        str(args.seconds),
                        "--runs",
                        "1",
                        "--connections",
                        str(connections),
                        "--modes",
                        "sync",
                    ],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                line = done.stdout.strip().splitlines()[-1]
                rate = float(line.rsplit("median ", 1)[1].split(" ")[0].replace(",", ""))
                latency = f"; {1000 * connections / rate:.2f} ms a commit" if rate else ""
                print(f"{mode} standby: {line}{latency} [{before}; after: {load()}]")


if __name__ == "__main__":
    main()

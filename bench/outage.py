"""What a provider outage costs, and what its recovery does to the provider.

    .venv/bin/python -m bench.outage [--decisions 300] [--outage-seconds 60]
        [--consumers 2] [--release-spread 5] [--kill-every 0]

The payment sandbox answers 503 to every call and every lookup (its ``unavailable``
fault) while ``--decisions`` refunds are decided at an even pace over the first fifth
of the outage; the dispatcher and ``--consumers`` consumers run as subprocesses of the
sandbox's tools, in a database and broker names of their own (removed at the end).
``--kill-every N`` kills a consumer every N seconds of the outage and starts another.
Then the provider comes back, and the run measures:

- how the decisions ended (committed, rejected, escalated: a sound run has only the
  first), the refunds per decision (one each), and the breaker's outage events;
- the requests the provider received in each second of the first minute after it came
  back (calls and lookups): the peak and the mean, to show that the waiting decisions
  are released over ``--release-spread`` instead of all at once;
- how long after its return the last decision settled.

Prints a summary; everything in ``bench/results/outage.json``. Exits 1 if a decision
ended anything but committed or a refund was made twice.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg

from bench.reporting import json_safe
from outbox import OperationState, record_decision, store
from outbox.cli import positive_int
from outbox.loading import load_registry
from outbox.sandbox.processes import DaemonProcess, python_module
from outbox.sandbox.provider import SandboxProvider
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.sandbox.tools import (
    OUTAGE_TOLERANCE_ENV,
    REFUND_DEADLINE_ENV,
    SANDBOX_PROVIDER,
    SANDBOX_URL_ENV,
)
from outbox.settings import Settings
from outbox.store import Store

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "outage.json"
TOOLS = "outbox.sandbox.tools"
SETTLE_WITHIN_SECONDS = 180.0
AFTER_RETURN_SECONDS = 60


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=positive_int, default=300)
    parser.add_argument("--outage-seconds", type=positive_int, default=60)
    parser.add_argument("--consumers", type=positive_int, default=2)
    parser.add_argument("--release-spread", type=float, default=5.0)
    parser.add_argument("--kill-every", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    return parser.parse_args(argv)


def environment(
    scratch: ScratchEnvironment, provider: SandboxProvider, spread: float
) -> dict[str, str]:
    settings = scratch.settings.model_copy(
        update={
            "tools": TOOLS,
            "metrics_host": "127.0.0.1",
            "metrics_port": 0,
            "log_level": "WARNING",
            "provider_release_spread": spread,
        }
    )
    return {
        **os.environ,
        **settings.to_environment(),
        SANDBOX_URL_ENV: provider.url,
        REFUND_DEADLINE_ENV: "2",
        # Longer than any outage measured here: a person must not be asked.
        OUTAGE_TOLERANCE_ENV: "3600",
    }


def states(database_url: str) -> Counter[str]:
    with psycopg.connect(database_url) as connection:
        rows = connection.execute("SELECT state, count(*) FROM operations GROUP BY state")
        return Counter({str(state): int(count) for state, count in rows})


def outage_events(database_url: str) -> list[dict[str, Any]]:
    with psycopg.connect(database_url) as connection:
        return [dict(row) for row in Store(connection).run(store.provider_events(SANDBOX_PROVIDER))]


def last_to_settle(database_url: str) -> list[str]:
    """The timeline of the decision that settled last: each event's name, seconds after
    the decision, and its reason or policy (what held it up, if anything did)."""
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            "SELECT id, created_at FROM operations ORDER BY updated_at DESC LIMIT 1"
        ).fetchone()
        if row is None:
            return []
        events = connection.execute(
            "SELECT name, created_at, attributes FROM operation_events "
            "WHERE operation_id = %s ORDER BY id",
            (row[0],),
        ).fetchall()
    return [
        f"{(at - row[1]).total_seconds():7.2f} {name} "
        + " ".join(
            f"{key}={attributes[key]}"
            for key in ("reason", "policy", "unavailable", "worker")
            if key in attributes
        )
        for name, at, attributes in events
    ]


def measure(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    registry = load_registry([TOOLS])
    with (
        SandboxProvider() as provider,
        ScratchEnvironment.unique(settings, "bench_outage") as scratch,
    ):
        env = environment(scratch, provider, args.release_spread)
        daemons = [DaemonProcess(python_module("dispatcher"), environment=env, capture=True)]
        consumers = [
            DaemonProcess(python_module("consumer"), environment=env, capture=True)
            for _ in range(args.consumers)
        ]
        kills = 0
        try:
            provider.set_faults(unavailable=True)
            began = time.monotonic()
            pace = args.outage_seconds / 5 / args.decisions
            with psycopg.connect(scratch.database_url) as connection:
                for n in range(args.decisions):
                    record_decision(
                        connection,
                        registry,
                        "send_refund",
                        {"payment_id": f"pay_{n}", "amount_cents": 1000 + n},
                        run_id="bench",
                        decision_key=f"d{n}",
                    )
                    connection.commit()
                    time.sleep(max(0.0, began + (n + 1) * pace - time.monotonic()))
            next_kill = began + args.kill_every if args.kill_every else float("inf")
            while time.monotonic() < began + args.outage_seconds:
                if time.monotonic() >= next_kill:
                    consumers.pop(0).kill()
                    consumers.append(
                        DaemonProcess(python_module("consumer"), environment=env, capture=True)
                    )
                    kills += 1
                    next_kill += args.kill_every
                time.sleep(0.2)  # the outage being measured
            during = states(scratch.database_url)
            provider.set_faults(unavailable=False)
            back = time.monotonic()
            while True:
                ended = states(scratch.database_url)
                settled = sum(ended[s] for s in ("committed", "rejected", "escalated"))
                if settled == args.decisions or time.monotonic() - back > SETTLE_WITHIN_SECONDS:
                    break
                time.sleep(0.2)  # polling for the end, bounded above
            settled_after = time.monotonic() - back
            # The first minute after the return, whole, for the rate.
            time.sleep(max(0.0, back + AFTER_RETURN_SECONDS - time.monotonic()))
            requests = provider.requests()
            refunds = provider.ledger()["refunds_by_key"]
            events = outage_events(scratch.database_url)
            slowest = last_to_settle(scratch.database_url)
        finally:
            for daemon in daemons + consumers:
                daemon.stop()
    per_second = Counter(
        int(entry["monotonic"] - back)
        for entry in requests
        if 0 <= entry["monotonic"] - back < AFTER_RETURN_SECONDS
    )
    seconds = [per_second.get(second, 0) for second in range(AFTER_RETURN_SECONDS)]
    during_outage = [entry for entry in requests if entry["monotonic"] < back]
    return {
        "decisions": args.decisions,
        "outage_seconds": args.outage_seconds,
        "consumers": args.consumers,
        "consumer_kills": kills,
        "release_spread_seconds": args.release_spread,
        "states_during_outage": dict(during),
        "states_at_end": dict(ended),
        "settled_after_return_seconds": round(settled_after, 2),
        "refunds_per_decision": dict(Counter(refunds.values())),
        "requests_during_outage": len(during_outage),
        "requests_per_second_after_return": seconds,
        "peak_requests_per_second_after_return": max(seconds),
        "mean_requests_per_second_first_10s": round(sum(seconds[:10]) / 10, 1),
        "outage_events": [event["name"] for event in reversed(events)],
        "last_to_settle": slowest,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    result = measure(args, Settings())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(json_safe(result), indent=2) + "\n", encoding="utf-8")
    for key, value in result.items():
        if key not in ("requests_per_second_after_return", "last_to_settle"):
            print(f"{key}: {value}")
    print("the decision that settled last:", *result["last_to_settle"], sep="\n  ")
    print("requests per second after the return:", result["requests_per_second_after_return"])
    ended = result["states_at_end"]
    sound = ended.get(str(OperationState.COMMITTED), 0) == args.decisions and set(
        result["refunds_per_decision"]
    ) == {1}
    return 0 if sound else 1


if __name__ == "__main__":
    sys.exit(main())

"""Debian's Prometheus for the tests: promtool, and a server of our own on a free
loopback port with a config and data directory in a temporary directory (never the
system service). `.ci/run` installs the package where it is missing."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from support.ports import closed_port
from support.waiting import eventually_sync

PROMETHEUS = Path(shutil.which("prometheus") or "/usr/bin/prometheus")
PROMTOOL = Path(shutil.which("promtool") or "/usr/bin/promtool")
INSTALL_HINT = "apt-get install --no-install-recommends prometheus"


def installed() -> bool:
    return PROMETHEUS.exists() and PROMTOOL.exists()


def run_promtool(
    *args: str, cwd: Path, given: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``promtool args``, with ``given`` on its standard input."""
    return subprocess.run(
        [str(PROMTOOL), *args],
        cwd=cwd,
        input=given,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def promtool_version() -> tuple[int, int, int]:
    """``promtool, version 2.42.0+ds (...)`` -> (2, 42, 0)."""
    result = subprocess.run(
        [str(PROMTOOL), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    match = re.search(r"version (\d+)\.(\d+)\.(\d+)", result.stdout + result.stderr)
    assert match, result.stdout + result.stderr
    return int(match[1]), int(match[2]), int(match[3])


@dataclass
class Prometheus:
    """A running server: its HTTP API."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def api(self, path: str, **parameters: str) -> Any:
        query = urllib.parse.urlencode(parameters)
        address = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(address, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        assert body["status"] == "success", f"{path} {parameters}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now: the result's series, each ``{"metric", "value"}``."""
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing), each with its labels and state."""
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def targets_up(self) -> dict[str, str]:
        """Scrape job -> health of its (one) target: "up", "down" or "unknown"."""
        return {
            target["labels"]["job"]: target["health"]
            for target in self.api("targets")["activeTargets"]
        }


@contextlib.contextmanager
def running_prometheus(
    directory: Path,
    targets: Mapping[str, Sequence[str]],
    rule_files: Sequence[Path],
    *,
    interval: str = "1s",
) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (job -> host:port) and evaluating ``rule_files``
    every ``interval``, until the block ends."""
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(addresses)}]}
            for job, addresses in targets.items()
        ],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = closed_port()
    log = directory / "prometheus.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = Prometheus(f"http://127.0.0.1:{port}", process, log)
    try:
        eventually_sync(lambda: _ready(server), within=30, what="Prometheus /-/ready")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _ready(server: Prometheus) -> bool:
    if server.process.poll() is not None:
        raise AssertionError(f"Prometheus exited: {server.log.read_text()[-2000:]}")
    try:
        with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:  # not listening yet
        return False

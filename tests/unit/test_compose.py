"""compose.yaml and the Prometheus files against the code: no Docker engine runs on CI,
so a command, port or scrape target that drifted from the CLI would only show up on a
user's machine."""

from __future__ import annotations

import argparse
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from outbox.cli import build_parser

from support import promql

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
OUR_SERVICES = {name: spec for name, spec in SERVICES.items() if spec.get("build") == "."}
DAEMONS = {name: spec for name, spec in OUR_SERVICES.items() if "--metrics-port" in spec["command"]}
DEPENDENCY_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def subcommands() -> set[str]:
    parser = build_parser()
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(action.choices)


def metrics_port(service: str) -> int:
    command: list[str] = DAEMONS[service]["command"]
    return int(command[command.index("--metrics-port") + 1])


def container_port(mapping: str) -> int:
    # "host:container" or "container", optionally with "/tcp".
    return int(mapping.split(":")[-1].split("/")[0])


def prometheus_mounts() -> dict[PurePosixPath, Path]:
    """Container directory -> directory in the repository, for the prometheus service."""
    mounts = {}
    for volume in SERVICES["prometheus"]["volumes"]:
        source, target, *_ = volume.split(":")
        mounts[PurePosixPath(target)] = ROOT / source
    return mounts


def in_repository(container_path: str) -> Path:
    path = PurePosixPath(container_path)
    for target, source in prometheus_mounts().items():
        if path.is_relative_to(target):
            return source / path.relative_to(target)
    raise AssertionError(f"{container_path} is not under a volume of the prometheus service")


def config_file() -> Path:
    [flag] = [a for a in SERVICES["prometheus"]["command"] if a.startswith("--config.file=")]
    return in_repository(flag.split("=", 1)[1])


def prometheus_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(config_file().read_text())
    return config


def test_our_services_and_daemons_are_found() -> None:
    # Guards the filters below: an empty selection would make every check pass.
    assert set(OUR_SERVICES) == {"migrate", "dispatcher", "provider", "consumer"}
    assert set(DAEMONS) == {"dispatcher", "consumer"}


@pytest.mark.parametrize("service", sorted(OUR_SERVICES))
def test_every_command_is_an_outbox_subcommand_that_parses(service: str) -> None:
    command: list[str] = OUR_SERVICES[service]["command"]
    assert command[0] in subcommands()
    build_parser().parse_args(command)  # exits (SystemExit) on an unknown flag


@pytest.mark.parametrize("service", sorted(DAEMONS))
def test_a_daemon_exposes_and_health_checks_its_metrics_port(service: str) -> None:
    port = metrics_port(service)
    assert [container_port(p) for p in DAEMONS[service]["ports"]] == [port]
    assert f"127.0.0.1:{port}/healthz" in " ".join(DAEMONS[service]["healthcheck"]["test"])


def test_the_provider_exposes_the_port_it_listens_on() -> None:
    command: list[str] = SERVICES["provider"]["command"]
    port = int(command[command.index("--port") + 1])
    assert [container_port(p) for p in SERVICES["provider"]["ports"]] == [port]


def test_prometheus_scrapes_each_daemon_on_its_metrics_port() -> None:
    targets = [
        target
        for job in prometheus_config()["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    scraped = set()
    for target in targets:
        host, port = target.split(":")
        assert host in DAEMONS, f"{target} names no outbox daemon of compose.yaml"
        assert int(port) == metrics_port(host)
        scraped.add(host)
    assert scraped == set(DAEMONS)


def test_the_alert_rules_are_loaded_and_well_formed() -> None:
    # Prometheus reads a relative rule file next to its config.
    rule_files = [config_file().parent / path for path in prometheus_config()["rule_files"]]
    assert rule_files == [ROOT / "deploy" / "prometheus" / "alerts.yml"]
    groups = yaml.safe_load(rule_files[0].read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert rules
    for rule in rules:
        assert rule["alert"]
        assert rule["expr"]
        # A misspelt metric or label is no syntax error: the rule would just never fire.
        assert promql.problems(rule["expr"]) == [], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"])
    assert len({rule["alert"] for rule in rules}) == len(rules)


def test_stateful_services_and_daemons_have_healthchecks() -> None:
    for service in ("postgres", "rabbitmq", "dispatcher", "consumer"):
        assert SERVICES[service]["healthcheck"]["test"]


def test_dependencies_name_services_with_valid_conditions() -> None:
    for service, spec in SERVICES.items():
        for dependency, condition in spec.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{service} depends on unknown {dependency}"
            assert condition["condition"] in DEPENDENCY_CONDITIONS
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dependency]


def test_the_optional_standby_copies_the_primary_with_the_files_it_mounts() -> None:
    standby = SERVICES["postgres-standby"]
    assert standby["profiles"] == ["standby"]  # `docker compose up` alone never starts it
    assert standby["image"] == SERVICES["postgres"]["image"]  # a standby needs the same major
    assert standby["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert standby["healthcheck"]["test"]
    mounted = {
        service: {volume.split(":")[0]: volume.split(":")[1] for volume in spec["volumes"]}
        for service, spec in (("postgres", SERVICES["postgres"]), ("standby", standby))
    }
    for service, volumes in mounted.items():
        for source in volumes:
            assert (ROOT / source).is_file(), f"{service} mounts {source}, which is missing"
    init = (ROOT / "deploy/postgres/10-replication.sh").read_text()
    entry = (ROOT / "deploy/postgres/standby.sh").read_text()
    # The role the init script creates is the one the standby copies the primary as.
    assert "CREATE ROLE replicator WITH REPLICATION" in init
    assert "host replication replicator" in init
    assert "pg_basebackup -h postgres -U replicator" in entry
    assert " -R " in entry
    assert standby["entrypoint"][-1] in mounted["standby"].values()

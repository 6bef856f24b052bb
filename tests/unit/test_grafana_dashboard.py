"""deploy/grafana/ against the code: every query of the dashboard names series and labels
the daemons really export, and compose.yaml provisions what the files point at.

No Docker engine runs on CI and Grafana shows an empty panel, not an error, for a
misspelt metric, so the names are checked here (support/promql.py reads the PromQL).
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from outbox.metrics import MetricNames

from support import promql

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_FILE = GRAFANA / "dashboards" / "effect-outbox.json"
DASHBOARD: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
PANELS: list[dict[str, Any]] = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
ROWS: list[str] = [p["title"] for p in DASHBOARD["panels"] if p["type"] == "row"]
QUERIES = {
    f"{panel['title']}/{target['refId']}": target["expr"]
    for panel in PANELS
    for target in panel.get("targets", [])
}
SERIES = {**promql.exported_series(), **promql.PROMETHEUS_SERIES}
SERVICES: dict[str, dict[str, Any]] = yaml.safe_load((ROOT / "compose.yaml").read_text())[
    "services"
]
GRAFANA_SERVICE = SERVICES["grafana"]
DATASOURCE_VARIABLE = "${datasource}"


def mounts() -> dict[PurePosixPath, Path]:
    """Container directory -> directory in the repository, for the grafana service."""
    found = {}
    for volume in GRAFANA_SERVICE["volumes"]:
        source, target, mode = volume.split(":")
        assert mode == "ro", volume
        found[PurePosixPath(target)] = ROOT / source
    return found


def in_repository(container_path: str) -> Path:
    path = PurePosixPath(container_path)
    for target, source in mounts().items():
        if path.is_relative_to(target):
            return source / path.relative_to(target)
    raise AssertionError(f"{container_path} is not under a volume of the grafana service")


def provisioning(kind: str) -> dict[str, Any]:
    """The one provisioning file of ``kind`` Grafana reads from its mounted directory."""
    directory = in_repository(f"/etc/grafana/provisioning/{kind}")
    [path] = directory.glob("*.yml")
    config: dict[str, Any] = yaml.safe_load(path.read_text())
    assert config["apiVersion"] == 1
    return config


# --- The extractor, on its own ----------------------------------------------------------


def test_the_exported_series_are_the_sample_names_prometheus_client_exposes() -> None:
    # Guards the catalogue the other checks trust: counters carry _total (and _created),
    # histograms their _bucket (with le), _sum and _count; a bare counter name is no series.
    assert SERIES["outbox_dispatcher_published_total"] == {"tool"}
    assert "outbox_dispatcher_published_created" in SERIES
    assert "outbox_dispatcher_published" not in SERIES
    assert SERIES["outbox_effect_duration_seconds_bucket"] == {"tool", "le"}
    assert SERIES["outbox_effect_duration_seconds_count"] == {"tool"}
    assert SERIES["outbox_operations"] == {"state"}
    assert "outbox_dispatcher_batch_size_sum" in SERIES


def test_the_extractor_skips_functions_keywords_labels_strings_durations_and_numbers() -> None:
    expr = """
        histogram_quantile(0.99, sum by (le, tool) (
            rate(outbox_effect_duration_seconds_bucket{tool=~"a|b"}[5m])
        ))
        / on (tool) group_left
        sum without (instance, job) (increase(outbox_escalations_total{reason='tampered'}[1h]))
        > bool 1e3 or vector(0)
    """
    reading = promql.read(expr, SERIES)
    assert reading.problems == []
    names = [selector.name for selector in reading.selectors]
    assert names == ["outbox_effect_duration_seconds_bucket", "outbox_escalations_total"]
    assert reading.selectors[1].matchers == (("reason", "=", "tampered"),)


@pytest.mark.parametrize(
    ("expr", "complaint"),
    [
        # A misspelt or suffix-less metric name.
        ("sum(rate(outbox_dispatcher_publishd_total[5m]))", "not a series"),
        ("sum(rate(outbox_dispatcher_published[5m]))", "not a series"),
        ("max(outbox_dispatcher_backlog_rows_total)", "not a series"),
        ("sum by (le) (rate(outbox_effect_duration_bucket[5m]))", "not a series"),
        # Labels the metric does not carry, in a matcher or a grouping.
        ('sum(rate(outbox_dispatcher_published_total{outcome="x"}[5m]))', "no label 'outcome'"),
        ("sum by (reason) (rate(outbox_dispatcher_published_total[5m]))", "label 'reason'"),
        (
            "histogram_quantile(0.99, sum by (tool)"
            " (rate(outbox_effect_duration_seconds_bucket[5m])))",
            "'le'",
        ),
        # A state the code never exports.
        ('max(outbox_operations{state="unknown"})', "state is one of"),
        # Sides that cannot match, and what is not PromQL.
        (
            "sum by (tool) (rate(outbox_effect_attempts_total[5m]))"
            " / sum(rate(outbox_effect_attempts_total[5m]))",
            "matches nothing",
        ),
        ("sum(rat(outbox_dispatcher_published_total[5m]))", "unknown function"),
        ("sum(rate(outbox_dispatcher_published_total))", "unreadable"),
        ("sum(rate(outbox_dispatcher_published_total[5m])", "unreadable"),
    ],
)
def test_the_extractor_catches(expr: str, complaint: str) -> None:
    found = promql.problems(expr, SERIES)
    assert any(complaint in problem for problem in found), found


@pytest.mark.parametrize("key", sorted(QUERIES))
def test_a_typo_in_any_dashboard_query_is_caught(key: str) -> None:
    # The negative of the check below, on the real queries: drop the last letter of its
    # first series.
    expr = QUERIES[key]
    name = promql.read(expr, SERIES).selectors[0].name
    misspelt = re.sub(rf"\b{name}\b", name[:-1], expr, count=1)
    assert any("not a series" in problem for problem in promql.problems(misspelt, SERIES))


# --- The dashboard ------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(QUERIES))
def test_every_query_names_series_and_labels_the_daemons_export(key: str) -> None:
    reading = promql.read(QUERIES[key], SERIES)
    assert reading.selectors, "a query without a series shows nothing"
    assert reading.problems == []


def test_the_dashboard_shows_every_exported_metric() -> None:
    # A metric added to outbox/metrics.py without a panel fails here.
    shown = {s.name for expr in QUERIES.values() for s in promql.read(expr, SERIES).selectors}
    suffix = re.compile(r"_(total|bucket|sum|count|created)$")
    shown_metrics = {suffix.sub("", name) for name in shown} | shown
    names = {value for key, value in vars(MetricNames).items() if key.isupper()}
    assert names - shown_metrics == set()


@pytest.mark.parametrize("key", sorted(QUERIES))
def test_every_window_follows_grafanas_step(key: str) -> None:
    # A fixed [5m] skips samples once a panel's step is longer than five minutes; the
    # time range's own $__range is for the "in range" stats.
    windows = re.findall(r"\[([^\]]*)\]", QUERIES[key])
    assert set(windows) <= {"$__rate_interval", "$__range"}, windows


def test_the_dashboard_is_identified_and_laid_out() -> None:
    assert DASHBOARD["uid"] == "effect-outbox"
    assert DASHBOARD["title"] == "effect-outbox"
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(set(ids)) == len(ids)
    assert ROWS == [
        "Overview",
        "Throughput",
        "Latency",
        "Backlog and execution",
        "Unknown outcomes and reconciliations",
        "Providers",
        "Escalations and dead letters",
        "Callbacks",
        "Connections",
        "Processes",
        "Overload",
    ]
    cells: dict[tuple[int, int], str] = {}
    for panel in DASHBOARD["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize("panel", PANELS, ids=[panel["title"] for panel in PANELS])
def test_every_panel_queries_the_datasource_variable(panel: dict[str, Any]) -> None:
    assert panel.get("targets"), "a panel without a query"
    assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_VARIABLE}
    for target in panel["targets"]:
        assert target["datasource"] == panel["datasource"]
        assert target["expr"].strip()
    refs = [target["refId"] for target in panel["targets"]]
    assert len(set(refs)) == len(refs)
    if panel["type"] != "heatmap":
        assert panel["fieldConfig"]["defaults"]["unit"]


def test_the_variables_are_a_prometheus_datasource_and_exported_label_values() -> None:
    variables = {variable["name"]: variable for variable in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] != "query":
            continue
        assert variable["datasource"]["uid"] == DATASOURCE_VARIABLE
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        reading = promql.read(match[1], SERIES)
        assert reading.problems == []
        [selector] = reading.selectors
        assert match[2] in SERIES[selector.name], f"{selector.name} has no label {match[2]}"
    used = {name for name in variables if any(f"${name}" in e for e in QUERIES.values())}
    assert used == set(variables) - {"datasource"}, "a variable no query uses"


# --- Provisioning ---------------------------------------------------------------------------


def test_compose_runs_grafana_on_localhost_after_prometheus() -> None:
    assert GRAFANA_SERVICE["image"].startswith("grafana/grafana")
    assert GRAFANA_SERVICE["ports"] == ["127.0.0.1:3000:3000"]
    assert "prometheus" in GRAFANA_SERVICE["depends_on"]
    environment = GRAFANA_SERVICE["environment"]
    assert environment["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert "GRAFANA_ADMIN_PASSWORD" in environment["GF_SECURITY_ADMIN_PASSWORD"]
    home = in_repository(environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home == DASHBOARD_FILE


def test_the_datasource_is_the_prometheus_compose_runs() -> None:
    [datasource] = provisioning("datasources")["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["isDefault"] is True
    match = re.fullmatch(r"http://([\w-]+):(\d+)", datasource["url"])
    assert match, datasource["url"]
    assert match[1] == "prometheus"
    published = [int(port.split(":")[-1]) for port in SERVICES["prometheus"]["ports"]]
    assert int(match[2]) in published


def test_the_dashboard_provider_loads_the_mounted_dashboards() -> None:
    [provider] = provisioning("dashboards")["providers"]
    assert provider["type"] == "file"
    directory = in_repository(provider["options"]["path"])
    assert directory == DASHBOARD_FILE.parent
    assert sorted(directory.glob("*.json")) == [DASHBOARD_FILE]

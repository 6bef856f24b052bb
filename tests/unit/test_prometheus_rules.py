"""deploy/prometheus/ checked by Prometheus's own tool, Debian's promtool: the rules load,
their unit tests pass (deploy/prometheus/tests/: a firing and a silent case for each
alert), the shipped config loads as it is, compose runs the Prometheus these checks ran,
and every alert has its runbook in docs/operating.md.

A misspelt metric is no error to promtool (tests/unit/test_compose.py reads the names
against the daemons' own metrics); what promtool adds is how Prometheus evaluates the
rules over time: `for`, increase() on a counter's first event, absent(), annotations.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from consumer.telemetry import prime_metrics
from outbox.callbacks.server import prime_callback_metrics
from outbox.metrics import CallbackMetrics, ConsumerMetrics, DispatcherMetrics

from support.prometheus import PROMETHEUS, promtool_version, run_promtool
from support.sample_tools import build_registry

pytestmark = pytest.mark.prometheus

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "prometheus"
ALERTS = DEPLOY / "alerts.yml"
RULE_TESTS = sorted((DEPLOY / "tests").glob("*.yml"))
RULES: list[dict[str, Any]] = [
    rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
]
ALERT_NAMES = [rule["alert"] for rule in RULES]
OPERATING = (ROOT / "docs" / "operating.md").read_text()


def promtool(*args: str, given: str | None = None) -> subprocess.CompletedProcess[str]:
    result = run_promtool(*args, cwd=ROOT, given=given)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_the_alert_rules_load() -> None:
    result = promtool("check", "rules", str(ALERTS.relative_to(ROOT)))
    assert f"SUCCESS: {len(RULES)} rules found" in result.stdout


def test_the_rule_unit_tests_pass() -> None:
    assert RULE_TESTS, "no rule tests found under deploy/prometheus/tests/"
    promtool("test", "rules", *(str(path.relative_to(ROOT)) for path in RULE_TESTS))


def test_the_shipped_config_loads_outside_compose_too() -> None:
    # rule_files is relative to the config, so the same file works in compose (mounted
    # at /etc/prometheus/outbox) and wherever else it is copied with alerts.yml beside it.
    result = promtool("check", "config", str((DEPLOY / "prometheus.yml").relative_to(ROOT)))
    assert f"SUCCESS: {len(RULES)} rules found" in result.stdout


@pytest.mark.parametrize("daemon", ["dispatcher", "consumer", "callbacks"])
def test_what_each_daemon_exposes_passes_promtools_lint(daemon: str) -> None:
    # Names, units, suffixes and help texts as Prometheus expects them, with every
    # label set the consumer and the callbacks receiver prime at start.
    if daemon == "dispatcher":
        exposition = generate_latest(DispatcherMetrics.create().registry)
    elif daemon == "callbacks":
        served = CallbackMetrics.create()
        prime_callback_metrics(served, ["sandbox-payments", "sandbox-email"])
        exposition = generate_latest(served.registry)
    else:
        metrics = ConsumerMetrics.create()
        prime_metrics(metrics, build_registry())
        exposition = generate_latest(metrics.registry)
    result = promtool("check", "metrics", given=exposition.decode())
    assert result.stdout + result.stderr == ""


def alert_cases() -> dict[str, list[list[Any]]]:
    """Alert name -> the expected alerts of each of its cases in the rule tests."""
    cases: dict[str, list[list[Any]]] = {}
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.setdefault(case["alertname"], []).append(case.get("exp_alerts") or [])
    return cases


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_every_alert_has_a_firing_and_a_silent_case(alert: str) -> None:
    cases = alert_cases().get(alert, [])
    assert any(cases), f"no rule test where {alert} fires"
    assert not all(cases), f"no rule test where {alert} stays silent"


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_every_alert_has_its_runbook_in_operating_md(alert: str) -> None:
    section = re.search(rf"^#### `{alert}`\n(.*?)(?=^#{{2,4}} )", OPERATING, re.M | re.S)
    assert section, f"docs/operating.md has no '#### `{alert}`' section"
    text = section[1]
    assert "**Means:**" in text
    assert "**Do:**" in text


def heading_anchor(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's) gives a heading: lower case, spaces to
    hyphens, punctuation other than hyphens and underscores dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("rule", RULES, ids=ALERT_NAMES)
def test_every_alert_links_its_runbook_entry(rule: dict[str, Any]) -> None:
    url = rule["annotations"].get("runbook_url")
    assert url, f"{rule['alert']} has no runbook_url annotation"
    page, _, anchor = url.partition("#")
    assert page == "docs/operating.md"
    anchors = {heading_anchor(heading) for heading in re.findall(r"^#{1,6} (.+)$", OPERATING, re.M)}
    assert anchor in anchors, f"{url}: no such heading in docs/operating.md"
    assert anchor == heading_anchor(f"`{rule['alert']}`"), "it must be the alert's own entry"


def test_compose_runs_the_prometheus_version_ci_tests_the_rules_with() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    image = compose["services"]["prometheus"]["image"]
    match = re.fullmatch(r"prom/prometheus:v(\d+)\.(\d+)\.(\d+)", image)
    assert match, f"{image}: pin a version (prom/prometheus:vX.Y.Z), not a moving tag"
    installed = promtool_version()
    assert (int(match[1]), int(match[2])) == installed[:2], (
        f"compose runs {image}, the rules are tested with promtool {installed}: move one"
    )
    assert PROMETHEUS.exists()

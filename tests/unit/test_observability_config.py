"""The shipped Grafana dashboard, alert rules and Prometheus scrape config
(``deploy/observability/``) ask only for families meshserve serves, with labels those
families have, and scrape every service. (Running them against a live Prometheus is the
compose profile's test, tests/docker/test_compose.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.frontend.metrics_doc import families

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "deploy" / "observability"
NAME = re.compile(r"\b(meshserve[_:][a-zA-Z0-9_:]*)(\{[^}]*\})?")
SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


def _documented() -> dict[str, tuple[str, ...]]:
    return {name: labels for name, _, labels, _, _ in families()}


def _check(expr: str, documented: dict[str, tuple[str, ...]]) -> list[str]:
    """The families ``expr`` reads; AssertionError for one meshserve does not serve, or a
    label matcher naming a label it lacks."""
    found = []
    for name, matchers in NAME.findall(expr):
        family = name
        for suffix in SERIES_SUFFIXES:
            if family not in documented and family.endswith(suffix):
                family = family.removesuffix(suffix)
        assert family in documented, f"{name} in {expr!r}"
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers or ""):
            assert label in documented[family] + ("le",), f"{label} of {family}"
        found.append(family)
    return found


def test_every_dashboard_query_reads_served_families():
    dash = json.loads((DIR / "grafana-dashboard.json").read_text())
    documented = _documented()
    seen = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            seen.update(_check(target["expr"], documented))
    # The views an operator needs: latency, SLO, the engines' load, scaling, routing.
    assert {
        "meshserve:time_to_first_token_seconds",
        "meshserve_slo_requests_total",
        "meshserve:num_requests_running",
        "meshserve:kv_cache_usage_perc",
        "meshserve:replicas",
        "meshserve_routing_prompt_tokens_total",
    } <= seen


def test_alert_rules_read_served_families():
    rules = yaml.safe_load((DIR / "alerts.yml").read_text())["groups"][0]["rules"]
    documented = _documented()
    names = {r["alert"] for r in rules}
    assert {
        "MeshserveSLOAttainmentLow",
        "MeshserveRequestsHeld",
        "MeshserveTaskExecutorLost",
        "MeshserveLimitsUnenforced",
    } <= names
    for rule in rules:
        assert _check(rule["expr"], documented), rule["alert"]


def test_prometheus_scrapes_every_service():
    config = yaml.safe_load((DIR / "prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for group in job.get("static_configs", [])
        for target in group["targets"]
    } | {
        f"{name}:{sd['port']}"
        for job in config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    port = compose["frontend"]["ports"][0].rsplit(":", 1)[1]
    assert f"frontend:{port}" in targets
    for service in ("job-executor", "cluster-manager", "scaler", "task-executor"):
        assert f"{service}:9400" in targets
    assert "/etc/prometheus/alerts.yml" in config["rule_files"]

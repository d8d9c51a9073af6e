"""The Grafana dashboard and Prometheus alert rules under deploy/ name only metrics the server exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specserve.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "specserve.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
METRIC_NAME = re.compile(r"\bspecserve_[a-zA-Z0-9_]+")
# prometheus_client's exposition: the series names each metric type renders under its family name.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}


def exported_names(*, base_names: bool = False) -> set[str]:
    """Every series name a live ServerMetrics renders (labelled families without samples too);
    with base_names, the family names of counters and histograms as well (prose refers to them)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(ServerMetrics("m").render().decode()):
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
        if base_names:
            names.add(family.name)
    return names


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def dashboard_queries(dash: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(PromQL expressions of the panels, queries of the template variables)."""
    exprs = [
        t["expr"] for p in panels(dash["panels"]) for t in p.get("targets", []) if t.get("expr")
    ]
    variables = []
    for v in dash["templating"]["list"]:
        q = v.get("query")
        if v.get("type") == "query":
            variables.append(q["query"] if isinstance(q, dict) else q)
    return exprs, variables


def alert_rules() -> list[dict[str, Any]]:
    """The rules of every group in the alert file."""
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_dashboard_names_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs, variables = dashboard_queries(dash)
    assert exprs and variables
    exported = exported_names()
    used = {name for text in exprs + variables for name in METRIC_NAME.findall(text)}
    assert used - exported == set(), "dashboard queries metrics the server does not export"
    assert all(METRIC_NAME.search(e) for e in exprs), "every panel query reads a specserve metric"
    # The checklist's panels: TTFT/TPOT quantiles, tokens/s, acceptance by class, KV usage,
    # queue depth, speculation on/off.
    for name in (
        "specserve_time_to_first_token_seconds_bucket",
        "specserve_time_per_output_token_seconds_bucket",
        "specserve_generation_tokens_total",
        "specserve_request_accepted_tokens_total",
        "specserve_effective_speedup",
        "specserve_kv_cache_usage_ratio",
        "specserve_num_requests_waiting",
        "specserve_speculation_enabled",
    ):
        assert name in used, name
    ids = [p["id"] for p in panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_alert_rules_name_only_exported_metrics():
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {
        "SpecServeLowAcceptance",
        "SpecServeTTFTAboveSLO",
        "SpecServeKVCacheNearlyFull",
    }
    # Queries name series; the annotations an operator reads may name a histogram by its base name.
    queried = {name for r in rules for name in METRIC_NAME.findall(r["expr"])}
    assert queried - exported_names() == set()
    mentioned = set(METRIC_NAME.findall(ALERTS.read_text(encoding="utf-8")))
    assert mentioned - exported_names(base_names=True) == set()
    low = next(r for r in rules if r["alert"] == "SpecServeLowAcceptance")
    assert "request_class" in low["expr"] and "< 0.6" in low["expr"]
    kv = next(r for r in rules if r["alert"] == "SpecServeKVCacheNearlyFull")
    assert "> 0.9" in kv["expr"]


def promtool() -> str:
    """Path of promtool: required in CI, else the check is skipped."""
    path = shutil.which("promtool")
    if path is None:
        message = (
            "promtool not found: install Debian's prometheus package (apt-get install prometheus)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def test_promtool_checks_the_alert_rules():
    proc = subprocess.run(
        [promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 3 rules found" in proc.stdout


def test_promtool_parses_the_dashboard_queries(tmp_path):
    # Grafana's variables substituted as it would, each panel query becomes a recording rule.
    exprs, _ = dashboard_queries(json.loads(DASHBOARD.read_text(encoding="utf-8")))
    subst = {"$__rate_interval": "5m", "$model": ".*", "$request_class": ".*"}
    rules = []
    for i, expr in enumerate(exprs):
        for var, value in subst.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        rules.append({"record": f"specserve:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8"
    )
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

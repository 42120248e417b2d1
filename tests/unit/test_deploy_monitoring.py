"""The monitoring in deploy/: Prometheus rules (checked and unit-tested by promtool), the
PrometheusRule made from them, the HPA's alert threshold, and the dashboard's expressions,
each reading only metrics the nodes export or rules the file records.

The live check (a real Prometheus scraping real nodes) is tests/e2e/test_prometheus.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from encdis.encoder_node.metrics import EncoderMetrics
from encdis.llm_node.coordinator.colocated import ColocatedMetrics
from encdis.llm_node.coordinator.metrics import CoordinatorMetrics
from encdis.llm_node.metrics import LLMNodeMetrics
from tests.monitoring import (
    DASHBOARD,
    PROMETHEUS_RULE,
    RULES,
    RULES_TESTS,
    alert_rules,
    dashboard_exprs,
    names_in,
    recording_rules,
    rules,
)
from tests.needs import require_tool
from tests.unit.test_deploy_k8s import K8S, render

HINT = "apt-get install prometheus (it brings promtool)"


def exported_names() -> set[str]:
    """Every sample name the encoder node and the LLM node export (histograms' _bucket/_sum/_count)."""
    llm = CollectorRegistry()
    LLMNodeMetrics(llm)
    CoordinatorMetrics(llm)
    ColocatedMetrics(llm)
    names = set()
    for registry in (EncoderMetrics().registry, llm):
        for family in registry.collect():
            names |= {s.name for s in family.samples}
            # A labelled metric has no samples until its first child: name what it will export.
            suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
            names |= {family.name + s for s in suffixes.get(family.type, ())}
    return names


def test_promtool_checks_the_rules() -> None:
    promtool = require_tool("promtool", HINT)
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    promtool = require_tool("promtool", HINT)
    out = subprocess.run([promtool, "test", "rules", str(RULES_TESTS)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # Each alert is exercised by a unit test, firing or not.
    tested = {t["alertname"] for case in yaml.safe_load(RULES_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert tested == set(alert_rules()), f"alerts without a promtool test: {set(alert_rules()) - tested}"


def test_dashboard_expressions_parse(tmp_path: Path) -> None:
    """promtool parses each panel's PromQL (as a recording rule of a throwaway file)."""
    promtool = require_tool("promtool", HINT)
    exprs = dashboard_exprs()
    doc = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(exprs.values())]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_expression_reads_exported_metrics_or_recorded_rules() -> None:
    exported, recorded = exported_names(), set(recording_rules())
    exprs = {**{f"rule {k}": v for k, v in recording_rules().items()},
             **{f"alert {k}": v["expr"] for k, v in alert_rules().items()},
             **{f"dashboard {k}": v for k, v in dashboard_exprs().items()}}
    unknown = {where: sorted(names_in(e) - exported - recorded) for where, e in exprs.items()}
    assert not {k: v for k, v in unknown.items() if v}, "expressions reading metrics no node exports"
    assert all(names_in(e) for e in exprs.values())


def test_the_dashboard_uses_every_recording_rule_and_shows_what_an_operator_needs() -> None:
    used = set().union(*(names_in(e) for e in dashboard_exprs().values()))
    assert set(recording_rules()) - used == set(), "recording rules no panel shows"
    for needed in ("encdis_request_queue_seconds", "encdis_request_preprocess_seconds", "encdis_request_encode_seconds",
                   "encdis_request_transfer_seconds", "encdis_request_prefill_seconds",
                   "encdis_request_decode_seconds", "encdis:encoder_patches:rate1m",
                   "encdis:encoder_queued_patches:avg1m", "encdis_coordinator_encoders",
                   "encdis:coordinator_cache_hit_ratio:rate5m", "encdis:coordinator_colocated_fallbacks:rate5m",
                   "encdis:requests_refused:rate5m", "encdis:encoder_embedding_bytes:rate1m"):
        assert any(needed in n for n in used), f"no panel shows {needed}"
    assert DASHBOARD.read_text().count("${DS_PROMETHEUS}") > 0  # imported with a datasource of choice


def test_prometheus_rule_holds_the_rules_file_groups() -> None:
    [doc] = [d for d in render(K8S / "monitoring") if d["kind"] == "PrometheusRule"]
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["spec"] == rules(), f"{PROMETHEUS_RULE} differs from {RULES}: copy the groups over"
    assert doc["metadata"]["namespace"] == "monitoring"


@pytest.mark.parametrize("alert", ["EncdisEncoderPoolBehind"])
def test_pool_behind_alert_fires_above_the_hpa_target(alert: str) -> None:
    hpa = yaml.safe_load((K8S / "encoder-hpa.yaml").read_text())
    target = float(hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"])
    expr = alert_rules()[alert]["expr"]
    assert "encdis:encoder_queued_patches:avg1m" in expr  # the series the HPA's adapter reads
    assert expr.rstrip().endswith(f"> {target:g}"), f"{alert} compares with other than the HPA's {target:g}"

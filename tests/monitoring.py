"""What deploy/ holds for monitoring, read for the tests: the Prometheus rules file and the
Grafana dashboard's PromQL expressions, and the metric names each expression reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus" / "encdis-rules.yml"
RULES_TESTS = DEPLOY / "prometheus" / "encdis-rules.test.yml"
PROMETHEUS_RULE = DEPLOY / "k8s" / "monitoring" / "prometheus-rule.yaml"
DASHBOARD = DEPLOY / "grafana" / "encdis.json"

# encdis metric names (encdis_...) and recording rule names (encdis:...); every one starts so.
_NAME = re.compile(r"\bencdis[_:][a-zA-Z0-9_:]*")


def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def recording_rules() -> dict[str, str]:
    return {r["record"]: r["expr"] for g in rules()["groups"] for r in g["rules"] if "record" in r}


def alert_rules() -> dict[str, dict]:
    return {r["alert"]: r for g in rules()["groups"] for r in g["rules"] if "alert" in r}


def dashboard_exprs() -> dict[str, str]:
    """'<panel title> / <refId>' -> expr, for every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return {f"{p['title']} / {t['refId']}": t["expr"] for p in dash["panels"] for t in p["targets"]}


def names_in(expr: str) -> set[str]:
    """The metric and recording-rule names an expression reads."""
    return set(_NAME.findall(expr))


def with_for(doc: dict, seconds: float) -> dict:
    """The rules with every alert's `for:` shortened to `seconds` (for a test's short run)."""
    out = json.loads(json.dumps(doc))
    for g in out["groups"]:
        for r in g["rules"]:
            if "alert" in r:
                r["for"] = f"{seconds:g}s"
    return out

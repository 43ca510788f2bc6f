"""deploy/: the Prometheus rules pass promtool, and rules and dashboard only use metrics the agent exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent_under_test.hooks import GuardConfig
from agent_under_test.protection import ProtectionGuard

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (apt-get install prometheus)")


def exported_names() -> set[str]:
    g = ProtectionGuard(GuardConfig())
    g.finish("Decide", 0.001, "ok")
    text = g.metrics.exposition().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def used_names(text: str) -> set[str]:
    return set(re.findall(r"\bagent_[a-z0-9_]+", text)) - {"agent_under_test"}


@needs_promtool
@pytest.mark.parametrize("rules", ["alerts.yml", "alerts-ci.yml"])
def test_promtool_checks_the_rules(rules: str):
    out = subprocess.run([PROMTOOL, "check", "rules", str(DEPLOY / "prometheus" / rules)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@needs_promtool
@pytest.mark.parametrize("tests", ["alerts_test.yml", "alerts-ci_test.yml"])
def test_promtool_unit_tests_pass(tests: str):
    out = subprocess.run([PROMTOOL, "test", "rules", tests], cwd=DEPLOY / "prometheus",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ci_rules_are_the_deployed_rules_with_short_windows():
    """alerts-ci.yml may differ from alerts.yml only in its windows and durations, never in what it says."""
    import yaml

    def alerts(name: str, window: str) -> dict[str, str]:
        doc = yaml.safe_load((DEPLOY / "prometheus" / name).read_text())
        rules = [r for g in doc["groups"] for r in g["rules"]]
        records = {r["record"]: " ".join(r["expr"].split()) for r in rules if "record" in r}
        out = {}
        for r in rules:
            if "alert" in r and "agent_alert_firing" not in r["expr"]:
                expr = " ".join(r["expr"].split())
                for rec, body in records.items():
                    expr = expr.replace(rec, f"({body})")
                out[r["alert"]] = expr.replace(f"[{window}]", "[W]").replace(f"ratio_{window}", "ratio_W")
        return out

    assert alerts("alerts-ci.yml", "3s") == alerts("alerts.yml", "1m")


def test_rules_and_dashboard_only_use_exported_metrics():
    names = exported_names()
    rules = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    dash_text = (DEPLOY / "grafana" / "agent.json").read_text()
    assert used_names(rules) <= names, used_names(rules) - names
    assert used_names(dash_text) <= names, used_names(dash_text) - names
    assert 'agent_request_latency_seconds_bucket{le="0.02"}' in rules   # the edge the agent guarantees


def test_dashboard_shows_quantiles_rate_limiter_alert_and_tier():
    dash = json.loads((DEPLOY / "grafana" / "agent.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for needle in ('quantile="0.5"', 'quantile="0.95"', 'quantile="0.99"', "rate(agent_requests_total",
                   "agent_limiter_rate", "agent_alert_firing", "agent_model_tier", "agent_loop_saturation"):
        assert needle in exprs
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "shadowtest-agent"

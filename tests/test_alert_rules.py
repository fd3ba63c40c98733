"""The Prometheus alert rules: promtool checks them and runs their unit tests, and every
alert has a case in those tests (scripts/test.sh runs promtool too)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = PROM / "resihp-alerts.yml"
TESTS = PROM / "resihp-alerts.test.yml"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: apt-get install -y prometheus (scripts/test.sh does)")
    return path


def test_every_alert_has_a_firing_case_in_the_promtool_tests():
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    cases = yaml.safe_load(TESTS.read_text())["tests"]
    firing = {
        t["alertname"] for c in cases for t in c.get("alert_rule_test", []) if t.get("exp_alerts")
    }
    assert alerts - firing == set(), f"alerts without a firing promtool case: {alerts - firing}"


def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    tool = _promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run([tool, "test", "rules", str(TESTS)], capture_output=True, text=True)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr

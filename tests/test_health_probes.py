"""The services' ``--check-health`` probes import only what they use: compose runs them
every 10 s with a 5 s timeout, and the detector's pulled in ruptures and scipy (3-6 s
under load) through its package's ``__init__``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: modules no health probe needs: the detector's change-point stack, torch, the dashboard's UI
HEAVY = ("ruptures", "scipy", "torch", "dash", "plotly", "pandas")

PROBE = """
import json, runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {heavy})))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["collector", "--all-jobs"],
        ["collector", "--job-id", "j"],
        ["detector", "--all-jobs"],
        ["detector", "--job-id", "j"],
        ["scheduler", "--all-jobs"],
        ["dashboard"],
        ["trainer"],
    ],
    ids=lambda a: " ".join(a),
)
def test_a_health_probe_imports_nothing_heavy(argv):
    code = PROBE.replace("{heavy}", repr(set(HEAVY)))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            *argv,
            "--check-health",
            "--redis-url",
            "redis://127.0.0.1:1/0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"{' '.join(argv)} --check-health imported {loaded[:8]}"

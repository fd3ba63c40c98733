"""docker-compose.yml structure (Docker cannot run on our machines, so its shape is checked)."""

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVICE_PACKAGES = ["collector", "detector", "scheduler", "dashboard", "trainer"]


def _compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_service_package_has_a_container_with_healthcheck():
    svcs = _compose()["services"]
    for name in ["redis", *SERVICE_PACKAGES]:
        assert name in svcs, f"compose misses service {name}"
        hc = svcs[name].get("healthcheck")
        assert hc and hc["test"][0] == "CMD", f"{name} has no CMD healthcheck"


def test_commands_and_healthchecks_name_modules_that_exist():
    svcs = _compose()["services"]
    for name in SERVICE_PACKAGES:
        cmd = svcs[name]["command"]
        assert cmd[:2] == ["python", "-m"], cmd
        assert importlib.util.find_spec(f"{cmd[2]}.__main__"), f"no module {cmd[2]}.__main__"
        hc = svcs[name]["healthcheck"]["test"]
        assert hc[1:4] == ["python", "-m", cmd[2]] and "--check-health" in hc


def test_redis_persistence_password_and_env_wiring():
    c = _compose()
    redis = c["services"]["redis"]
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--requirepass" in cmd and "REDIS_PASSWORD" in cmd
    assert any(v.endswith(":/data") for v in redis["volumes"])
    for name in SERVICE_PACKAGES:
        svc = c["services"][name]
        env = svc["environment"]
        assert "${REDIS_PASSWORD" in env["REDIS_URL"] and "@redis:6379" in env["REDIS_URL"]
        assert env["RESIHP_JOB_ID"]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()


def test_dashboard_port_published_and_bound_to_all_interfaces_inside_container():
    d = _compose()["services"]["dashboard"]
    assert "8050:8050" in d["ports"]
    assert d["command"][d["command"].index("--host") + 1] == "0.0.0.0"


def test_dockerfile_copies_every_package_and_pins_cpu_torch():
    text = (ROOT / "Dockerfile").read_text()
    for pkg in ["resihp", *SERVICE_PACKAGES]:
        assert f"COPY {pkg} ./{pkg}" in text
    assert "torch==2.13.0" in text and "whl/cpu" in text

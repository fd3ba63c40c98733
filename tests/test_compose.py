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


def test_dashboard_port_published_on_host_loopback_and_all_interfaces_inside_container():
    d = _compose()["services"]["dashboard"]
    # inside the container it must listen beyond loopback for the port mapping to reach
    # it; on the host the mapping stays on loopback unless the operator opens it
    assert d["ports"] == ["${RESIHP_DASHBOARD_BIND:-127.0.0.1}:8050:8050"]
    assert d["command"][d["command"].index("--host") + 1] == "0.0.0.0"


def test_optional_prometheus_scrapes_the_dashboard_with_the_alert_rules():
    c = _compose()
    prom = c["services"]["prometheus"]
    assert prom["profiles"] == ["monitoring"]  # a plain `docker compose up` does not need it
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in prom["volumes"] if v[0] == "."}
    for path in mounts.values():
        assert path.is_file(), path
    conf = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    assert conf["rule_files"] == ["/etc/prometheus/resihp-alerts.yml"]
    assert "/etc/prometheus/resihp-alerts.yml" in mounts
    (scrape,) = conf["scrape_configs"]
    assert scrape["honor_labels"] is True  # our `job` label is the training job
    dash_port = c["services"]["dashboard"]["ports"][0].rsplit(":", 1)[1]
    assert scrape["static_configs"][0]["targets"] == [f"dashboard:{dash_port}"]
    assert scrape["metrics_path"] == "/metrics"
    assert "prometheus-data" in c["volumes"]


def test_dockerfile_copies_every_package_and_pins_cpu_torch():
    text = (ROOT / "Dockerfile").read_text()
    for pkg in ["resihp", *SERVICE_PACKAGES]:
        assert f"COPY {pkg} ./{pkg}" in text
    assert "torch==2.13.0" in text and "whl/cpu" in text

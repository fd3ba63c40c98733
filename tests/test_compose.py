"""docker-compose.yml structure (Docker cannot run on our machines, so its shape is checked)."""

import ast
import importlib.util
import os
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVICE_PACKAGES = ["collector", "detector", "scheduler", "dashboard", "trainer"]
#: services that run one container for every job in the Redis (``--all-jobs``)
WATCHERS = ["collector", "detector", "scheduler"]


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


def test_one_collector_detector_and_scheduler_serve_every_job():
    svcs = _compose()["services"]
    for name in WATCHERS:
        assert "--all-jobs" in svcs[name]["command"], name
        assert "--all-jobs" in svcs[name]["healthcheck"]["test"], name


def test_compose_commands_parse_with_the_services_own_parsers():
    """A flag the service does not know would crash-loop its container."""
    from collector.__main__ import _parser as collector_parser
    from detector.__main__ import build_parser as detector_parser
    from scheduler.__main__ import build_parser as scheduler_parser

    parsers = {
        "collector": collector_parser,
        "detector": detector_parser,
        "scheduler": scheduler_parser,
    }
    svcs = _compose()["services"]
    for name, parser in parsers.items():
        for argv in (svcs[name]["command"][3:], svcs[name]["healthcheck"]["test"][4:]):
            argv = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in argv]
            args = parser().parse_args(argv)
            assert args.all_jobs is True, (name, argv)


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
        # the trainer's job and the dashboard's default job; the watchers serve every job
        assert bool(env.get("RESIHP_JOB_ID")) == (name not in WATCHERS), name
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()


def test_dashboard_port_published_on_host_loopback_and_all_interfaces_inside_container():
    d = _compose()["services"]["dashboard"]
    # inside the container it must listen beyond loopback for the port mapping to reach
    # it; on the host the mapping stays on loopback unless the operator opens it
    assert d["ports"] == ["${RESIHP_DASHBOARD_BIND:-127.0.0.1}:8050:8050"]
    assert d["command"][d["command"].index("--host") + 1] == "0.0.0.0"


def _env_vars_read(path: Path) -> set[str]:
    """Names of the environment variables a module reads: ``X.get("NAME", ...)`` and
    ``X["NAME"]`` with an all-caps literal, where X is ``os.environ`` or the ``env`` mapping
    the dashboard's config functions take in its place."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, key = node.func.value, node.args[0] if node.args else None
            if node.func.attr not in ("get", "getenv"):
                continue
        elif isinstance(node, ast.Subscript):
            owner, key = node.value, node.slice
        else:
            continue
        text = ast.unparse(owner)
        if text in ("env", "os.environ", "os") and isinstance(key, ast.Constant):
            if isinstance(key.value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]+", key.value):
                names.add(key.value)
    return names


def test_compose_passes_every_env_var_the_dashboard_reads():
    read = set()
    for module in ("config.py", "__main__.py"):
        read |= _env_vars_read(ROOT / "dashboard" / module)
    # the list comes from the code: a new setting the dashboard reads fails here until
    # compose passes it (as operators and the session secret once were not)
    assert {"RESIHP_OPERATORS", "RESIHP_OPERATOR_USER", "RESIHP_DASHBOARD_SECRET"} <= read
    env = _compose()["services"]["dashboard"]["environment"]
    missing = read - set(env)
    assert not missing, f"docker-compose.yml does not pass {sorted(missing)} to the dashboard"
    for name in read - {"REDIS_URL"}:  # the URL is built from REDIS_PASSWORD
        assert env[name].startswith("${" + name), (name, env[name])


def test_prometheus_has_its_own_bind_address_on_host_loopback():
    # Prometheus has no authentication: opening the dashboard must not open it too
    prom = _compose()["services"]["prometheus"]
    assert prom["ports"] == ["${RESIHP_PROMETHEUS_BIND:-127.0.0.1}:9090:9090"]
    assert "RESIHP_PROMETHEUS_BIND" in (ROOT / "docs" / "operations.md").read_text()


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


def test_dockerfile_compiles_the_dag_kernel_into_a_baked_cache():
    text = (ROOT / "Dockerfile").read_text()
    assert "--no-install-recommends gcc libc6-dev" in text
    assert "rm -rf /var/lib/apt/lists/*" in text  # the image stays lean
    cache = re.search(r"RESIHP_CACHE_DIR=(\S+)", text).group(1)
    assert not cache.startswith(("~", "/home", "/root"))  # the resihp user reads it
    # compiled as root after `pip install .`, before the image switches user
    build = text.index("_kernel.available()")
    assert text.index("RUN pip install --no-deps .") < build < text.index("USER resihp")


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """(exception, regex) per .dockerignore line, as Docker reads them: comments and blank
    lines skipped, a leading '/' dropped, '**' any number of directories, '*' and '?'
    within one path segment, '!' an exception; the last matching line wins."""
    out = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pat.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pat[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pat[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(pat[i]), i + 1
        out.append((neg, re.compile(rx)))
    return out


def _dockerignored(rel: str, patterns) -> bool:
    """Whether the build context leaves out ``rel``: a pattern matching the path or a
    directory above it excludes it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for neg, rx in patterns:
        if any(rx.fullmatch(p) for p in prefixes):
            excluded = not neg
    return excluded


def test_dockerignore_keeps_what_the_dockerfile_copies_and_drops_local_state():
    patterns = _dockerignore_patterns()
    copies = [
        line.split()[1:-1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from" not in line
    ]
    sources = [src for srcs in copies for src in srcs]
    assert {"pyproject.toml", "README.md", "resihp", "dashboard"} <= set(sources)
    for src in sources:
        path = ROOT / src
        assert path.exists(), src
        files = (
            [path]
            if path.is_file()
            else [
                Path(d) / f
                for d, dirs, names in os.walk(path)
                if "__pycache__" not in Path(d).parts
                for f in names
                if not f.endswith((".pyc", ".so"))
            ]
        )
        assert files, src
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            assert not _dockerignored(rel, patterns), f"{rel} (COPY {src}) is in .dockerignore"
    # local state, virtualenvs and build leftovers never go to the daemon
    for rel in (
        ".venv/bin/python",
        ".git/HEAD",
        ".resihp/stack.json",
        "runs/r1/metrics.jsonl",
        "artifacts/x.json",
        ".whl/redis-8.1.0-py3-none-any.whl",
        "torch-2.13.0-cp311-none-linux_x86_64.whl",
        "resihp/__pycache__/bus.cpython-311.pyc",
        "dashboard/pages/__pycache__/plans.cpython-311.pyc",
        "resihp.egg-info/PKG-INFO",
        ".env",
    ):
        assert _dockerignored(rel, patterns), rel


def test_redis_restarts_like_the_services():
    assert _compose()["services"]["redis"]["restart"] == "unless-stopped"


def test_only_the_trainer_image_carries_torch():
    """The services image is built without torch (754 MB the services never import);
    the trainer's image is the services image plus the pinned CPU wheel."""
    svcs = _compose()["services"]
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    by_target = {s.split("\n", 1)[0].split(" AS ")[1].strip(): s for s in stages}
    assert set(by_target) == {"services", "trainer"}
    assert "pip install torch" not in by_target["services"]
    assert "torch==" not in by_target["services"]
    assert "if not d.startswith('torch')" in by_target["services"]  # dropped from pyproject's
    assert "torch==2.13.0" in by_target["trainer"] and "whl/cpu" in by_target["trainer"]
    assert by_target["trainer"].startswith("services AS trainer")
    for name in SERVICE_PACKAGES:
        want = "trainer" if name == "trainer" else "services"
        assert svcs[name]["build"]["target"] == want, name
    images = {svcs[n]["image"] for n in SERVICE_PACKAGES if n != "trainer"}
    assert len(images) == 1 and svcs["trainer"]["image"] not in images


BLOCK_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch in the services image")
sys.meta_path.insert(0, NoTorch())
import collector.service, detector.service, scheduler.service, dashboard.app, trainer.sim
import collector.__main__, detector.__main__, scheduler.__main__, dashboard.__main__
print("ok")
"""


def test_the_services_run_without_torch():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

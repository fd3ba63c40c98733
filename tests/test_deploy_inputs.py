"""Deployment inputs a prober fed the services as compose would: a Redis URL whose database
is not a number, a Redis that refuses the dashboard, operator lists with stray spaces,
duplicate names or the wrong separator, and an image without a C compiler."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest

from dashboard.__main__ import _check_redis, _warn_about_operators, main
from dashboard.config import operators_from_env, parse_operators, suspect_operators
from resihp.pipeline import _kernel
from resihp.redis_client import EmbeddedRedis, free_port


@pytest.fixture(scope="module")
def secured():
    srv = EmbeddedRedis(password="s3cret", appendonly=False).start()
    yield srv
    srv.cleanup()


def _run(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "RESIHP_"))}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=30, env=env
    )


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.redis
@pytest.mark.parametrize("service", ["collector", "detector", "scheduler", "dashboard"])
def test_a_database_that_is_not_a_number_ends_a_service_with_one_line(secured, service):
    # before: redis-py ignored /abc and every service ran on db 0
    url = f"redis://:s3cret@127.0.0.1:{secured.port}/abc"
    res = _run(service, env_extra={"REDIS_URL": url, "RESIHP_JOB_ID": "default"})
    line = _one_line(res.stderr)
    assert res.returncode == 2, res
    assert line.startswith(f"{service}: ") and "database 'abc'" in line and "s3cret" not in line


@pytest.mark.redis
@pytest.mark.parametrize(
    "auth,db,why",
    [
        (":wrong@", "0", "invalid username-password pair"),
        ("", "0", "Authentication required"),
        (":s3cret@", "99", "DB index is out of range"),
    ],
)
def test_dashboard_refused_by_redis_ends_with_one_line_and_exit_2(secured, auth, db, why):
    """As the other services do: serving pages that can never read anything helped nobody."""
    url = f"redis://{auth}127.0.0.1:{secured.port}/{db}"
    res = _run("dashboard", "--redis-url", url, "--port", str(free_port()))
    line = _one_line(res.stderr)
    assert res.returncode == 2
    assert line.startswith("dashboard: cannot use Redis at redis://127.0.0.1:") and why in line
    assert "wrong" not in line and "s3cret" not in line


def test_dashboard_starts_while_redis_is_merely_down(caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: it may come up later
    with caplog.at_level(logging.WARNING):
        assert _check_redis(url) == 0
    assert "cannot be reached yet; serving" in caplog.text


@pytest.mark.redis
def test_dashboard_check_passes_a_redis_that_answers(secured, caplog):
    with caplog.at_level(logging.WARNING):
        assert _check_redis(secured.url) == 0
    assert caplog.text == ""


def test_operator_names_and_passwords_lose_surrounding_whitespace():
    assert parse_operators(" alice : pw , bob : pw2 ") == {"alice": "pw", "bob": "pw2"}
    assert parse_operators("alice:s3:cret") == {"alice": "s3:cret"}  # ':' may be in a password
    env = {"RESIHP_OPERATOR_USER": " carol ", "RESIHP_OPERATOR_PASSWORD": " x "}
    assert operators_from_env(env) == {"carol": "x"}


@pytest.mark.parametrize(
    "env,name",
    [
        ({"RESIHP_OPERATORS": "alice:pw,alice:other,bob : pw2 "}, "alice"),
        ({"RESIHP_OPERATORS": "bob:x, bob :x"}, "bob"),
        (
            {
                "RESIHP_OPERATORS": "alice:pw",
                "RESIHP_OPERATOR_USER": "alice",
                "RESIHP_OPERATOR_PASSWORD": "other",
            },
            "alice",
        ),
    ],
)
def test_an_operator_given_twice_is_refused_naming_it(env, name):
    with pytest.raises(ValueError, match=f"operators: operator '{name}' is given"):
        operators_from_env(env)


def test_dashboard_with_a_duplicate_operator_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("RESIHP_OPERATORS", "alice:pw,alice:other")
    assert main(["--redis-url", "redis://127.0.0.1:1/0"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert (
        line
        == "dashboard: bad setting: operators: operator 'alice' is given twice in RESIHP_OPERATORS"
    )


def test_a_password_that_looks_like_a_wrong_separator_is_warned_about(caplog):
    spec = "alice:pw;bob:x, carol:fine"
    ops = parse_operators(spec)  # legal: a password may hold ';' or ':', so not refused
    assert ops == {"alice": "pw;bob:x", "carol": "fine"}
    assert suspect_operators(spec) == ["alice"]
    with caplog.at_level(logging.WARNING):
        _warn_about_operators(ops, spec)
    (rec,) = caplog.records
    assert "operator 'alice'" in rec.message and "did you mean ','" in rec.message
    assert "pw;bob" not in rec.message  # the password itself is never logged


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """_kernel as in a new process, compiling into an empty cache directory."""
    monkeypatch.setattr(_kernel, "_tried", False)
    monkeypatch.setattr(_kernel, "_lib", None)
    monkeypatch.delenv("RESIHP_PURE_NUMPY", raising=False)
    monkeypatch.setenv("RESIHP_CACHE_DIR", str(tmp_path))
    return monkeypatch


def test_no_compiler_warns_once_then_uses_numpy(fresh_kernel, caplog):
    import numpy as np

    fresh_kernel.setenv("CC", "/nonexistent/cc")
    p = np.array([1, 1], dtype=np.int64)
    with caplog.at_level(logging.WARNING, logger="resihp.pipeline._kernel"):
        for _ in range(3):
            assert not _kernel.available()
            assert _kernel.longest_path(p, p, np.ones(1), None) is None
    (rec,) = [r for r in caplog.records if r.name == "resihp.pipeline._kernel"]
    assert "numpy path" in rec.message and "/nonexistent/cc" in rec.message


def test_pure_numpy_by_choice_is_not_warned_about(fresh_kernel, caplog):
    fresh_kernel.setenv("RESIHP_PURE_NUMPY", "1")
    with caplog.at_level(logging.WARNING):
        assert not _kernel.available()
    assert caplog.text == ""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_a_kernel_compiled_beforehand_needs_no_compiler(fresh_kernel, caplog):
    """The image compiles the kernel at build time into $RESIHP_CACHE_DIR; a service then
    loads it even where it could not compile it."""
    assert _kernel.available()  # the build step
    fresh_kernel.setattr(_kernel, "_tried", False)
    fresh_kernel.setattr(_kernel, "_lib", None)
    fresh_kernel.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING):
        assert _kernel.available()
    assert caplog.text == ""

"""Service start-up inputs: a bad setting or an unusable Redis is one clear line (exit 2 for a
bad setting or a Redis that refuses the client, 1 for an unhealthy ``--check-health``),
never a traceback, and never a password in the line."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

import pytest

from resihp import entry
from resihp.bus import Health
from resihp.keys import JobKeys
from resihp.redis_client import EmbeddedRedis, free_port

PASSWORD = "s3cretPW"


@pytest.fixture(scope="module")
def locked_redis():
    """A real redis-server that wants a password."""
    srv = EmbeddedRedis(password=PASSWORD, appendonly=False, die_with_parent=True).start()
    yield srv
    srv.cleanup()


@pytest.fixture
def keep_signals():
    """Services install SIGTERM/SIGINT handlers: put pytest's back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _db99(srv: EmbeddedRedis) -> str:
    return srv.url.rsplit("/", 1)[0] + "/99"


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------ --log-level


def _collector(argv):
    from collector.__main__ import main

    return main(argv)


def _detector(argv):
    from detector.__main__ import main

    return main(argv)


def _scheduler(argv):
    from scheduler.__main__ import main

    return main(argv)


def _sim(argv):
    from trainer.__main__ import main

    return main(["sim", *argv])


def _dashboard(argv):
    from dashboard.__main__ import main

    return main(argv)


SERVICES = {
    "collector": _collector,
    "detector": _detector,
    "scheduler": _scheduler,
    "trainer": _sim,
    "dashboard": _dashboard,
}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_an_unknown_log_level_is_a_bad_setting(service, monkeypatch, capsys):
    # logging raised ValueError: a traceback, before --check-health could answer
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    with pytest.raises(SystemExit) as ei:
        SERVICES[service](["--log-level", "verbose", "--check-health"])
    assert ei.value.code == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"{service}: bad setting: log_level: 'verbose' is not a log level")
    assert "RESIHP_LOG_LEVEL" in err and "DEBUG, INFO, WARNING, ERROR, CRITICAL" in err
    monkeypatch.setenv("RESIHP_LOG_LEVEL", "Verbose")
    with pytest.raises(SystemExit):
        SERVICES[service](["--check-health"])
    assert "'Verbose' is not a log level" in capsys.readouterr().err


def test_log_levels_are_taken_in_any_case():
    assert entry.log_level("debug") == "DEBUG" and entry.log_level(" Warning ") == "WARNING"
    with pytest.raises(ValueError, match="log_level: 'verbose'"):
        entry.setup_logging("verbose")


# ------------------------------------------------------------------ bad settings


def test_detector_refuses_a_bad_job_id(monkeypatch, capsys):
    monkeypatch.setenv("RESIHP_JOB_ID", "my job")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    assert _detector([]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("detector: bad setting: ") and "'job_id'" in err
    assert "invalid job id 'my job'" in err


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--redis-url", "http://x"], "redis_url: Redis URL must specify one of"),
        (["--truth-out", "/nonexistent/dir/t.jsonl"], "truth_out: cannot write"),
        (["--heartbeat-interval-s", "inf"], "heartbeat_interval_s: must be a finite number > 0"),
        (["--heartbeat-interval-s", "nan"], "heartbeat_interval_s: must be a finite number > 0"),
        (["--speed", "inf"], "speed: must be a finite number >= 0"),
        (["--efficiency", "inf"], "efficiency: must be a finite number > 0"),
        (["--reconfig-base-s", "inf"], "reconfig_base_s: must be a finite number >= 0"),
        (["--probe-reference-s", "inf"], "probe_reference_s: must be a finite number > 0"),
        (["--job-id", "my job"], "job_id: invalid job id 'my job'"),
    ],
)
def test_trainer_sim_refuses_bad_settings_in_one_line(argv, msg, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    assert _sim(argv) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"trainer sim: bad setting: {msg}"), err


def test_trainer_sim_without_a_redis_url(monkeypatch, capsys):
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert _sim([]) == 2
    err = _one_line(capsys.readouterr().err)
    assert (
        err
        == "trainer sim: bad setting: redis_url: no Redis URL: pass --redis-url or set REDIS_URL\n"
    )
    assert _sim(["--check-health"]) == 1  # unhealthy, said as such
    assert "trainer: unhealthy: no Redis URL" in capsys.readouterr().err


def test_truth_out_names_what_is_wrong(tmp_path):
    from trainer.sim.config import SimConfig

    with pytest.raises(ValueError, match="truth_out: cannot write .*: it is a directory"):
        SimConfig(truth_out=str(tmp_path)).validate()
    with pytest.raises(ValueError, match=f"no directory {tmp_path / 'no'}"):
        SimConfig(truth_out=str(tmp_path / "no" / "t.jsonl")).validate()
    SimConfig(truth_out=str(tmp_path / "t.jsonl")).validate()
    assert not (tmp_path / "t.jsonl").exists()  # checked, not created


def test_the_heartbeat_keeper_lives_with_a_very_long_period(r):
    # a period past what Event.wait takes (~292 years) killed the keeper thread
    from trainer.sim.config import SimConfig
    from trainer.sim.service import SimTrainer

    cfg = SimConfig(job_id="hb", heartbeat_interval_s=1e12, speed=0, microbatches=2)
    tr = SimTrainer(cfg, r)
    try:
        tr.start()
        th = tr._keeper._thread
        th.join(0.3)
        assert th.is_alive()
    finally:
        tr.close()


def test_scheduler_refuses_an_unknown_model_and_a_negative_duration(monkeypatch, capsys):
    from scheduler.config import SchedulerConfig

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    assert _scheduler(["--model", "gpt5"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("scheduler: bad setting: model: unknown model 'gpt5'; known: [")
    assert _scheduler(["run", "--duration", "-5"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("scheduler: bad setting: duration: must be a finite number")
    assert _scheduler(["--duration", "nan"]) == 2
    capsys.readouterr()
    assert SchedulerConfig(model="Llama2-7B").model == "llama2-7b"  # preset names, any case
    assert SchedulerConfig(model="").model == ""  # empty: inferred from the layout
    with pytest.raises(ValueError, match="^job_id: invalid job id"):
        SchedulerConfig(job_id="a b")


def test_scheduler_errors_are_prefixed_and_it_logs_its_start(
    redis_server, r, monkeypatch, capsys, caplog, keep_signals
):
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert _scheduler([]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err == "scheduler: no Redis URL: pass --redis-url or set REDIS_URL\n"
    caplog.set_level(logging.INFO)
    argv = ["--redis-url", redis_server.url, "--job-id", "startlog", "--duration", "0.2"]
    assert _scheduler([*argv, "--model", "llama2-13b"]) == 0
    assert "scheduler: job startlog, mode auto, policy resihp, cost model llama2-13b" in caplog.text


# ------------------------------------------------------------------ an unusable Redis


def test_a_database_out_of_range_is_a_refusal(locked_redis):
    from resihp.redis_client import connect

    client = connect(_db99(locked_redis))
    with pytest.raises(entry.RedisRefused) as ei:
        entry.try_redis(client.ping, "svc", client)
    assert ei.value.code == 2
    assert ei.value.message.endswith("/99: DB index is out of range")
    assert PASSWORD not in ei.value.message
    with pytest.raises(entry.RedisRefused):
        entry.wait_for_redis(client.ping, "svc", client, retry_s=(0.01, 0.01))
    client.close()


@pytest.mark.parametrize("service", ["detector", "scheduler", "trainer sim"])
def test_services_end_in_one_line_on_a_database_out_of_range(
    service, locked_redis, monkeypatch, capsys
):
    monkeypatch.setenv("REDIS_URL", _db99(locked_redis))
    run = {"detector": _detector, "scheduler": _scheduler, "trainer sim": _sim}[service]
    with pytest.raises(SystemExit) as ei:  # entry.RedisRefused: before any signal handler
        run(["--job-id", "db99"])
    assert ei.value.code == 2
    err = _one_line(capsys.readouterr().err)
    port = locked_redis.port
    assert (
        err
        == f"{service}: cannot use Redis at redis://127.0.0.1:{port}/99: DB index is out of range\n"
    )


def test_collector_ends_in_one_line_on_a_database_out_of_range(locked_redis):
    out = subprocess.run(
        [sys.executable, "-m", "collector", "--redis-url", _db99(locked_redis)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.endswith("/99: DB index is out of range\n") and "Traceback" not in out.stderr
    assert PASSWORD not in out.stderr


# ------------------------------------------------------------------ --check-health


def _bad_urls(srv: EmbeddedRedis) -> dict[str, tuple[str, str]]:
    port = srv.port
    return {
        "db": (_db99(srv), f"redis://127.0.0.1:{port}/99: DB index is out of range"),
        "password": (
            f"redis://:wrongPW@127.0.0.1:{port}/0",
            f"redis://127.0.0.1:{port}/0: invalid username-password pair",
        ),
        "down": (f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", "Connection refused"),
    }


@pytest.mark.parametrize("case", ["db", "password", "down"])
@pytest.mark.parametrize("service", ["collector", "detector", "scheduler", "trainer"])
def test_check_health_says_why_redis_cannot_be_used(service, case, locked_redis, capsys):
    url, why = _bad_urls(locked_redis)[case]
    run = _sim if service == "trainer" else SERVICES[service]
    assert run(["--redis-url", url, "--check-health"]) == 1
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"{service}: unhealthy: cannot use Redis at ") and why in err, err
    assert PASSWORD not in err and "wrongPW" not in err


def test_health_check_raises_only_when_asked(locked_redis):
    from resihp.redis_client import connect

    keys = JobKeys("hc")
    client = connect(_db99(locked_redis))
    assert Health.check(client, keys, "collector") is False  # quiet by default
    with pytest.raises(Exception, match="DB index is out of range"):
        Health.check(client, keys, "collector", quiet=False)
    client.close()
    ok = locked_redis.client()
    ok.set(keys.health("collector", "0"), "not json")
    assert Health.check(ok, keys, "collector", quiet=False) is False  # unreadable: unhealthy
    ok.close()


# ------------------------------------------------------------------ passwords stay out


def test_detector_config_hides_the_password(locked_redis, capsys):
    assert _detector(["config", "--redis-url", _db99(locked_redis), "show"]) == 1
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(
        f"detector config: cannot use Redis at redis://:***@127.0.0.1:{locked_redis.port}/99"
    )
    assert PASSWORD not in err


def test_trainer_sim_refuses_a_redis_db_that_is_no_number(monkeypatch, capsys):
    """redis-py reads redis://host/abc as db 0; the project's client refuses it, which the
    simulator's entry point turned into a traceback."""
    monkeypatch.setenv("REDIS_URL", "redis://:pw@127.0.0.1:1/abc")
    assert _sim([]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("trainer sim: bad setting: redis_url: ") and "'abc'" in err, err
    assert "pw" not in err

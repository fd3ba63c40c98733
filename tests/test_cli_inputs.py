"""Command-line input checks: a bad argument is one clear line (exit 2), no traceback, and
nothing is started or written."""

from __future__ import annotations

import json

import pytest

from resihp.keys import JOBS_SET, JobKeys
from resihp.topology import Layout

LAY16 = Layout.uniform(tp=2, pp=4, dp=2, num_layers=16, num_microbatches=8)


# --------------------------------------------------------------- resihp config set


def _config(redis_server, job: str, *rest: str) -> int:
    from detector.__main__ import main

    return main(["config", "--redis-url", redis_server.url, "--job-id", job, *rest])


def test_config_refuses_an_unknown_job_and_names_the_known_ones(r, redis_server, capsys):
    r.sadd(JOBS_SET, "job-a", "job-b")
    assert _config(redis_server, "probe22", "set", "threshold=1.5") == 2
    err = capsys.readouterr().err
    assert "unknown job 'probe22'" in err and "job-a, job-b" in err, err
    assert not r.exists(JobKeys("probe22").detector_config)
    assert _config(redis_server, "probe22", "show") == 2
    assert "unknown job 'probe22'" in capsys.readouterr().err
    # a registered job, or one whose detector already seeded its hash, is known
    assert _config(redis_server, "job-a", "set", "threshold=1.5") == 0
    assert r.hget(JobKeys("job-a").detector_config, "threshold") == b"1.5"
    r.hset(JobKeys("seeded").detector_config, "threshold", "1.25")
    assert _config(redis_server, "seeded", "set", "threshold=1.3") == 0
    assert _config(redis_server, "seeded", "show") == 0
    capsys.readouterr()


def test_config_refuses_an_unknown_job_in_an_empty_redis(r, redis_server, capsys):
    assert _config(redis_server, "probe22", "set", "threshold=1.5") == 2
    err = capsys.readouterr().err
    assert err.startswith("detector config: unknown job 'probe22'") and "known jobs: none" in err
    assert "Traceback" not in err and r.keys("*") == []


def test_config_refuses_disabled_ranks_outside_the_layout(r, redis_server, capsys):
    keys = JobKeys("j16")
    r.sadd(JOBS_SET, "j16")
    r.set(keys.layout, json.dumps(LAY16.to_dict()))
    assert _config(redis_server, "j16", "set", "threshold=1.4", "disabled_ranks=[3, 99]") == 2
    err = capsys.readouterr().err
    assert "disabled_ranks: rank(s) 99 outside the job's 16 ranks (0-15)" in err, err
    assert not r.exists(keys.detector_config)  # all or nothing
    assert _config(redis_server, "j16", "set", "disabled_ranks=15,3") == 0
    assert r.hget(keys.detector_config, "disabled_ranks") == b"[3, 15]"
    # without a layout key there is nothing to check against
    r.sadd(JOBS_SET, "nolayout")
    assert _config(redis_server, "nolayout", "set", "disabled_ranks=[99]") == 0
    capsys.readouterr()


def test_config_refuses_a_field_given_twice(r, redis_server, capsys):
    r.sadd(JOBS_SET, "twice")
    assert _config(redis_server, "twice", "set", "threshold=1.3", "threshold=1.4") == 2
    err = capsys.readouterr().err
    assert "threshold: given twice" in err, err
    assert not r.exists(JobKeys("twice").detector_config)


# --------------------------------------------------------------- resihp report export


def test_report_export_refuses_a_bad_job_id(r, redis_server, tmp_path, capsys):
    from dashboard.__main__ import main

    r.sadd(JOBS_SET, "job-a")
    out = tmp_path / "x.md"
    argv = ["report", "export", "--incident", "X", "--format", "md", "--out", str(out)]
    rc = main([*argv, "--redis-url", redis_server.url, "--job-id", "bad id!"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("report export: invalid job id 'bad id!'"), err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


# --------------------------------------------------------------- resihp simulate


def test_simulate_refuses_an_unwritable_out_before_simulating(tmp_path, capsys):
    from scheduler.__main__ import main

    sc = tmp_path / "sc.yaml"
    sc.write_text("events:\n  - {at_s: 600, action: kill_device, rank: 5}\n")
    base = ["simulate", "--scenario", str(sc), "--policy", "resihp", "--model", "llama2-7b"]
    base += ["--duration-s", "1200"]
    missing = tmp_path / "nonexistent" / "x.json"
    assert main([*base, "--out", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"simulate: cannot write {missing}: "), err
    assert len(err.strip().splitlines()) == 1 and not missing.parent.exists()
    assert main([*base, "--out", str(tmp_path)]) == 2  # a directory
    assert "simulate: cannot write" in capsys.readouterr().err
    ok = tmp_path / "r.json"
    assert main([*base, "--out", str(ok), "--quiet"]) == 0
    assert json.loads(ok.read_text())["policy"] == "resihp"


# --------------------------------------------------------------- resihp up


def _up_args(tmp_path, *argv: str):
    from resihp.stack.cli import _build_parser

    st = tmp_path / "st"
    return _build_parser().parse_args(["up", "--state-dir", str(st), *argv]), st


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--duration", "-5"], "--duration must be a finite number of seconds > 0, got -5"),
        (["--duration", "0"], "--duration must be a finite number of seconds > 0, got 0"),
        (["--duration", "nan"], "--duration must be a finite number of seconds > 0, got nan"),
        (["--grace-period-s", "-3"], "--grace-period-s must be a finite number >= 0, got -3"),
        (["--grace-period-s", "inf"], "--grace-period-s must be a finite number >= 0, got inf"),
    ],
)
def test_up_refuses_bad_duration_and_grace_period_before_starting(tmp_path, argv, why):
    from resihp.stack.launcher import preflight

    args, st = _up_args(tmp_path, "--dashboard-port", "0", *argv)
    assert preflight(args) == why
    assert not st.exists()  # nothing made, nothing started


def test_up_accepts_a_positive_duration_and_a_zero_grace_period(tmp_path):
    from resihp.stack.launcher import check_up_numbers

    args, _ = _up_args(tmp_path, "--duration", "2.5", "--grace-period-s", "0")
    assert check_up_numbers(args) is None


# --------------------------------------------------------------- scenario files


@pytest.mark.parametrize("text", ["", "\n  \n", "# nothing yet\n", "~\n"])
def test_an_empty_scenario_file_is_an_error(tmp_path, text, capsys):
    from resihp.scenario import ScenarioError, load_scenario, main

    f = tmp_path / "e.yaml"
    f.write_text(text)
    with pytest.raises(ScenarioError, match=rf"^{f}:1: empty scenario file"):
        load_scenario(f)
    assert main(["check", str(f)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"scenario: {f}:1: empty scenario file")


def test_an_empty_json_scenario_file_is_empty_not_invalid(tmp_path):
    from resihp.scenario import ScenarioError, load_scenario

    f = tmp_path / "e.json"
    f.write_text("")
    with pytest.raises(ScenarioError, match=rf"^{f}:1: empty scenario file"):
        load_scenario(f)


def test_a_scenario_mapping_without_events_is_an_error(tmp_path):
    from resihp.scenario import ScenarioError, load_scenario

    f = tmp_path / "n.yaml"
    f.write_text("# header\nname: forgot them\n")
    with pytest.raises(ScenarioError, match=rf"^{f}:2: no events"):
        load_scenario(f)


def test_an_explicitly_empty_event_list_is_allowed_and_check_says_so(tmp_path, capsys):
    from resihp.scenario import load_scenario, main

    for name, text in (("y.yaml", "name: calm\nevents: []\n"), ("j.json", '{"events": []}')):
        f = tmp_path / name
        f.write_text(text)
        assert load_scenario(f).events == []
        assert main(["check", str(f)]) == 0
        assert capsys.readouterr().out == f"{f}: 0 events (a run without failures)\n"


def test_up_refuses_an_empty_scenario_file(tmp_path):
    from resihp.stack.launcher import preflight

    f = tmp_path / "e.yaml"
    f.write_text("")
    args, _ = _up_args(tmp_path, "--dashboard-port", "0", "--scenario", str(f))
    assert preflight(args) == f"scenario: {f}:1: " + (
        "empty scenario file (no events; write 'events: []' for a run without failures)"
    )


# --------------------------------------------------------------- resihp act


@pytest.mark.redis
def test_act_refuses_an_empty_actor_and_an_empty_set_mode_before_sending(
    redis_server, monkeypatch, capsys
):
    """With USER set but empty (containers, cron) the action went out with no actor; the
    scheduler dead-lettered it at once while the CLI waited for a verdict and said it was
    queued. set_mode with nothing to set went out as a no-op reported as accepted."""
    from resihp.redis_client import connect
    from scheduler.__main__ import main

    url = ["--redis-url", redis_server.url, "--job-id", "actors"]
    r = connect(redis_server.url)
    r.sadd(JOBS_SET, "actors")  # a job act knows (an unknown one is refused)
    actions = JobKeys("actors").actions
    for argv in (["--actor", "  "], ["--actor", ""]):
        assert main(["act", "set_mode", "--override", '{"mode": "manual"}', *argv, *url]) == 2
        err = capsys.readouterr().err
        assert err.strip() == "act: OperatorAction.actor must name who acted", err
    assert main(["act", "set_mode", *url, "--actor", "alice"]) == 2
    assert "set_mode needs --override" in capsys.readouterr().err
    assert r.xlen(actions) == 0  # nothing sent
    monkeypatch.setenv("USER", "")
    rc = main(["act", "set_mode", "--override", '{"mode": "manual"}', "--wait-s", "0", *url])
    assert rc == 0 and "as cli (action " in capsys.readouterr().out
    assert r.xlen(actions) == 1


# --------------------------------------------------------------- resihp record


def _record(redis_server, job: str, out) -> int:
    from collector.__main__ import main

    return main(["--redis-url", redis_server.url, "--job-id", job, "record", "--out", str(out)])


def test_record_refuses_an_unknown_job_and_names_the_known_ones(r, redis_server, tmp_path, capsys):
    """A mistyped job id recorded an empty trace and exited 0, which reads as a job that
    sent nothing; `resihp config` and `resihp status` refuse the same typo."""
    r.sadd(JOBS_SET, "job-a", "job-b")
    out = tmp_path / "x.jsonl"
    assert _record(redis_server, "nosuch", out) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "collector record: unknown job 'nosuch' in this Redis (known jobs: job-a, job-b); "
        "pass --job-id"
    ), err
    assert not out.exists()  # nothing written, not even an empty trace
    # a registered job, or one with anything stored under its name, is recorded
    assert _record(redis_server, "job-a", out) == 0
    r.set(JobKeys("unregistered").layout, json.dumps(LAY16.to_dict()))
    assert _record(redis_server, "unregistered", out) == 0
    assert json.loads(out.read_text().splitlines()[0])["type"] == "layout"
    capsys.readouterr()


# --------------------------------------------------------------- resihp config set: who applies


def test_config_set_says_no_detector_applies_it_when_none_runs(r, redis_server, capsys):
    """`config set` said "the running detector applies it within one loop" for a job with
    no detector; `config show` said "(no detector)" for the same job."""
    from resihp.bus import Health

    keys = JobKeys("quiet")
    r.sadd(JOBS_SET, "quiet")
    assert _config(redis_server, "quiet", "set", "threshold=2") == 0
    out = capsys.readouterr().out
    assert "threshold: - -> 2.0" in out
    assert "no detector is running for job 'quiet'" in out and "applies it within" not in out
    Health(r, keys, "detector").beat()
    assert _config(redis_server, "quiet", "set", "threshold=1.5") == 0
    out = capsys.readouterr().out
    assert "the running detector applies it within one loop" in out
    assert "no detector" not in out and "collector" not in out
    Health(r, keys, "collector").beat()
    assert _config(redis_server, "quiet", "set", "heartbeat_k=3") == 0
    assert "the running collector follows heartbeat_k" in capsys.readouterr().out


def test_config_show_takes_heartbeat_k_from_the_collector(r, redis_server, capsys):
    """K is the collector's to apply: `show` printed the detector's parsed copy as applied
    while the collector followed another K."""
    from resihp.bus import Health

    keys = JobKeys("kk")
    r.sadd(JOBS_SET, "kk")
    r.hset(keys.detector_config, "heartbeat_k", "3")
    Health(r, keys, "detector").beat(config={"heartbeat_k": "2", "threshold": "1.25"})
    Health(r, keys, "collector").beat(heartbeat_k=3)
    assert _config(redis_server, "kk", "show") == 0
    rows = {x.split()[0]: x.split()[1:] for x in capsys.readouterr().out.splitlines()[1:]}
    assert rows["heartbeat_k"] == ["3", "3", "2"] and rows["threshold"][1] == "1.25"


@pytest.mark.redis
@pytest.mark.parametrize(
    ("action", "override", "why"),
    [
        ("set_mode", '{"grace_period_s": NaN}', "--override holds NaN, not a number JSON allows"),
        ("set_mode", '{"grace_period_s": 1e309}', "--override holds 1e309, a number out of range"),
        ("acknowledge", '{"a": Infinity}', "--override holds Infinity, not a number JSON allows"),
        ("override", '{"layers": [-Infinity]}', "--override holds -Infinity"),
    ],
)
def test_act_refuses_non_finite_numbers_in_one_line(redis_server, action, override, why, capsys):
    """NaN / Infinity / 1e309 in --override crashed `act` with a traceback (exit 1)."""
    from resihp.redis_client import connect
    from scheduler.__main__ import main

    r = connect(redis_server.url)
    r.sadd(JOBS_SET, "nan")
    url = ["--redis-url", redis_server.url, "--job-id", "nan", "--actor", "fay"]
    assert main(["act", action, "--plan-id", "1", "--override", override, *url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(why) and len(err.strip().splitlines()) == 1, err
    assert r.xlen(JobKeys("nan").actions) == 0  # nothing sent


@pytest.mark.redis
def test_act_set_mode_refuses_misspelled_fields_before_sending(redis_server, capsys):
    """{"grace_period": 30, "mod": "manual"} was sent, audited 'ok', changed nothing, exit 0."""
    from resihp.redis_client import connect
    from scheduler.__main__ import main

    r = connect(redis_server.url)
    r.sadd(JOBS_SET, "typo")
    url = ["--redis-url", redis_server.url, "--job-id", "typo", "--actor", "fay"]
    ov = '{"grace_period": 30, "mod": "manual"}'
    assert main(["act", "set_mode", "--override", ov, *url]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "--override: unknown set_mode field(s) ['grace_period', 'mod']; "
        "allowed ['mode', 'grace_period_s', 'delta']"
    ), err
    assert main(["act", "set_mode", "--override", '{"mode": "sometimes"}', *url]) == 2
    assert "mode: must be one of ('auto', 'manual')" in capsys.readouterr().err
    assert r.xlen(JobKeys("typo").actions) == 0


@pytest.mark.redis
def test_act_names_an_unknown_job_and_a_state_dir_without_a_stack(
    r, redis_server, monkeypatch, capsys
):
    """`act --job-id nosuchjob` said "job 'nosuchjob' has no plan 2; it has no plans"; with a
    state dir where no stack runs it said "no Redis URL"."""
    from scheduler.__main__ import main

    r.sadd(JOBS_SET, "job-a", "job-b")
    url = ["--redis-url", redis_server.url, "--actor", "fay"]
    for action in (["acknowledge", "--plan-id", "2"], ["set_mode", "--override", '{"delta": 1}']):
        assert main(["act", *action, *url, "--job-id", "nosuchjob"]) == 1
        err = capsys.readouterr().err.strip()
        assert err == (
            "act: job 'nosuchjob' is not in this Redis (known jobs: job-a, job-b); pass --job-id"
        ), err
    assert r.xlen(JobKeys("nosuchjob").actions) == 0
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("RESIHP_STATE_DIR", "/tmp/nowhere")
    assert main(["act", "acknowledge", "--plan-id", "2", "--actor", "fay"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("act: no `resihp up` stack runs from /tmp/nowhere: "), err
    monkeypatch.delenv("RESIHP_STATE_DIR")
    assert main(["act", "acknowledge", "--plan-id", "2", "--actor", "fay"]) == 2
    err = capsys.readouterr().err
    assert "no `resihp up` stack runs from the state dir (--state-dir, default .resihp)" in err


# --------------------------------------------------------------- resihp status | head


@pytest.mark.redis
def test_status_into_a_closed_pipe_exits_quietly(r, redis_server):
    """`resihp status ... | head -3` ended with a BrokenPipeError traceback once head had
    read its lines: a reader that goes away is not an error."""
    import os
    import subprocess
    import sys

    r.sadd(JOBS_SET, "job-a")
    r.set(JobKeys("job-a").layout, json.dumps(LAY16.to_dict()))
    rd, wr = os.pipe()
    os.close(rd)  # the reader (head) has gone before the first line
    try:
        p = subprocess.run(
            [sys.executable, "-m", "resihp.stack.cli", "status", "--redis-url", redis_server.url],
            stdout=wr,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(wr)
    assert p.returncode == 0 and p.stderr == "", p.stderr

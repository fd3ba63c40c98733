"""`resihp up` brings the stack up on the embedded Redis and down with no orphans;
`resihp status --json` reads the live state."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resihp.redis_client import free_port

# Marked per test: the tests that run a whole stack (embedded redis-server, services,
# trainer) are redis and slow; the launcher's unit tests stay in a -m "not slow" pass.


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); treat it as dead
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.fixture
def fake_launcher():
    """A live process whose command line reads like `resihp up` (what a stack file's pid
    must be, to count as a running stack)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "resihp", "up"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.mark.redis
@pytest.mark.slow
def test_up_runs_reports_status_and_stops_cleanly_on_sigterm(tmp_path):
    port = free_port()
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "resihp.stack.cli",
            "up",
            "--state-dir",
            str(tmp_path),
            "--dashboard-port",
            str(port),
            "--trainer-arg=--speed=20",
            "--duration",
            "90",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    stack_file = tmp_path / "stack.json"
    deadline = time.time() + 60
    while not stack_file.exists() and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    stack = json.loads(stack_file.read_text())
    children = list(stack["children"].values())
    # status --json reads the live stack through the URL `up` recorded
    st = None
    deadline = time.time() + 60
    while time.time() < deadline:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "resihp.stack.cli",
                "status",
                "--json",
                "--state-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        job = st["jobs"].get("default")
        if job and job["last_iteration"] and len(job["services"]) >= 2:
            break
        time.sleep(1)
    assert st["redis_url"].startswith("redis://127.0.0.1:")
    job = st["jobs"]["default"]
    assert job["last_iteration"]["iteration"] >= 0
    assert job["counts"]["iterations_total"] >= 1
    # the stack file (it holds the Redis URL) is its owner's alone, and no child carries
    # the URL on its command line, where ps shows it to everyone
    assert stack_file.stat().st_mode & 0o777 == 0o600
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--redis-url" not in argv and not any(b"redis://" in a for a in argv), argv
    # forwarded commands find this stack by its --state-dir, and speak as `resihp`
    cli = [sys.executable, "-m", "resihp.stack.cli"]
    rec = subprocess.run(
        [
            *cli,
            "record",
            "--state-dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "t.jsonl"),
            "--duration",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert rec.returncode == 0 and "recorded" in rec.stderr, rec.stderr
    act = subprocess.run(
        [*cli, "act", "acknowledge", "--plan-id", "99", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert act.returncode == 1 and "job 'default' has no plan 99" in act.stderr, act.stderr
    usage = subprocess.run([*cli, "act"], capture_output=True, text=True, env=env, timeout=60)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: resihp act"), usage.stderr
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out  # stopped by a signal: 128 + 15, after a clean stop
    assert "stopped" in out and "dashboard at http://127.0.0.1:" in out
    time.sleep(0.5)
    assert [p for p in children if _alive(p)] == [], "orphaned service processes"
    assert not stack_file.exists()

    # the stop marked the job finished: its silence from now on is not a failure
    from resihp.bus import job_state
    from resihp.keys import JobKeys
    from resihp.redis_client import EmbeddedRedis
    from resihp.stack.status import job_status
    from resihp.wire import decode_entry

    srv = EmbeddedRedis(data_dir=str(tmp_path / "redis")).start()
    try:
        client = srv.client()
        assert job_state(client, JobKeys("default")) == "finished"
        # and the stopped services' health keys are gone (a --fresh right after may go on)
        assert list(client.scan_iter(match=JobKeys("default").health_pattern())) == []
        stopped_at = job_status(client, "default")["last_iteration"]["iteration"]
        client.close()
    finally:
        srv.stop()
    # a new run under the same job would mix with the old one: refused before anything starts
    up = [
        sys.executable,
        "-m",
        "resihp.stack.cli",
        "up",
        "--state-dir",
        str(tmp_path),
        "--no-summary",
        "--dashboard-port",  # not the default 8050: another stack (or test) may hold it
        str(free_port()),
    ]
    again = subprocess.run([*up, "--duration", "5"], capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "already holds a run" in again.stderr, again.stderr
    assert "--fresh" in again.stderr and "--resume" in again.stderr
    # --resume carries the run on: the simulator continues after its last iteration, and
    # the restart is no failure
    res = subprocess.run(
        [*up, "--resume", "--duration", "15", "--trainer-arg=--speed=20"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert f"resuming job 'default' (last iteration {stopped_at}," in res.stdout, res.stdout
    srv = EmbeddedRedis(data_dir=str(tmp_path / "redis")).start()
    try:
        client = srv.client()
        st = job_status(client, "default")
        assert st["last_iteration"]["iteration"] > stopped_at + 5, (stopped_at, st)
        its = [
            m.iteration
            for _, f in client.xrange(JobKeys("default").iterations)
            for m in decode_entry(f)[0]
        ]
        assert its == sorted(its) and len(its) == len(set(its)), its  # one run, in order
        assert st["counts"]["failures_total"] == 0, st["latest_failures"]
        client.close()
    finally:
        srv.stop()


def _up(tmp_path, *argv, timeout=120):
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "resihp.stack.cli",
            "up",
            "--state-dir",
            str(tmp_path / "st"),
            "--no-summary",
            "--duration",
            "30",
            "--dashboard-port",  # a free one (argv may name its own): 8050 may be held
            str(free_port()),
            *argv,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_up_refuses_what_would_fail_before_starting_anything(tmp_path):
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "bad.yaml"
    bad.write_text("events:\n  - {at_s: 1, action: kill_device, rank: 1, colour: red}\n")
    with __import__("socket").create_server(("127.0.0.1", 0)) as held:
        port = str(held.getsockname()[1])
        for argv, why in (
            (["--job-id", "bad id!"], "invalid job id 'bad id!'"),
            (["--scenario", str(bad)], "scenario: " + str(bad) + ":2: unknown key 'colour'"),
            (["--model", "nosuch"], "unknown model 'nosuch'"),
            (["--dashboard-port", port], f"the dashboard cannot listen on 127.0.0.1:{port}"),
            (["--dashboard-port", "70000"], "--dashboard-port 70000 is not a TCP port"),
        ):
            out = _up(tmp_path, *argv)
            assert out.returncode == 2, (argv, out.stderr)
            assert f"resihp up: {why}" in out.stderr and "Traceback" not in out.stderr, out.stderr
            assert not (tmp_path / "st" / "stack.json").exists()
    out = _up(tmp_path, "--state-dir", str(tmp_path / "file"))
    assert out.returncode == 2 and "cannot use state dir" in out.stderr, out.stderr


@pytest.mark.redis
@pytest.mark.slow
def test_up_stops_and_fails_when_a_child_cannot_start(tmp_path):
    out = _up(tmp_path, "--trainer-arg=--no-such-flag")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "trainer exited with code 2" in out.stdout
    assert "resihp up: trainer failed to start; stopping the stack" in out.stderr
    assert "resihp: stopped" in out.stdout and not (tmp_path / "st" / "stack.json").exists()


def test_passwords_are_not_printed():
    from resihp.redis_client import redact

    assert redact("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("rediss://bob:pw@h:1") == "rediss://bob:***@h:1"
    assert redact("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"
    env = dict(os.environ, REDIS_URL="redis://:s3cret@127.0.0.1:1/0")
    out = subprocess.run(
        [sys.executable, "-m", "resihp.stack.cli", "status"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 1 and "s3cret" not in out.stderr and ":***@" in out.stderr


def test_status_without_stack_says_what_to_do(tmp_path):
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    out = subprocess.run(
        [sys.executable, "-m", "resihp.stack.cli", "status", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert out.returncode == 2 and "resihp up" in out.stderr


def _up_args(*argv):
    from resihp.stack.cli import _build_parser

    return _build_parser().parse_args(["up", *argv])


def test_torch_trainer_defaults_to_the_small_real_job_unless_told_otherwise():
    from resihp.stack.launcher import service_commands

    def trainer_argv(*argv):
        cmds = dict(service_commands(_up_args("--trainer", "torch", *argv), "redis://x"))
        return cmds["trainer"]

    a = trainer_argv()
    assert a[:2] == ["trainer", "torch"]
    for flag, value in (("--tp", "2"), ("--pp", "2"), ("--dp", "2"), ("--iterations", "1000000")):
        assert a[a.index(flag) + 1] == value
    assert a[a.index("--out-dir") + 1] == str(Path(_up_args().state_dir) / "torch" / "default")
    b = trainer_argv("--trainer-arg=--tp=1", "--trainer-arg=--iterations=30")
    assert "--tp" not in b and "--iterations" not in b
    assert b[-2:] == ["--tp=1", "--iterations=30"] and b[b.index("--dp") + 1] == "2"


def test_a_failed_child_is_reported_with_its_last_log_line(tmp_path):
    from resihp.stack.launcher import _last_line

    log = tmp_path / "trainer.log"
    log.write_text("starting\nerror: scenario.yaml:2: rank 9 outside the job's 8 ranks\n\n")
    assert _last_line(log) == "error: scenario.yaml:2: rank 9 outside the job's 8 ranks"
    assert _last_line(tmp_path / "missing.log") == ""


@pytest.mark.redis
def _fake_ckpt(ckpt, step: int) -> None:
    """A complete torch checkpoint step as the trainer lays it out (resihp/checkpoints.py):
    its layout and a readable archive per working rank."""
    import zipfile

    from resihp.checkpoints import STEP_LAYOUT, ckpt_path, step_dir
    from resihp.topology import Layout

    lay = Layout.uniform(tp=1, pp=2, dp=1, num_layers=2, num_microbatches=2)
    step_dir(ckpt, step).mkdir(parents=True)
    (step_dir(ckpt, step) / STEP_LAYOUT).write_text(json.dumps(lay.to_dict()))
    for rank in lay.active_ranks():
        with zipfile.ZipFile(ckpt_path(ckpt, step, rank), "w") as z:
            z.writestr("data.pkl", "x")


def test_a_new_run_of_a_job_with_history_is_told_and_fresh_clears_only_that_job(r, tmp_path):
    from resihp import bus
    from resihp.keys import JobKeys
    from resihp.stack.launcher import JobInUse, prepare_job

    old, other = JobKeys("prod"), JobKeys("other")
    assert prepare_job(r, "prod", fresh=False) is None  # a new job: nothing to say
    for k in (old, other):
        bus.register_job(r, k)
        r.xadd(k.failures, {"m": "x"})
        r.hset(k.counters, "heartbeats_total", 5)
    # a new run would be mixed with the old one: refused, with the ways out
    with pytest.raises(JobInUse, match="1 failure reports") as e:
        prepare_job(r, "prod", fresh=False)
    assert "--fresh" in str(e.value) and "--job-id" in str(e.value)
    # no trainer: the services just show the old run
    note = prepare_job(r, "prod", fresh=False, new_run=False)
    assert "already holds a run" in note and "showing it" in note
    assert r.xlen(old.failures) == 1  # nothing deleted
    # --resume: the trainer carries the run on; a job without one is just started
    note = prepare_job(r, "prod", fresh=False, resume=True)
    assert note.startswith("resihp: resuming job 'prod' (last iteration -,"), note
    assert "holds no run" in prepare_job(r, "new-one", fresh=False, resume=True)
    assert r.xlen(old.failures) == 1
    # ... by the kind of trainer that ran it (the torch trainer started at 0 under a sim run)
    bus.set_job_state(r, old, "running", trainer="sim")
    bus.set_job_state(r, old, "finished", reason="stopped")  # the kind stays
    with pytest.raises(JobInUse, match="trained by the sim trainer: --resume needs --trainer sim"):
        prepare_job(r, "prod", fresh=False, resume=True, trainer="torch")
    # ... and the torch trainer only from a checkpoint
    bus.set_job_state(r, old, "running", trainer="torch")
    ckpt = tmp_path / "ckpt"
    with pytest.raises(JobInUse, match="no complete checkpoint in .* iteration 0"):
        prepare_job(r, "prod", fresh=False, resume=True, trainer="torch", ckpt_dir=str(ckpt))
    _fake_ckpt(ckpt, step=5)
    note = prepare_job(r, "prod", fresh=False, resume=True, trainer="torch", ckpt_dir=str(ckpt))
    assert note.endswith("from the torch trainer's checkpoint of step 5"), note
    # checkpoints are a run too: not picked up unannounced by a new job's torch trainer
    with pytest.raises(JobInUse, match=r"holds checkpoints of job 'new-one' .*\(step 5\)"):
        prepare_job(r, "new-one", fresh=False, trainer="torch", ckpt_dir=str(ckpt))
    assert prepare_job(r, "new-one", fresh=False, trainer="sim") is None

    # the keys of a crashed stack's services (their processes gone) hold nothing
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    r.set(
        old.health("collector", "0"),
        json.dumps({"status": "ok", "pid": dead_pid.pid, "host": socket.gethostname()}),
        px=10_000,
    )
    assert "resuming" in prepare_job(r, "prod", fresh=False, resume=True)
    r.delete(old.health("collector", "0"))
    # services of the job still running: --fresh refuses instead of deleting under them
    bus.Health(r, old, "detector").beat()
    with pytest.raises(JobInUse, match="detector"):
        prepare_job(r, "prod", fresh=True)
    with pytest.raises(JobInUse, match="detector.*--resume starts the job again"):
        prepare_job(r, "prod", fresh=False, resume=True)
    assert r.xlen(old.failures) == 1
    r.delete(old.health("detector", "0"))
    bus.Health(r, old, "dashboard").beat()  # a dashboard only reads: it does not hold the job

    note = prepare_job(r, "prod", fresh=True)
    # failures, counters, job state, dashboard health
    assert "starts fresh" in note and "4 keys" in note
    assert not list(r.scan_iter(match=f"{old.base}:*"))
    assert bus.list_jobs(r) == ["other"]
    assert r.xlen(other.failures) == 1 and r.hget(other.counters, "heartbeats_total") == b"5"
    assert prepare_job(r, "prod", fresh=False) is None


def test_demo_runs_as_its_own_fresh_job_unless_a_job_id_is_given(monkeypatch):
    from resihp.stack.launcher import resolve_job

    monkeypatch.delenv("RESIHP_JOB_ID", raising=False)
    a = _up_args("--demo")
    assert resolve_job(a) == "demo" and a.fresh
    b = _up_args("--demo", "--job-id", "mine")
    assert resolve_job(b) == "mine" and not b.fresh
    c = _up_args()
    assert resolve_job(c) == "default" and not c.fresh
    monkeypatch.setenv("RESIHP_JOB_ID", "from-env")
    d = _up_args()
    assert resolve_job(d) == "from-env"
    with pytest.raises(ValueError, match="invalid job id"):
        resolve_job(_up_args("--job-id", "bad id"))


def test_forwarded_commands_default_to_the_running_stack(tmp_path, monkeypatch, fake_launcher):
    from resihp.stack import cli
    from resihp.stack.status import STACK_FILE

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("RESIHP_JOB_ID", raising=False)
    seen = {}

    def fake_execve(path, argv, env):
        seen.update(argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execve", fake_execve)
    with pytest.raises(SystemExit):  # no stack: nothing filled in
        cli.main(["report", "export", "--incident", "1"])
    assert "REDIS_URL" not in seen["env"] and "RESIHP_JOB_ID" not in seen["env"]
    assert seen["argv"][1:] == ["-m", "dashboard", "report", "export", "--incident", "1"]

    (tmp_path / ".resihp").mkdir()
    (tmp_path / ".resihp" / STACK_FILE).write_text(
        json.dumps(
            {"redis_url": "redis://127.0.0.1:41234/0", "job_id": "demo", "pid": fake_launcher}
        )
    )
    with pytest.raises(SystemExit):
        cli.main(["act", "ack", "3"])
    assert seen["env"]["REDIS_URL"] == "redis://127.0.0.1:41234/0"
    assert seen["env"]["RESIHP_JOB_ID"] == "demo"
    monkeypatch.setenv("RESIHP_JOB_ID", "prod")  # the environment wins
    with pytest.raises(SystemExit):
        cli.main(["act", "ack", "3"])
    assert seen["env"]["RESIHP_JOB_ID"] == "prod"


def test_a_second_stack_on_the_same_state_dir_is_refused(tmp_path, capsys, fake_launcher):
    from resihp.lifetime import pid_alive
    from resihp.stack import cli
    from resihp.stack.status import STACK_FILE, running_stack

    state = tmp_path / "state"
    state.mkdir()
    stack = {"redis_url": "redis://127.0.0.1:1/0", "job_id": "prod", "pid": fake_launcher}
    (state / STACK_FILE).write_text(json.dumps(stack))
    rc = cli.main(
        ["up", "--state-dir", str(state), "--trainer", "none", "--duration", "1",
         "--dashboard-port", str(free_port())]
    )  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert f"pid {fake_launcher}" in err and "'prod'" in err and "--state-dir" in err
    assert not (state / "redis").exists()  # refused before any redis-server started
    # a pid the system has since given to another program is no stack
    (state / STACK_FILE).write_text(json.dumps({**stack, "pid": os.getpid()}))
    assert running_stack(str(state)) is None

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert pid_alive(os.getpid()) and not pid_alive(p.pid)
    assert not pid_alive(None) and not pid_alive("12")
    # the file of a stack whose process is gone is stale: ignored, and a new stack may start
    (state / STACK_FILE).write_text(json.dumps({**stack, "pid": p.pid}))
    assert running_stack(str(state)) is None


@pytest.mark.redis
def test_what_a_crashed_stack_left_running_is_stopped_and_nothing_else(tmp_path, fake_launcher):
    from resihp.redis_client import EmbeddedRedis
    from resihp.stack.launcher import stop_stale_stack
    from resihp.stack.status import STACK_FILE

    srv = EmbeddedRedis(data_dir=str(tmp_path / "redis")).start()  # not tied to us
    srv.client().set("kept", "1")
    svc = subprocess.Popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    bystander = subprocess.Popen(["sleep", "60"])  # a recycled pid: not the stack's any more
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stack = {
        "redis_url": srv.url,
        "job_id": "prod",
        "pid": dead.pid,
        "redis_pid": srv.pid,
        "children": {"http.server": svc.pid, "collector": bystander.pid},
    }
    (tmp_path / STACK_FILE).write_text(json.dumps(stack))
    try:
        said = stop_stale_stack(tmp_path)
        assert said is not None and f"pid {dead.pid}" in said
        assert f"http.server (pid {svc.pid})" in said and f"redis-server (pid {srv.pid})" in said
        assert "collector" not in said
        assert svc.wait(5) is not None and srv.proc.wait(5) == 0  # redis shut down cleanly
        assert bystander.poll() is None
        # its data survived: a new server on the same directory has it
        srv2 = EmbeddedRedis(data_dir=str(tmp_path / "redis")).start()
        assert srv2.client().get("kept") == b"1"
        srv2.stop()
        # a live stack is never touched, and nothing left means nothing said
        assert stop_stale_stack(tmp_path) is None
        (tmp_path / STACK_FILE).write_text(json.dumps({**stack, "pid": fake_launcher}))
        assert stop_stale_stack(tmp_path) is None
    finally:
        bystander.kill()
        svc.kill()
        srv.stop()


@pytest.mark.redis
@pytest.mark.slow
def test_a_stack_killed_with_sigkill_takes_its_children_along_and_leaves_no_false_failure(
    tmp_path,
):
    """`kill -9` on `resihp up` (the OOM killer does the same): its redis-server, services
    and trainer follow it, and a stack started next to show the job does not report the
    killed job's ranks dead."""
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    up = [
        sys.executable,
        "-m",
        "resihp.stack.cli",
        "up",
        "--state-dir",
        str(tmp_path),
        "--no-summary",
    ]
    proc = subprocess.Popen(
        [*up, "--dashboard-port", str(free_port()), "--trainer-arg=--speed=20", "--duration", "90"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env=env,
    )
    stack_file = tmp_path / "stack.json"
    deadline = time.time() + 60
    stack = {}
    while time.time() < deadline and "trainer" not in stack.get("children", {}):
        assert proc.poll() is None
        time.sleep(0.2)
        try:
            stack = json.loads(stack_file.read_text())
        except (OSError, ValueError):
            pass
    from resihp.bus import job_state
    from resihp.keys import JobKeys
    from resihp.redis_client import connect

    keys = JobKeys("default")
    client = connect(stack["redis_url"])
    deadline = time.time() + 60
    while time.time() < deadline and client.xlen(keys.iterations) < 3:
        time.sleep(0.2)
    assert client.xlen(keys.iterations) >= 3
    client.close()
    pids = [stack["redis_pid"], *stack["children"].values()]
    proc.kill()
    proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:  # never leave them to the next test
        os.killpg(p, signal.SIGKILL)
    assert left == [], "the stack's processes outlived it"
    # A collector counts telemetry from up to one fail-stop deadline (2.5 s here) before
    # it started as the job's present; a restart that fast would (rightly) judge the
    # killed trainer's ranks. The next stack comes later than that, as a person's would.
    time.sleep(3.0)

    # the next stack shows the job: several fail-stop deadlines pass, nothing is reported
    out = subprocess.run(
        [*up, "--trainer", "none", "--duration", "15", "--dashboard-port", str(free_port())],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no trainer started: showing it" in out.stdout
    from resihp.redis_client import EmbeddedRedis

    srv = EmbeddedRedis(data_dir=str(tmp_path / "redis")).start()
    try:
        c = srv.client()
        assert job_state(c, keys) == "running"  # nobody said it finished
        assert c.xlen(keys.liveness) == 0 and c.xlen(keys.failures) == 0
        c.close()
    finally:
        srv.stop()
    log = (tmp_path / "logs" / "collector.log").read_text()
    assert "is silent" in log


def test_status_says_what_the_trainer_last_said_and_whether_silence_is_judged():
    from resihp.stack.status import format_status

    js = {
        "job_id": "prod",
        "job_state": {"state": "running", "at_s": 1.0e9},
        "services": {"collector:0": {"status": "ok", "pid": 7, "judging_liveness": False}},
        "layout_summary": "DP2xPP2",
        "last_iteration": None,
        "counts": {},
        "plans_by_state": {},
        "open_failures": 0,
    }
    out = format_status({"redis_url": "redis://x", "jobs": {"prod": js}})
    assert "job: running since 2001-09-" in out and "no fail-stop verdicts until it reports" in out
    js["job_state"] = {"state": "finished", "reason": "stopped by resihp up"}
    out = format_status({"redis_url": "redis://x", "jobs": {"prod": js}})
    assert "job: finished (stopped by resihp up)" in out and "verdicts" not in out
    js["job_state"] = None
    assert "job: state unknown (the trainer never said)" in format_status(
        {"redis_url": "redis://x", "jobs": {"prod": js}}
    )


@pytest.mark.redis
def test_status_lists_plans_awaiting_a_decision_and_recent_failures(redis_server, r):
    from dashboard_scenario import publish_job

    from resihp.keys import JobKeys
    from resihp.plans import latest_plans
    from resihp.stack.status import collect_status, format_status

    publish_job(r, "job-a", iterations=20, slow_from=12)
    r.xadd(JobKeys("job-a").failures, {b"m": b"not json"})  # a stray entry hides nothing
    st = collect_status(redis_server.url, "job-a")
    js = st["jobs"]["job-a"]
    assert [p["plan_id"] for p in js["awaiting_plans"]] == [1]
    assert [f["report_id"] for f in js["recent_failures"]] == ["fr-slow-1"]
    out = format_status(st)
    assert "plan 1 proposed: " in out and "(predicted iteration " in out
    assert "decide: resihp act acknowledge|reject --plan-id 1 --job-id job-a" in out
    assert "failure fr-slow-1: fail_slow_compute ranks [5] at iteration 15" in out
    # once decided, the plan no longer waits on anyone
    keys = JobKeys("job-a")
    plan = latest_plans(r, keys)[1]
    plan.state = "applied"
    r.hset(keys.plan_state, "1", plan.to_json())
    js = collect_status(redis_server.url, "job-a")["jobs"]["job-a"]
    assert js["awaiting_plans"] == [] and "decide:" not in format_status(
        {"redis_url": "x", "jobs": {"job-a": js}}
    )


def test_restart_policy_backs_off_and_gives_up_on_a_crash_loop():
    from resihp.stack.launcher import RestartPolicy

    pol = RestartPolicy(max_restarts=3, window_s=100.0, max_backoff_s=3.0)
    assert pol.on_exit("detector", 0.0) == 1.0
    assert pol.on_exit("detector", 10.0) == 12.0
    assert pol.on_exit("collector", 10.0) == 11.0  # counted per service
    assert pol.on_exit("detector", 20.0) == 23.0  # 4 s capped at 3
    assert pol.on_exit("detector", 30.0) is None  # a 4th crash within 100 s: left down
    # crashes older than the window are forgotten
    assert pol.on_exit("detector", 200.0) == 201.0


def _sim_stack(tmp_path):
    """`resihp up` on the simulator at x20 for at most 120 s; -> (process, start time)."""
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    t0 = time.time()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "resihp.stack.cli", "up", "--state-dir", str(tmp_path),
            "--no-summary", "--dashboard-port", str(free_port()),
            "--trainer-arg=--speed=20", "--duration", "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    return proc, t0


def _past_startup(proc, t0, stack_file, ready):
    """Waits until the stack is past `up`'s startup window with its trainer running and
    ``ready(client)`` holds; -> (stack file, that client)."""
    from resihp.redis_client import connect
    from resihp.stack.launcher import STARTUP_S

    client = None
    deadline = time.time() + 90
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            stack = json.loads(stack_file.read_text())
        except (OSError, ValueError):
            stack = {}
        if "trainer" in stack.get("children", {}) and time.time() - t0 > STARTUP_S + 2:
            client = client or connect(stack["redis_url"])
            if ready(client):
                return stack, client
        time.sleep(0.3)
    raise AssertionError("the stack did not get past its startup")


@pytest.mark.redis
@pytest.mark.slow
def test_a_service_that_dies_after_startup_is_restarted_and_resumes_its_stream(tmp_path):
    from resihp.keys import JobKeys

    proc, t0 = _sim_stack(tmp_path)
    stack_file = tmp_path / "stack.json"
    keys = JobKeys("default")
    group = keys.group("detector")
    client = None

    def delivered(client) -> str:
        for g in client.xinfo_groups(keys.iterations):
            if g["name"] in (group, group.encode()):
                d = g["last-delivered-id"]
                return d.decode() if isinstance(d, bytes) else d
        return "0-0"

    def as_id(x: str) -> tuple[int, int]:
        a, b = x.split("-")
        return int(a), int(b)

    try:
        stack, client = _past_startup(
            proc, t0, stack_file, lambda c: c.xlen(keys.iterations) >= 3 and delivered(c) != "0-0"
        )
        old = stack["children"]["detector"]
        # a clean exit nobody asked for is a failure too (SIGTERM: the service stops as told)
        os.killpg(old, signal.SIGTERM)
        at_kill = delivered(client)
        deadline = time.time() + 60
        new = old
        while time.time() < deadline:
            try:
                new = json.loads(stack_file.read_text())["children"]["detector"]
            except (OSError, ValueError, KeyError):
                pass
            if new != old and _alive(new) and as_id(delivered(client)) > as_id(at_kill):
                break
            time.sleep(0.3)
        assert new != old and _alive(new), "the detector was not restarted"
        # the new detector reads the iteration stream on from where its group was
        assert as_id(delivered(client)) > as_id(at_kill)
    finally:
        if client is not None:
            client.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "detector exited with code 0" in out, out
    assert "resihp: restarting detector in 1 s" in out and "detector restarted (pid" in out, out
    # an exit nobody asked for, even one recovered from and with code 0, makes the run a
    # failure for scripts and CI
    assert proc.returncode == 1, out


def test_only_a_crash_signal_restarts_the_trainer_and_the_restart_drops_fresh():
    from resihp.stack.launcher import resume_argv, trainer_crashed

    assert trainer_crashed(-signal.SIGKILL) and trainer_crashed(-signal.SIGSEGV)
    # stopped on purpose, or ended by itself: stays down
    for rc in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP, 0, 1, 2):
        assert not trainer_crashed(rc), rc
    argv = ["trainer", "torch", "--job-id", "j", "--fresh", "true", "--iterations", "9"]
    assert resume_argv(argv) == ["trainer", "torch", "--job-id", "j", "--iterations", "9"]
    assert resume_argv(["trainer", "torch", "--fresh"]) == ["trainer", "torch"]
    assert resume_argv(["trainer", "torch", "--fresh=yes", "--x", "1"]) == [
        "trainer", "torch", "--x", "1"
    ]  # fmt: skip
    assert resume_argv(["trainer", "torch", "--fresh", "--x", "1"]) == [
        "trainer", "torch", "--x", "1"
    ]  # fmt: skip


@pytest.mark.redis
@pytest.mark.slow
def test_a_trainer_killed_by_sigkill_is_started_again_and_carries_its_run_on(tmp_path):
    from resihp.keys import JobKeys
    from resihp.schemas import IterationRecord
    from resihp.wire import decode_entry

    proc, t0 = _sim_stack(tmp_path)
    stack_file = tmp_path / "stack.json"
    keys = JobKeys("default")
    client = None

    def iterations(client) -> list[int]:
        out = []
        for _, fields in client.xrange(keys.iterations):
            good, _ = decode_entry(fields)
            out += [m.iteration for m in good if isinstance(m, IterationRecord)]
        return out

    try:
        stack, client = _past_startup(proc, t0, stack_file, lambda c: len(iterations(c)) >= 5)
        old = stack["children"]["trainer"]
        os.killpg(old, signal.SIGKILL)  # what the OOM killer does
        at_kill = max(iterations(client))
        deadline = time.time() + 60
        new = old
        while time.time() < deadline:
            try:
                new = json.loads(stack_file.read_text())["children"]["trainer"]
            except (OSError, ValueError, KeyError):
                pass
            if new != old and _alive(new) and max(iterations(client)) > at_kill + 5:
                break
            time.sleep(0.3)
        assert new != old and _alive(new), "the trainer was not started again"
        seen = iterations(client)
        after = seen[seen.index(at_kill) + 1 :]
        # the run goes on after its newest iteration: it did not start over at 0
        assert after and min(after) > at_kill, (at_kill, after[:5])
    finally:
        if client is not None:
            client.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "trainer was killed by SIGKILL" in out, out
    assert "starting the trainer again in 1 s; it resumes its run" in out, out
    assert "trainer restarted (pid" in out, out
    assert proc.returncode == 1, out


def test_exit_lines_say_which_signal_killed_a_child_and_quote_errors_only(tmp_path):
    from resihp.stack.launcher import Child, _exit_line

    log = tmp_path / "detector.log"
    log.write_text("INFO started\nWARNING no operators configured\n")
    c = Child("detector", None, log)
    assert _exit_line(c, -9) == f"detector was killed by SIGKILL (log: {log})"
    assert _exit_line(c, 0) == f"detector exited with code 0 (log: {log})"
    assert _exit_line(c, 3).endswith(": WARNING no operators configured")


def test_the_stack_file_is_replaced_whole_and_stays_private(tmp_path):
    from resihp.stack.launcher import _write_private

    f = tmp_path / "stack.json"
    f.write_text("old")
    f.chmod(0o644)
    before = f.stat().st_ino
    _write_private(f, '{"a": 1}')
    # replaced by a rename (a new inode), never rewritten in place where a reader could
    # see it half written
    assert f.stat().st_ino != before
    assert f.read_text() == '{"a": 1}' and f.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["stack.json"]  # no temp file left


@pytest.mark.redis
def test_the_decide_command_status_prints_reaches_the_same_redis(
    redis_server, r, tmp_path, monkeypatch, capsys
):
    """status found the Redis through the stack's state dir, but the `resihp act` command
    it printed did not name it: pasted anywhere else it failed with "no Redis URL"."""
    import json as _json

    from dashboard_scenario import publish_job

    from resihp.stack import cli, status

    publish_job(r, "job-d", iterations=20, slow_from=12)
    state = tmp_path / "st"
    state.mkdir()
    (state / status.STACK_FILE).write_text(
        _json.dumps({"pid": 1, "redis_url": redis_server.url, "job_id": "job-d"})
    )
    monkeypatch.setattr(status, "launcher_alive", lambda pid: True)  # "resihp up" runs
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert cli.main(["status", "--state-dir", str(state), "--job-id", "job-d"]) == 0
    out = capsys.readouterr().out
    want = f"--plan-id 1 --job-id job-d --state-dir {state.resolve()}"
    assert want in out, out
    assert cli.main(["status", "--redis-url", redis_server.url, "--job-id", "job-d"]) == 0
    out = capsys.readouterr().out
    assert (
        "--job-id job-d --redis-url URL" in out and redis_server.url not in out.split("decide")[1]
    )


@pytest.mark.redis
@pytest.mark.slow
def test_a_job_run_on_another_stacks_redis_hears_when_it_goes(tmp_path):
    """Job b ran on stack a's embedded Redis; when a stopped, it shut that Redis without a
    word, and b trained 25 s into nothing and still exited 0."""
    env = dict(os.environ)
    env.pop("REDIS_URL", None)
    up = [sys.executable, "-m", "resihp.stack.cli", "up"]
    a = subprocess.Popen(
        [*up, "--state-dir", str(tmp_path / "a"), "--job-id", "a", "--trainer", "none",
         "--dashboard-port", str(free_port()), "--duration", "12", "--no-summary"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        stack = tmp_path / "a" / "stack.json"
        deadline = time.monotonic() + 60
        while not stack.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        url = json.loads(stack.read_text())["redis_url"]
        b = subprocess.run(
            [*up, "--state-dir", str(tmp_path / "b"), "--job-id", "b", "--redis-url", url,
             "--dashboard-port", str(free_port()), "--trainer-arg=--speed=10",
             "--duration", "25", "--no-summary"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        out_a, _ = a.communicate(timeout=60)
    finally:
        a.kill()
    assert a.returncode == 0, out_a
    assert "job(s) b still have services on this stack's embedded Redis" in out_a, out_a
    assert b.returncode == 1, b.stdout + b.stderr
    assert "was unreachable at the end" in b.stdout, b.stdout


@pytest.mark.parametrize("cmd", [["act"], ["record"], ["config"], ["report", "export"]])
def test_forwarded_commands_document_the_state_dir_they_take(cmd):
    """`act`, `record`, `config` and `report` take --state-dir (the resihp command reads it
    before forwarding), but their --help, the service's own parser, never said so."""
    out = subprocess.run(
        [sys.executable, "-m", "resihp.stack.cli", *cmd, "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and "--state-dir DIR: the `resihp up` state dir" in " ".join(
        out.stdout.split()
    ), out.stdout

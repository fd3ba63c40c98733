"""Recovery timeline of one fail-stop with the whole stack and the torch trainer.

Starts a real Redis, then ``resihp up --trainer torch`` (collector, detector,
scheduler, dashboard and the torch trainer's ranks) with a scenario that
SIGKILLs one rank mid-run.  When training ends it stops the stack and prints,
in seconds after the kill: the collector's liveness decision, the detector's
failure report, the scheduler's plan (proposed, acknowledged in auto mode),
the trainer applying it (groups rebuilt, state moved, first iteration done)
and the plan's confirmation as applied.

    python bench/recovery_stack.py [--pp 2 --dp 2 --tp 1] [--kill-rank 1 --kill-at 15]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from resihp.keys import JobKeys
from resihp.redis_client import EmbeddedRedis, free_port
from resihp.schemas import AdaptationPlan, FailureReport, LivenessEvent
from resihp.wire import decode_entry


def _print_tails(paths: list[Path], lines: int = 15) -> None:
    """The end of each log, so a failed run on a remote machine explains itself."""
    for p in paths:
        if p.exists():
            tail = p.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {p.name} (last {len(tail)} lines)\n" + "\n".join(tail))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-at", type=int, default=15)
    ap.add_argument("--grace-period-s", type=float, default=0.5)
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--device", default="cpu", help="the trainer's device: cpu or cuda")
    ap.add_argument("--backend", default="auto", help="the trainer's backend: auto, gloo or nccl")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="resihp-recovery-"))
    out.mkdir(parents=True, exist_ok=True)
    scn = out / "kill.yaml"
    scn.write_text(
        "name: one fail-stop\nevents:\n"
        f"  - {{at_iteration: {a.kill_at}, action: kill_device, rank: {a.kill_rank}}}\n"
    )
    job = "recovery-bench"
    keys = JobKeys(job)
    srv = EmbeddedRedis().start()
    run_dir = out / "run"
    cmd = [
        sys.executable, "-m", "resihp.stack.cli", "up", "--redis-url", srv.url, "--job-id", job,
        "--trainer", "torch", "--scenario", str(scn), "--grace-period-s", str(a.grace_period_s),
        "--no-summary", "--state-dir", str(out / "state"), "--dashboard-port", str(free_port()),
        f"--trainer-arg=--tp={a.tp}", f"--trainer-arg=--pp={a.pp}", f"--trainer-arg=--dp={a.dp}",
        "--trainer-arg=--microbatches=2", f"--trainer-arg=--iterations={a.iterations}",
        f"--trainer-arg=--out-dir={run_dir}", "--trainer-arg=--plan-wait-s=20",
        f"--trainer-arg=--device={a.device}", f"--trainer-arg=--backend={a.backend}",
    ]  # fmt: skip
    print(
        f"recovery bench: TP{a.tp}xPP{a.pp}xDP{a.dp} on {a.device} ({a.backend}), kill rank {a.kill_rank} at iteration "
        f"{a.kill_at}; logs in {out / 'state' / 'logs'}",
        flush=True,
    )
    log = open(out / "up.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + a.timeout_s
    try:
        while time.time() < deadline:
            if (run_dir / "timeline.json").exists():
                break  # the trainer's launcher writes it when training ends
            if proc.poll() is not None:
                break
            time.sleep(1)
        time.sleep(2)  # let the scheduler see the confirmation
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    try:
        if not (run_dir / "timeline.json").exists() or not metrics.exists():
            print(f"the trainer did not train; see {out / 'state' / 'logs'}")
            _print_tails([out / "up.log", *sorted((out / "state" / "logs").glob("*.log"))])
            return 1
        tl = json.loads((run_dir / "timeline.json").read_text())
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        kill = tl.get("kill_t")
        if kill is None:
            print("the kill did not happen")
            return 1
        c = srv.client()
        marks: list[tuple[float, str]] = [(0.0, "rank SIGKILLed")]

        def read(stream):
            for _, f in c.xrange(stream):
                good, _bad = decode_entry(f)
                yield from good

        for m in read(keys.liveness):
            if isinstance(m, LivenessEvent) and m.state == "dead" and m.detected_at_s >= kill:
                marks.append((m.detected_at_s - kill, f"collector: {m.scope} {m.ranks} dead"))
                break
        fid = None
        for m in read(keys.failures):
            if isinstance(m, FailureReport) and m.kind == "fail_stop" and m.detected_at_s >= kill:
                marks.append((m.detected_at_s - kill, f"detector: fail_stop report {m.ranks}"))
                fid = m.report_id
                break
        seen = set()
        plan_id = None
        for m in read(keys.plans):
            if not isinstance(m, AdaptationPlan) or (fid and fid not in m.failure_ids):
                continue
            plan_id = m.plan_id
            if m.state not in seen and m.state in ("proposed", "acknowledged", "applied"):
                seen.add(m.state)
                t = m.updated_at_s or m.created_at_s
                marks.append((t - kill, f"scheduler: plan {m.plan_id} {m.state}"))
        for e in tl["events"]:
            if e["what"] == "death_detected":
                marks.append((e["t"] - kill, "launcher: worker exit seen"))
            if e["what"] == "plan_chosen" and e["t"] >= kill:
                marks.append(
                    (e["t"] - kill, f"launcher: plan {e.get('plan_id')} chosen ({e.get('layout')})")
                )
                break
        g1 = tl["workers"].get("1", {})
        for ev, label in (
            ("groups_rebuilt", "trainer: groups rebuilt (generation 1)"),
            ("state_moved", "trainer: state moved"),
            ("first_iteration_done", "trainer: first iteration done"),
        ):
            if ev in g1:
                marks.append((g1[ev] - kill, label))
        marks.sort()
        print("\nrecovery timeline (seconds after the kill)")
        for t, what in marks:
            print(f"  {t:8.3f}  {what}")
        if "moved" in g1:
            print(f"  state moved: {g1['moved']}")
        done = [r["iteration"] for r in rows]
        print(
            f"\ntrainer finished {len(rows)} iterations "
            f"({'each once' if done == list(range(len(rows))) else done}); plan id {plan_id}"
        )
        (out / "recovery.json").write_text(json.dumps({"marks": marks, "timeline": tl}, indent=1))
        print(f"wrote {out / 'recovery.json'}")
        c.close()
    finally:
        srv.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

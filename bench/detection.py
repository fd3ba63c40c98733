"""Detector accuracy and cost on simulator traces: the paper's Tables 4 and 5, ours beside Greyhound.

For each setting (Table 3 layouts; Table 4 models, sequence lengths,
micro-batches and schedules) it runs many short simulated jobs
(``trainer.sim.simulate_run``: real document-length variability from the
stdlib corpus, lognormal kernel noise), assembles IterationRecords with the
collector's pure assembler, and feeds the same records to the ResiHP detector
and to the Greyhound-style baseline.  Half of the jobs get one persistent
fail-slow at a random iteration at least 50 iterations from either end:
a slower GPU (compute) or a slower NIC/NVLink port (communication), with a
strength drawn so that most cost 5-70 % throughput; jobs whose injected
slowdown costs less than 5 % (true cost from the simulator's hidden state) are
counted apart, since the bar is ">= 5 %".

Printed per setting:
* MTP / ITP MAPE: eq.-1 micro-batch (per stage) and DAG iteration-time
  predictions vs observed, on healthy iterations after warm-up, predicted
  before the iteration is seen;
* false alarms per job: validations started while no fault was active; the
  overhead per false alarm (ours: CPU time of the validation; Greyhound: the
  training pause of its profiling + micro-benchmark validation, modeled as
  the project's calibration notes describe);
* detection accuracy: healthy jobs with no fail-slow report, faulty jobs with a
  report naming the slowed device after the injection and no wrong report;
* detection delay: slow iterations seen up to and including the report.

Then the detector's CPU time per iteration on a 256-GPU job (LLaMA2-70B,
(4, 4, 16)) and a 16,384-GPU one ((8, 128, 16), 64 micro-batches) as a fraction
of their iteration time (% of one core the detector keeps busy).

    python bench/detection.py            # 100 jobs per setting (a few minutes)
    python bench/detection.py --quick    # 20 jobs per setting
    python bench/detection.py --cpu-only # only the CPU cost, 256 and 16,384 GPUs (~4 min)
    python bench/detection.py --cpu-only --against /tmp/base  # ... beside another checkout
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from detector.config import DetectorConfig, parse_assignments
from detector.engine import Detector
from detector.predictor import IterationView
from resihp.assembly import IterationAssembler
from resihp.scenario import parse_scenario
from resihp.wire import decode_entry, encode_one
from trainer.data.lengths import LengthSampler, stdlib_document_lengths
from trainer.sim.config import SimConfig
from trainer.sim.core import ClusterSim

#: (label, model, seq_len, micro-batches, schedule) after the paper's Table 4.
SETTINGS = [
    ("Small, 8K", "qwen2.5-7b", 8192, 4, "1f1b"),
    ("Medium, 16K", "qwen2.5-14b", 16384, 8, "zbh1"),
    ("Medium, 32K", "llama2-13b", 32768, 8, "1f1b"),
]
JOB_ITERS = 160
MARGIN = 50
BAR = 0.05
WORKLOAD = "mixture"


class MixtureSampler:
    """Multi-source data: phases of short- and of long-document sources.

    The stdlib corpus split at its median length gives two real sources; the
    loader stays on one for a geometric number of iterations (mean 20), as
    multi-source pretraining pipelines do.  Every iteration's micro-batches come
    from the current source, so iteration time shifts for many iterations at a
    time: the workload change a Greyhound-style detector mistakes for a
    fail-slow.  (``--workload shuffled`` keeps the simulator's globally
    shuffled corpus, whose iteration-to-iteration variability is smaller.)
    """

    def __init__(self, token_budget: int, seed: int, mean_phase_iters: float = 20.0):
        docs = stdlib_document_lengths()
        med = np.median(docs)
        self.src = [
            LengthSampler(token_budget, seed, docs[docs <= med]),
            LengthSampler(token_budget, seed + 1, docs[docs > med]),
        ]
        self.cursor = [0, 0]
        self.rng = np.random.default_rng(seed + 17)
        self.which = int(self.rng.integers(2))
        self.left = int(self.rng.geometric(1 / mean_phase_iters))
        self.mean = mean_phase_iters

    def stats(self, first: int, count: int):
        if self.left <= 0:
            self.which = 1 - self.which
            self.left = int(self.rng.geometric(1 / self.mean))
        self.left -= 1
        st = self.src[self.which].stats(self.cursor[self.which], count)
        self.cursor[self.which] += count
        return st


def simulate(cfg: SimConfig, scenario, workload: str):
    sim = ClusterSim(cfg, scenario)
    if workload == "mixture":
        sim.sampler = MixtureSampler(cfg.seq_len, cfg.seed)
    steps = []
    while sim.iteration < cfg.iterations and len(steps) < 10 * cfg.iterations:
        steps.append(sim.step())
    return steps


@dataclass
class JobResult:
    setting: str
    faulty: bool
    what: str = ""
    victim: int = -1
    inject_at: int = -1
    true_cost: float = 0.0
    mtp_err: list = field(default_factory=list)
    itp_err: list = field(default_factory=list)
    modes: dict = field(default_factory=dict)  # mode -> dict


def _records(steps, layout, tp_dedup: bool = False):
    """The records the live collector would publish: with ``tp_dedup`` (a simulator that
    reports TP rank 0 only and says so) it expects those ranks alone, as it does live."""
    asm = IterationAssembler(tp_dedup=tp_dedup)
    asm.set_layout(layout)
    out = []
    for st in steps:
        if st.true_state.status != "ok":
            continue
        for m in st.mb_stats_messages():
            asm.add_mb_stats(m, 0.0)
        asm.add_rows(st.chunk_rows, 0.0)
        out += asm.poll(0.0)
    out += asm.flush()
    return out


def _mtp_errors(det: Detector, v: IterationView) -> list[float]:
    """|predicted - observed| / observed of each micro-batch's compute on each stage."""
    pred = det.failslow.pred.predict_compute(v)
    m = v.compute_mask() & np.isfinite(pred)
    if not m.any():
        return []
    key = (v.dp[m].astype(np.int64) * 4096 + v.stage[m]) * 65536 + v.mb[m]
    _, inv = np.unique(key, return_inverse=True)
    obs = np.bincount(inv, weights=v.duration_s[m])
    prd = np.bincount(inv, weights=pred[m])
    ok = obs > 0
    return (np.abs(prd[ok] - obs[ok]) / obs[ok]).tolist()


def run_job(args) -> JobResult:
    label, model, seq, mbs, sched, seed, faulty, workload, overrides = args
    rng = np.random.default_rng(seed + 7919)
    cfg = SimConfig(
        model=model,
        seq_len=seq,
        microbatches=mbs,
        schedule=sched,
        speed=0.0,
        iterations=JOB_ITERS,
        seed=seed,
        noise=0.03,
    )
    lay = cfg.initial_layout()
    res = JobResult(label, faulty)
    scenario = None
    if faulty:
        res.inject_at = int(rng.integers(MARGIN, JOB_ITERS - MARGIN))
        res.victim = int(rng.choice(lay.active_ranks()))
        if rng.random() < 0.5:
            res.what = "compute"
            f = float(rng.uniform(0.3, 0.85))
            ev = f"{{at_iteration: {res.inject_at}, action: slow_device, rank: {res.victim}, factor: {f:.3f}}}"
        else:
            res.what = "comm"
            f = float(rng.uniform(0.02, 0.3))
            ev = f"{{at_iteration: {res.inject_at}, action: slow_link, rank: {res.victim}, factor: {f:.3f}}}"
        scenario = parse_scenario(f"events:\n  - {ev}\n")
    steps = simulate(cfg, scenario, workload)
    truth = {st.iteration: st.true_state for st in steps if st.true_state.status == "ok"}
    recs = _records(steps, lay, cfg.report_tp0_only)
    if faulty:
        pre = [truth[i] for i in truth if i < res.inject_at]
        post = [truth[i] for i in truth if i >= res.inject_at]
        ratio_pre = sum(t.healthy_iteration_s for t in pre) / sum(t.iteration_time_s for t in pre)
        ratio_post = sum(t.healthy_iteration_s for t in post) / sum(
            t.iteration_time_s for t in post
        )
        res.true_cost = 1.0 - ratio_post / ratio_pre
    for mode in ("resihp", "greyhound"):
        det = Detector(DetectorConfig(mode=mode, **overrides), layout=lay)
        reports = []
        cpu = 0.0
        for rec in recs:
            healthy_now = not faulty or rec.iteration < res.inject_at
            if mode == "resihp" and det.failslow.ready and healthy_now:
                v = IterationView.from_record(rec)
                res.mtp_err += _mtp_errors(det, v)
                p = det.failslow.predicted_iteration_time(v)
                if np.isfinite(p):
                    res.itp_err.append(abs(p - rec.iteration_time_s) / rec.iteration_time_s)
            t0 = time.process_time()
            reports += det.handle(rec)
            cpu += time.process_time() - t0
        log = det.failslow.stats.validation_log
        fa = [
            e for e in log if not e.get("benign") and (not faulty or e["iteration"] < res.inject_at)
        ]
        slow_reps = [r for r in reports if r.kind.startswith("fail_slow")]
        after = [r for r in slow_reps if faulty and r.iteration >= res.inject_at]
        hit = [r for r in after if res.victim in r.ranks]
        wrong = [
            r
            for r in slow_reps
            if not (faulty and r.iteration >= res.inject_at and res.victim in r.ranks)
        ]
        correct = (not slow_reps) if not faulty else (bool(hit) and not wrong)
        res.modes[mode] = {
            "fa": len(fa),
            "fa_cost_s": [e.get("pause_s", 0.0) + e["cpu_s"] for e in fa],
            "correct": correct,
            "delay": (hit[0].iteration - res.inject_at + 1) if hit else None,
            "kind_ok": bool(hit)
            and hit[0].kind == ("fail_slow_compute" if res.what == "compute" else "fail_slow_comm"),
            "exact": bool(hit) and (hit[0].ranks == [res.victim] or res.what == "comm"),
            "wrong": len(wrong),
            "cpu_per_iter_s": cpu / max(1, len(recs)),
        }
    return res


def _fmt_pct(x) -> str:
    return f"{100 * x:.2f}%" if x == x else "n/a"


def summarize(label: str, results: list[JobResult]) -> None:
    mtp = (
        float(np.mean(np.concatenate([r.mtp_err for r in results if r.mtp_err])))
        if results
        else float("nan")
    )
    itp = (
        float(np.mean(np.concatenate([r.itp_err for r in results if r.itp_err])))
        if results
        else float("nan")
    )
    faulty = [r for r in results if r.faulty]
    scored = [r for r in results if not r.faulty or r.true_cost >= BAR]
    below = len(faulty) - sum(1 for r in faulty if r.true_cost >= BAR)
    print(
        f"\n== {label}: {len(results)} jobs ({len(faulty)} with a fail-slow, {below} of them cost < 5 %)"
    )
    print(f"   MTP MAPE {_fmt_pct(mtp)}   ITP MAPE {_fmt_pct(itp)}")
    print(f"   {'':28s}{'ResiHP':>14s}{'Greyhound':>14s}")
    rows = {}
    for mode in ("resihp", "greyhound"):
        fa = np.mean([r.modes[mode]["fa"] for r in results])
        costs = [c for r in results for c in r.modes[mode]["fa_cost_s"]]
        acc = np.mean([r.modes[mode]["correct"] for r in scored]) if scored else float("nan")
        hits = [r for r in faulty if r.true_cost >= BAR and r.modes[mode]["delay"] is not None]
        delays = [r.modes[mode]["delay"] for r in hits]
        kind = np.mean([r.modes[mode]["kind_ok"] for r in hits]) if hits else float("nan")
        det_rate = len(hits) / max(1, sum(1 for r in faulty if r.true_cost >= BAR))
        wrong = np.mean([r.modes[mode]["wrong"] for r in results])
        strong = [r for r in faulty if r.true_cost >= 0.2]
        det_strong = (
            np.mean([r.modes[mode]["delay"] is not None for r in strong])
            if strong
            else float("nan")
        )
        cpu = np.mean([r.modes[mode]["cpu_per_iter_s"] for r in results])
        rows[mode] = [
            f"{fa:.2f}",
            (f"{1e3 * np.mean(costs):.1f} ms" if mode == "resihp" else f"{np.mean(costs):.2f} s")
            if costs
            else "-",
            f"{acc:.3f}",
            f"{det_rate:.3f}",
            f"{det_strong:.3f}",
            f"{kind:.3f}",
            f"{wrong:.2f}",
            (f"{np.mean(delays):.2f} / {np.max(delays)}" if delays else "-"),
            f"{1e3 * cpu:.1f} ms",
        ]
    names = [
        "false alarms / job",
        "overhead / false alarm",
        "detection accuracy",
        "detected (cost >= 5 %)",
        "detected (cost >= 20 %)",
        "compute vs comm right",
        "wrong reports / job",
        "delay mean / max (iters)",
        "detector CPU / iteration",
    ]
    for i, n in enumerate(names):
        print(f"   {n:28s}{rows['resihp'][i]:>14s}{rows['greyhound'][i]:>14s}")


def detector_cpu(
    label: str,
    tp: int,
    pp: int,
    dp: int,
    mbs: int,
    iterations: int,
    paper: str = "",
    rounds: int = 3,
    against: str = "",
) -> None:
    """Detector CPU per iteration on a LLaMA2-70B job vs its iteration time.

    Counts what the live service does per record: decoding the record's stream
    entry (JSON, chunk columns packed), then ``Detector.handle``, as the CPU time
    of the thread doing it (``time.thread_time``: a busy box's other processes
    are not counted).  The job is simulated once; its entries are replayed
    ``rounds`` times through a fresh detector, and every iteration after the
    warm-up (the first left out) is one sample: median and max are printed.
    ``against``: another checkout of the project (e.g. ``git worktree add
    /tmp/base <commit>``); each round then replays the same entries through it
    and through this one, alternately, each in a fresh process, and says whether
    both gave the same reports and fits.
    """
    cfg = SimConfig(
        model="llama2-70b",
        seq_len=4096,
        microbatches=mbs,
        schedule="1f1b",
        tp=tp,
        pp=pp,
        dp=dp,
        speed=0.0,
        iterations=iterations,
        seed=1,
        noise=0.03,
    )
    lay = cfg.initial_layout()
    t_sim = time.time()
    steps = simulate(cfg, None, "mixture")
    recs = _records(steps, lay, cfg.report_tp0_only)
    t_sim = time.time() - t_sim
    entries = [encode_one(rec) for rec in recs]
    wire_mb = float(np.mean([sum(len(v) for v in f.values()) / 1e6 for f in entries]))
    it_s = float(np.mean([r.iteration_time_s for r in recs]))
    chunks = len(recs[-1].chunks.get("kind", []))
    incomplete = sum(not r.complete for r in recs)
    del steps, recs
    print(
        f"\n== {label}: LLaMA2-70B (TP{tp}, DP{dp}, PP{pp}), {mbs} micro-batches, "
        f"{chunks} chunk entries/iteration, record entry {wire_mb:.1f} MB, "
        f"{incomplete} of {len(entries)} records incomplete [simulated in {t_sim:.0f} s]"
    )
    trees = [("this checkout", "")]
    if against:
        trees.insert(0, (f"against {against}", os.path.abspath(against)))
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    path = ""
    try:
        if against:
            fd, path = tempfile.mkstemp(prefix="resihp-detector-cpu-", suffix=".pkl")
            with os.fdopen(fd, "wb") as f:
                pickle.dump({"layout": lay, "entries": entries}, f)
        for _ in range(rounds):
            for name, tree in trees:
                runs[name].append(_replay_in(tree, path) if against else replay(lay, entries))
    finally:
        if path:
            os.unlink(path)
    for name, _tree in trees:
        cpu = np.array([x for r in runs[name] for x in r["cpu_s"]])
        parts = [p for r in runs[name] for p in r.get("parts_s", [])]
        warm = [x for r in runs[name] for x in r["warm_s"]]
        who = f" [{name}]" if against else ""
        p90 = np.percentile(cpu, 90)
        print(
            f"   iteration time {it_s:.2f} s; detector CPU{who} median {1e3 * np.median(cpu):.1f} "
            f"/ p90 {1e3 * p90:.1f} / max {1e3 * cpu.max():.1f} ms per iteration ({len(cpu)} "
            f"iterations in {rounds} rounds; warm-up {1e3 * np.mean(warm):.1f} ms) = "
            f"{100 * np.median(cpu) / it_s:.2f} / {100 * p90 / it_s:.2f} / "
            f"{100 * cpu.max() / it_s:.2f} % of a core over the iteration"
            + (f" ({paper})" if paper else "")
        )
        if len(parts) == len(cpu):
            names = list(dict.fromkeys(k for p in parts for k in p))
            worst = parts[int(np.argmax(cpu))]
            print(
                "     ms per iteration, median / in the max iteration: "
                + ", ".join(
                    f"{k} {1e3 * np.median([p.get(k, 0.0) for p in parts]):.1f}"
                    f" / {1e3 * worst.get(k, 0.0):.1f}"
                    for k in names
                )
            )
    if against:
        digests = {r["digest"] for name, _ in trees for r in runs[name]}
        print(
            "   reports and fits: "
            + ("identical in every run" if len(digests) == 1 else f"{len(digests)} different")
        )


#: The detector's steps timed apart in :func:`replay` (what each iteration's CPU went to):
#: (name, path of the bound method from the Detector).
PHASES = (
    ("view", "views.build"),
    ("residuals", "failslow.s.residuals"),
    ("shifts", "failslow.shifts.find"),
    ("workload", "failslow.workload.check"),
    ("validate", "failslow.validator.validate_shifts"),
    ("recovery", "failslow.severity.recovery"),
    ("fold", "failslow.s.fold_healthy"),
)


def _timed_phases(det: Detector, acc: dict[str, float]) -> None:
    """Wrap each of :data:`PHASES` of ``det`` (an instance attribute shadowing the method)
    to add its thread CPU time to ``acc``; a step the checkout does not have is skipped."""
    for name, path in PHASES:
        *parents, attr = path.split(".")
        obj = det
        for p in parents:
            obj = getattr(obj, p, None)
        fn = getattr(obj, attr, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                acc[_name] = acc.get(_name, 0.0) + time.thread_time() - t0

        setattr(obj, attr, timed)


def replay(layout, entries) -> dict:
    """One replay of ``entries`` through a fresh detector: per-iteration thread CPU
    (after the warm-up, the first left out; the warm-up's apart), where each of those
    iterations' CPU went (entry decode and :data:`PHASES`) and a digest of the reports
    and fits it ended with."""
    det = Detector(DetectorConfig(), layout=layout)
    acc: dict[str, float] = {}
    _timed_phases(det, acc)
    cpu, warm, reports, parts = [], [], [], []
    for fields in entries:
        ready = det.failslow.ready
        acc.clear()
        t0 = time.thread_time()
        (msg,), _bad = decode_entry(fields)
        t1 = time.thread_time()
        out = det.handle(msg)
        t2 = time.thread_time()
        dt = t2 - t0
        (cpu if ready else warm).append(dt)
        if ready:
            parts.append({"decode": t1 - t0, **acc, "other": t2 - t1 - sum(acc.values())})
        reports += [r.to_json() for r in out]
    pred = det.failslow.pred
    state = repr((reports, sorted(pred.coef.items()), sorted(pred.scale.items())))
    state += repr(sorted(pred.comm_median.items()))
    return {
        "cpu_s": cpu[1:],
        "parts_s": parts[1:],
        "warm_s": warm,
        "digest": hashlib.sha256(state.encode()).hexdigest(),
    }


def _replay_in(tree: str, path: str) -> dict:
    """:func:`replay` in a fresh process, on the code of ``tree`` (this checkout if empty)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = tree or here
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--replay", path],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="20 jobs per setting")
    ap.add_argument("--jobs", type=int, default=None, help="jobs per setting (default 100)")
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument(
        "--settings", default="all", help="comma-separated indices into the settings (0,1,2)"
    )
    ap.add_argument(
        "--workload",
        choices=["mixture", "shuffled"],
        default=WORKLOAD,
        help="data order: multi-source phases (default) or the globally shuffled corpus",
    )
    ap.add_argument(
        "--skip-16k", action="store_true", help="skip the 16,384-GPU detector CPU measurement"
    )
    ap.add_argument(
        "--cpu-only",
        action="store_true",
        help="only the detector CPU per iteration, at 256 and 16,384 GPUs",
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="replays of each CPU job's entries (default 3)"
    )
    ap.add_argument(
        "--against",
        default="",
        metavar="DIR",
        help="another checkout (e.g. `git worktree add DIR <commit>`): the CPU jobs are "
        "replayed through it and this one alternately, in fresh processes",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a DetectorConfig field for both modes, e.g. failslow_min_duration_s=20 (repeatable)",
    )
    ap.add_argument("--replay", default="", help=argparse.SUPPRESS)  # internal: one child run
    a = ap.parse_args(argv)
    if a.replay:
        with open(a.replay, "rb") as f:
            job = pickle.load(f)
        print(json.dumps(replay(job["layout"], job["entries"])))
        return 0
    try:
        overrides = parse_assignments(a.set)
    except ValueError as e:
        ap.error(str(e))
    n = a.jobs or (20 if a.quick else 100)
    chosen = SETTINGS if a.settings == "all" else [SETTINGS[int(i)] for i in a.settings.split(",")]
    if a.cpu_only:
        chosen = []
    t_all = time.time()
    print(f"{n} jobs per setting, {JOB_ITERS} iterations each, workload: {a.workload}")
    for si, (label, model, seq, mbs, sched) in enumerate(chosen):
        t0 = time.time()
        tasks = [
            (label, model, seq, mbs, sched, 1000 * si + j, j % 2 == 1, a.workload, overrides)
            for j in range(n)
        ]
        if a.workers > 1:
            with ProcessPoolExecutor(a.workers) as ex:
                results = list(ex.map(run_job, tasks, chunksize=2))
        else:
            results = [run_job(t) for t in tasks]
        summarize(f"{label} ({model}, {mbs} MBs, {sched})", results)
        print(f"   [{time.time() - t0:.0f} s]")
        sys.stdout.flush()
    cpu_args = {"rounds": a.rounds, "against": a.against}
    detector_cpu("256 GPUs", 4, 16, 4, 16, 60, paper="paper: 1.2-1.5 %", **cpu_args)
    if not a.skip_16k:
        detector_cpu("16,384 GPUs", 8, 16, 128, 64, 36, **cpu_args)
    print(f"\ntotal {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

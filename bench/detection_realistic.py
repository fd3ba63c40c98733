"""Detector accuracy on realistic telemetry: nine job classes, both RECV timings, tuned vs held-out seeds.

Each job is a simulated hybrid-parallel run (``trainer.sim.ClusterSim``) of
LLaMA2-7B with DP 2-4, PP 4 or 8, 8-16 micro-batches and 4K-16K-token
micro-batches packed from the stdlib corpus' real document lengths, with what
makes real telemetry hard:

* lognormal kernel noise (sigma 3 %) plus rare spikes: one draw in 500 of the
  simulator's noise (a chunk, a member's compute, a transfer) is multiplied by
  1.5-4;
* a static speed spread: every GPU runs at a fixed factor drawn from
  U(0.99, 1.01);
* RECV / ALLREDUCE rows timed ``blocking`` (posted until done, the wait for the
  peer included: what ``trainer/torch_trainer/engine.py`` writes) or
  ``transfer`` (the transfer alone), see docs/trace-format.md.

The nine classes (200 iterations, onset drawn in [50, 90)):

========================= ===================================================
healthy                   nothing
data_shift                from the onset every micro-batch comes from the
                          longer half of the documents (stays)
transient                 4 bursts of 1-3 iterations with one GPU at 0.4-0.7x
slow_gpu                  one GPU at 0.5-0.8x from the onset
ramp                      one GPU throttling linearly from 1x to 1/1.3-1/2.0x
                          over 30 iterations, then staying there
slow_link                 one GPU's NIC port at 0.004-0.008x from the onset
flapping                  one GPU at 0.5x for 10 iterations, healthy for 10,
                          repeated from the onset
slowdown_ends             one GPU at 0.5-0.7x for 40 iterations, then healthy
strong_link               one GPU's NIC port at 0.001-0.003x
========================= ===================================================

The true throughput loss of each iteration is ``1 - healthy / observed``,
``healthy`` from re-simulating the same job (same seed, data, noise and static
spread) without the fault.  A fault job whose mean loss while the fault is on is
under 5 % is counted apart (the bar is ">= 5 %").

Scoring (per job, per detector mode):

* a job without a fail-slow to find (healthy, data_shift, transient) is right
  with no fail-slow report; each report is a false report;
* a fault job is right when a report names the slowed GPU (its rank, for a link
  a rank of the link) after the onset and no report names another device or
  comes before the onset; a flapping GPU must be reported once (each further
  report of it is a false report); a slowdown that ends must also be reported
  recovered after it ended;
* delay: iterations from the onset (ramp: from the first iteration whose true
  loss, averaged over 3 iterations, reaches 5 %) to the first report naming it;
* localization exact: the first such report names only ranks of the slowed
  GPU's replica and stage (a link: one of its two ends is that GPU).

Seeds ``0..n-1`` are the tuning set; seeds ``10000..`` are held out (never
looked at while tuning).  Both are printed.

    python bench/detection_realistic.py --quick     # 2 jobs per class and set
    python bench/detection_realistic.py             # 6 jobs per class and set
    python bench/detection_realistic.py --classes transient --set persist_min_iters=2
                                                    # a DetectorConfig field changed
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from detector.config import DetectorConfig, parse_assignments
from detector.engine import Detector
from resihp.assembly import IterationAssembler
from trainer.data.lengths import LengthSampler, stdlib_document_lengths
from trainer.sim.config import SimConfig
from trainer.sim.core import ClusterSim

CLASSES = (
    "healthy",
    "data_shift",
    "transient",
    "slow_gpu",
    "ramp",
    "slow_link",
    "flapping",
    "slowdown_ends",
    "strong_link",
)
NO_FAULT = ("healthy", "data_shift", "transient")
TIMINGS = ("blocking", "transfer")
MODES = ("resihp", "greyhound")
ITERS = 200
BAR = 0.05
HELD_OUT_BASE = 10000
SPIKE_P = 0.002


class SpikyRng:
    """The simulator's generator with rare spikes on its lognormal noise draws."""

    def __init__(self, rng: np.random.Generator, spikes: np.random.Generator):
        self._rng = rng
        self._spikes = spikes

    def lognormal(self, mean=0.0, sigma=1.0, size=None):
        x = self._rng.lognormal(mean, sigma, size)
        if size is None:
            return x
        hit = self._spikes.random(np.shape(x)) < SPIKE_P
        if hit.any():
            x = np.where(hit, x * self._spikes.uniform(1.5, 4.0, np.shape(x)), x)
        return x

    def __getattr__(self, name):
        return getattr(self._rng, name)


class ShiftSampler:
    """The corpus' documents until ``at``, then only the longer half (a data shift)."""

    def __init__(self, token_budget: int, seed: int, at: int, per_iter: int):
        docs = stdlib_document_lengths()
        self.all = LengthSampler(token_budget, seed)
        self.long = LengthSampler(token_budget, seed + 1, docs[docs > np.median(docs)])
        self.at_mb = at * per_iter

    def stats(self, first: int, count: int):
        return (self.all if first < self.at_mb else self.long).stats(first, count)


@dataclass
class Job:
    cls: str
    seed: int
    dp: int
    pp: int
    mbs: int
    seq: int
    onset: int = -1
    end: int = -1
    victim: int = -1
    factor: float = 1.0
    link: bool = False
    #: iteration -> (compute speed of the victim, link speed of the victim)
    schedule: dict = field(default_factory=dict)


def make_job(cls: str, seed: int) -> Job:
    rng = np.random.default_rng([seed, CLASSES.index(cls), 7])
    job = Job(
        cls,
        seed,
        dp=int(rng.integers(2, 5)),
        pp=int(rng.choice([4, 8])),
        mbs=int(rng.choice([8, 12, 16])),
        seq=int(rng.choice([4096, 8192, 16384])),
    )
    job.onset = int(rng.integers(50, 90))
    world = job.dp * job.pp
    job.victim = int(rng.integers(world))
    sp = {}
    if cls == "transient":
        t = job.onset
        for _ in range(4):
            f = float(rng.uniform(0.4, 0.7))
            for i in range(int(rng.integers(1, 4))):
                sp[t + i] = (f, 1.0)
            t += int(rng.integers(15, 30))
    elif cls == "slow_gpu":
        job.factor = float(rng.uniform(0.5, 0.8))
        sp = {i: (job.factor, 1.0) for i in range(job.onset, ITERS)}
    elif cls == "ramp":
        x = float(rng.uniform(1.3, 2.0))
        job.factor = 1 / x
        for i in range(job.onset, ITERS):
            k = min(1.0, (i - job.onset + 1) / 30)
            sp[i] = (1.0 / (1 + (x - 1) * k), 1.0)
    elif cls in ("slow_link", "strong_link"):
        job.link = True
        job.factor = float(
            rng.uniform(0.004, 0.008) if cls == "slow_link" else rng.uniform(0.001, 0.003)
        )
        sp = {i: (1.0, job.factor) for i in range(job.onset, ITERS)}
    elif cls == "flapping":
        job.factor = 0.5
        sp = {i: (0.5, 1.0) for i in range(job.onset, ITERS) if ((i - job.onset) // 10) % 2 == 0}
    elif cls == "slowdown_ends":
        job.factor = float(rng.uniform(0.5, 0.7))
        job.end = job.onset + 40
        sp = {i: (job.factor, 1.0) for i in range(job.onset, job.end)}
    job.schedule = sp
    return job


def simulate(job: Job, timing: str, faulty: bool):
    cfg = SimConfig(
        model="llama2-7b",
        tp=1,
        pp=job.pp,
        dp=job.dp,
        microbatches=job.mbs,
        seq_len=job.seq,
        schedule="1f1b",
        speed=0.0,
        iterations=ITERS,
        seed=job.seed,
        noise=0.03,
        comm_timing=timing,
        probe_interval_iters=0,
    )
    sim = ClusterSim(cfg)
    sim.rng = SpikyRng(sim.rng, np.random.default_rng([job.seed, 99]))
    if job.cls == "data_shift":
        sim.sampler = ShiftSampler(job.seq, job.seed, job.onset, job.dp * job.mbs)
    spread = np.random.default_rng([job.seed, 5]).uniform(0.99, 1.01, sim.layout.world_size)
    steps = []
    while sim.iteration < ITERS and len(steps) < 2 * ITERS:
        c, lk = job.schedule.get(sim.iteration, (1.0, 1.0)) if faulty else (1.0, 1.0)
        speed = spread.copy()
        speed[job.victim] *= c
        if not np.array_equal(speed, sim.compute_speed):
            sim.compute_speed = speed
            sim.speed_version += 1
        if sim.link_speed[job.victim] != lk:
            sim.link_speed[job.victim] = lk
            sim.link_version += 1
        steps.append(sim.step())
    return cfg.initial_layout(), [s for s in steps if s.true_state.status == "ok"]


def records(steps, layout):
    asm = IterationAssembler()
    asm.set_layout(layout)
    out = []
    for st in steps:
        for m in st.mb_stats_messages():
            asm.add_mb_stats(m, 0.0)
        asm.add_rows(st.chunk_rows, 0.0)
        out += asm.poll(0.0)
    return out + asm.flush()


def _names_victim(rep, job: Job) -> bool:
    if job.victim in rep.ranks:
        return True
    return any(job.victim in link for link in rep.links)


def _exact(rep, job: Job, layout) -> bool:
    if job.link:
        return _names_victim(rep, job)
    d, s, _t = layout.coords()[job.victim]
    group = set(layout.groups[d][s])
    return bool(rep.ranks) and set(rep.ranks) <= group and job.victim in rep.ranks


def score(job: Job, layout, reports, loss: np.ndarray) -> dict:
    slow = [r for r in reports if r.kind.startswith("fail_slow")]
    rec = [r for r in reports if r.kind == "recovery"]
    out = {"false": 0, "correct": False, "delay": None, "exact": None, "scored": True}
    if job.cls in NO_FAULT:
        out["false"] = len(slow)
        out["correct"] = not slow
        return out
    on = np.array([i in job.schedule for i in range(len(loss))])
    out["scored"] = bool(on.any()) and float(loss[on].mean()) >= BAR
    good = [r for r in slow if r.iteration >= job.onset and _names_victim(r, job)]
    wrong = [r for r in slow if r not in good]
    extra = 0
    if job.cls == "flapping":
        extra = max(0, len(good) - 1)
    out["false"] = len(wrong) + extra
    ok = bool(good) and not wrong and extra == 0
    if job.cls == "slowdown_ends":
        ok = ok and any(r.iteration >= job.end and _names_victim(r, job) for r in rec)
    out["correct"] = ok
    if good:
        ref = job.onset
        if job.cls == "ramp":
            sm = np.convolve(loss, np.ones(3) / 3, mode="same")
            cross = [i for i in range(job.onset, len(loss)) if sm[i] >= BAR]
            ref = cross[0] if cross else job.onset
        out["delay"] = good[0].iteration - ref
        out["exact"] = _exact(good[0], job, layout)
    return out


def run_job(args) -> list[dict]:
    cls, seed, overrides = args
    job = make_job(cls, seed)
    _lay, healthy_steps = simulate(job, "transfer", faulty=False)
    h_time = np.array([s.true_state.iteration_time_s for s in healthy_steps])
    rows = []
    for timing in TIMINGS:
        layout, steps = simulate(job, timing, faulty=True)
        f_time = np.array([s.true_state.iteration_time_s for s in steps])
        n = min(len(h_time), len(f_time))
        loss = 1.0 - h_time[:n] / f_time[:n]
        recs = records(steps, layout)
        for mode in MODES:
            det = Detector(DetectorConfig(mode=mode, **overrides), layout=layout)
            reports = []
            t0 = time.process_time()
            for r in recs:
                reports += det.handle(r)
            cpu = time.process_time() - t0
            sc = score(job, layout, reports, loss)
            sc.update(
                cls=cls,
                seed=seed,
                timing=timing,
                mode=mode,
                cpu_per_iter_ms=1e3 * cpu / max(1, len(recs)),
                assembled=len(recs),
                signals=sorted(
                    {
                        str(r.evidence.get("signal"))
                        for r in reports
                        if r.kind.startswith("fail_slow")
                    }
                ),
            )
            rows.append(sc)
    return rows


def table(rows: list[dict], title: str) -> None:
    print(f"\n== {title}")
    head = f"   {'class':14s}"
    for timing in TIMINGS:
        for mode in MODES:
            head += f" | {timing[:5]}/{mode[:5]:5s} acc  false  delay exact"
    print(head)
    tot = {}
    for cls in CLASSES:
        line = f"   {cls:14s}"
        for timing in TIMINGS:
            for mode in MODES:
                sel = [
                    r
                    for r in rows
                    if r["cls"] == cls and r["timing"] == timing and r["mode"] == mode
                ]
                scored = [r for r in sel if r["scored"]]
                acc = np.mean([r["correct"] for r in scored]) if scored else float("nan")
                fr = np.mean([r["false"] for r in sel]) if sel else float("nan")
                dl = [r["delay"] for r in scored if r["delay"] is not None]
                ex = [r["exact"] for r in scored if r["exact"] is not None]
                t = tot.setdefault((timing, mode), [[], [], []])
                t[0] += [r["correct"] for r in scored]
                t[1] += [r["false"] for r in sel]
                t[2] += ex
                line += (
                    f" | {'':11s} {acc:4.2f} {fr:6.2f} "
                    f"{(np.mean(dl) if dl else float('nan')):6.1f} "
                    f"{(np.mean(ex) if ex else float('nan')):4.2f}"
                )
        print(line)
    line = f"   {'ALL':14s}"
    for timing in TIMINGS:
        for mode in MODES:
            a, f, e = tot[(timing, mode)]
            line += f" | {'':11s} {np.mean(a):4.2f} {np.mean(f):6.2f} {'':6s} {np.mean(e):4.2f}"
    print(line)
    below = sum(1 for r in rows if not r["scored"]) // (len(TIMINGS) * len(MODES))
    print(f"   ({below} fault jobs cost < 5 % and are left out of accuracy)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="2 jobs per class and seed set")
    ap.add_argument("--jobs", type=int, default=None, help="jobs per class and seed set (6)")
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--classes", default="all", help="comma-separated class names")
    ap.add_argument("--sets", default="tuning,held-out")
    ap.add_argument("--verbose", action="store_true", help="one line per job")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a DetectorConfig field for both modes, e.g. persist_min_iters=2 (repeatable)",
    )
    a = ap.parse_args(argv)
    try:
        overrides = parse_assignments(a.set)
    except ValueError as e:
        ap.error(str(e))
    n = a.jobs or (2 if a.quick else 6)
    classes = CLASSES if a.classes == "all" else tuple(a.classes.split(","))
    t_all = time.time()
    for which in a.sets.split(","):
        base = 0 if which == "tuning" else HELD_OUT_BASE
        tasks = [(c, base + j, overrides) for c in classes for j in range(n)]
        if a.workers > 1:
            with ProcessPoolExecutor(a.workers) as ex:
                res = [r for rs in ex.map(run_job, tasks) for r in rs]
        else:
            res = [r for t in tasks for r in run_job(t)]
        if a.verbose:
            for r in res:
                print(
                    f"   {r['cls']:14s} seed {r['seed']:5d} {r['timing']:8s} {r['mode']:9s} "
                    f"ok={int(r['correct'])} false={r['false']} delay={r['delay']} "
                    f"exact={r['exact']} scored={int(r['scored'])} {','.join(r['signals'])}"
                )
        table(res, f"{which} seeds ({n} jobs per class), {ITERS} iterations each")
        cpu = np.mean([r["cpu_per_iter_ms"] for r in res if r["mode"] == "resihp"])
        print(f"   detector CPU {cpu:.1f} ms/iteration (ResiHP mode)")
        sys.stdout.flush()
    print(f"\ntotal {time.time() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

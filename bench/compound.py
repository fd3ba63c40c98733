"""Compound failures around a replan: is every failure still found, and nothing else?

    python bench/compound.py                 # qwen2.5-7b (TP4 PP2 DP2), 12 random triples
    python bench/compound.py --model llama2-13b --cases 12

For random (GPU, dead rank, link) triples of a Table 3 layout, the simulator runs 75
iterations through the offline detector (the live code path: assembly, liveness,
Detector), with the planner standing in for the scheduler once the job hangs on a
fail-stop.  Scenarios per triple, all at iteration 30 unless said:

* ``link``: the link alone slows (x0.05);
* ``link+kill``: the link slows in the iteration a rank dies;
* ``link+gpu+kill``: a GPU (x0.6) and the link slow as the rank dies;
* ``later``: the GPU slows as the rank dies, the link 25 iterations later (90 iterations).

A link counts as found when a communication report names its rank; the GPU when a
compute report names it.  A link or GPU the plan set aside (standby) or that shares a
TP group with the other (reported as that group's) is counted apart.  Then every rank is
killed alone: any fail-slow report there is a false alarm.
"""

from __future__ import annotations

import argparse
import random
import time

from detector.config import DetectorConfig
from detector.replay import TraceReplayer
from resihp.scenario import parse_scenario
from resihp.wire import ChunkBatch
from scheduler.planner import plan
from scheduler.predict import Predictor
from trainer.sim.config import SimConfig
from trainer.sim.core import ClusterSim

AT = 30


def feed_step(rp: TraceReplayer, st) -> list:
    """One simulator step through the offline detector as the collector would see it:
    heartbeats, then the iteration's stats and rows a few ms after it ends."""
    out = []
    for h in st.heartbeat_messages():
        out += rp.feed(h, h.wall_time_s + 0.003)
    if len(st.chunk_rows):
        t_end = float(st.chunk_rows["end_s"].max()) + 0.003
        for m in st.mb_stats_messages():
            out += rp.feed(m, t_end)
        out += rp.feed(ChunkBatch(st.chunk_rows), t_end)
    return out


def run(
    model: str,
    events: list[str],
    iterations: int = 75,
    seed: int = 5,
    config: DetectorConfig | None = None,
):
    """Reports of one simulated job; the planner applies a plan 4 steps into a hang."""
    cfg = SimConfig(
        model=model, seq_len=8192, microbatches=4, schedule="1f1b", speed=0.0,
        iterations=iterations, seed=seed, noise=0.03, heartbeat_interval_s=1.0,
    )  # fmt: skip
    sim = ClusterSim(cfg, parse_scenario("events:\n" + "".join(f"  - {e}\n" for e in events)))
    rp = TraceReplayer(config or DetectorConfig(warmup_iters=10), layout=cfg.initial_layout())
    pred = Predictor(cfg.model, cfg.seq_len, 80.0)
    reports, hung, steps, standby = [], 0, 0, set()

    def feed(st):
        return feed_step(rp, st)

    while sim.iteration < iterations and steps < 400:
        st = sim.step()
        steps += 1
        reports += feed(st)
        if st.true_state.status == "hung":
            hung += 1
            if hung == 4:
                p = {r: h["p"] for r, h in rp.detector.health.items()}
                new = plan(sim.layout, p, pred).after
                standby |= set(new.standby)
                reports += feed(sim.apply_layout(new))
                rp.set_layout(new)
    return reports + rp.finish(), standby


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    lay = SimConfig(model=a.model, seq_len=8192, microbatches=4).initial_layout()
    ranks = lay.active_ranks()
    group = {r: (d, s) for r, (d, s, _t) in lay.coords().items()}
    rng = random.Random(a.seed)
    print(f"{a.model}: {lay.world_size} GPUs, groups {lay.groups}")
    modes = ("link", "link+kill", "link+gpu+kill", "later")
    found = {m: [0, 0] for m in modes}  # [found, judged]
    gpu_found = [0, 0]
    apart = 0
    for _ in range(a.cases):
        gpu, dead, link = rng.sample(ranks, 3)
        sd = f"{{at_iteration: {AT}, action: slow_device, rank: {gpu}, factor: 0.6}}"
        kd = f"{{at_iteration: {AT}, action: kill_device, rank: {dead}}}"

        def lk(at: int, link=link) -> str:
            return f"{{at_iteration: {at}, action: slow_link, rank: {link}, factor: 0.05}}"

        row = []
        same_group = group[gpu] == group[link]
        for m, evs, its in (
            ("link", [lk(AT)], 75),
            ("link+kill", [kd, lk(AT)], 75),
            ("link+gpu+kill", [sd, kd, lk(AT)], 75),
            ("later", [sd, kd, lk(AT + 25)], 90),
        ):
            reps, standby = run(a.model, evs, its)
            comm = any(r.kind == "fail_slow_comm" and link in r.ranks for r in reps)
            if link in standby:
                row.append(f"{m}=aside")
            else:
                found[m][0] += comm
                found[m][1] += 1
                row.append(f"{m}={'Y' if comm else 'N'}")
            if m == "link+gpu+kill":
                hit = any(r.kind == "fail_slow_compute" and gpu in r.ranks for r in reps)
                if gpu in standby or same_group:
                    apart += 1
                    row.append("gpu=" + ("aside" if gpu in standby else "same group"))
                else:
                    gpu_found[0] += hit
                    gpu_found[1] += 1
                    row.append(f"gpu={'Y' if hit else 'N'}")
        print(f"  gpu {gpu:3d} dead {dead:3d} link {link:3d}: " + "  ".join(row), flush=True)
    print("found / judged:")
    for m in modes:
        print(f"  link, {m:14s} {found[m][0]:3d} / {found[m][1]}")
    print(f"  gpu, link+gpu+kill  {gpu_found[0]:3d} / {gpu_found[1]}  ({apart} counted apart)")
    false = 0
    for r in ranks:
        reps, _ = run(a.model, [f"{{at_iteration: {AT}, action: kill_device, rank: {r}}}"], 60)
        false += sum(1 for x in reps if x.kind.startswith("fail_slow"))
    print(f"fail-stop alone, every rank killed once: {false} fail-slow reports (false alarms)")
    print(f"[{time.perf_counter() - t0:.0f} s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

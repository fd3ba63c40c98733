"""Dashboard cost at scale: what one live refresh of a 16,384-GPU job sends and takes.

Prints, side by side, the aggregated device-skew heatmap against a naive
one-cell-per-GPU heatmap (bytes sent to the browser, build time), the Redis
read of 16k device-health entries, a /metrics render, and a pipeline timeline
plus its DAG prediction for a PP16 x 64 micro-batch iteration.

    python bench/dashboard_scale.py
"""

from __future__ import annotations

import json
import time

import numpy as np

from dashboard import figures, figures_skew
from dashboard.data import DashboardData
from dashboard.metrics import render
from dashboard.predict import predict_healthy
from resihp import bus
from resihp.keys import JobKeys
from resihp.redis_client import EmbeddedRedis
from resihp.schemas import IterationRecord
from resihp.topology import Layout


def timed(fn, repeat: int = 3):
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def main() -> None:
    world, dpn = 16384, 8
    rng = np.random.default_rng(0)
    p = np.clip(rng.normal(0.98, 0.01, world), 0, 1)
    p[rng.choice(world, 5, replace=False)] = 0.4
    health = {r: {"p": float(p[r]), "state": "healthy"} for r in range(world)}
    lay = Layout.uniform(tp=8, pp=16, dp=128, num_layers=80, num_microbatches=64)

    def aggregated():
        pa, st = figures_skew.device_arrays(world, health, dead=[11, 12], standby=[40])
        g = figures_skew.skew_grid(pa, st, dpn, max_rows=64)
        return figures_skew.skew_heatmap_figure(g, dpn).to_json()

    def naive():
        import plotly.graph_objects as go

        z = p.reshape(-1, dpn).tolist()
        return go.Figure(go.Heatmap(z=z, y=[f"node {i}" for i in range(len(z))])).to_json()

    def coords():
        pa, _ = figures_skew.device_arrays(world, health)
        return figures_skew.coord_heatmap_figure(pa, lay.groups).to_json()

    agg_json, agg_s = timed(aggregated)
    naive_json, naive_s = timed(naive)
    coord_json, coord_s = timed(coords)
    print(f"{'16,384 GPUs':<40}{'aggregated':>14}{'naive per-GPU':>16}{'ratio':>8}")
    print(
        f"{'skew heatmap JSON (bytes)':<40}{len(agg_json):>14,}{len(naive_json):>16,}"
        f"{len(naive_json) / len(agg_json):>8.1f}"
    )
    print(
        f"{'skew heatmap build (ms)':<40}{agg_s * 1e3:>14.1f}{naive_s * 1e3:>16.1f}"
        f"{naive_s / agg_s:>8.1f}"
    )
    print(
        f"{'(stage x DP) heatmap JSON bytes / ms':<40}{len(coord_json):>14,}{coord_s * 1e3:>16.1f}"
    )

    with EmbeddedRedis(appendonly=False) as srv:
        r = srv.client()
        keys = JobKeys("big")
        bus.register_job(r, keys)
        r.set(keys.layout, json.dumps(lay.to_dict()))
        r.hset(keys.device_health, mapping={str(k): json.dumps(v) for k, v in health.items()})
        r.hset(keys.node_heartbeat, mapping={str(n): time.time() for n in range(world // dpn)})
        data = DashboardData(r, hash_ttl_s=0.0)
        _, read_s = timed(lambda: data.device_health("big"))
        text, metrics_s = timed(lambda: render(data), repeat=2)
        print(f"{'read device_health hash (16k entries), ms':<40}{read_s * 1e3:>14.1f}")
        print(f"{'/metrics render, ms / bytes':<40}{metrics_s * 1e3:>14.1f}{len(text):>16,}")

        # One full IterationRecord of the 16k job: DP128 x PP16 x 64 micro-batches x F/B.
        grid = np.stack(
            np.meshgrid(
                np.arange(lay.dp), np.arange(lay.pp), np.arange(64), np.arange(2), indexing="ij"
            ),
            -1,
        ).reshape(-1, 4)
        dur = np.where(grid[:, 3] == 0, 0.01, 0.02) * (1 + 0.01 * rng.random(len(grid)))
        start = (grid[:, 2] * 0.03 + grid[:, 1] * 0.01 + grid[:, 3] * 0.5).astype(float)
        rec = IterationRecord(
            iteration=0,
            iteration_time_s=3.0,
            start_s=1e9,
            end_s=1e9 + 3,
            samples=8192,
            tokens=1,
            num_ranks_reporting=world,
            chunks={
                "dp": grid[:, 0].tolist(),
                "stage": grid[:, 1].tolist(),
                "src_dp": grid[:, 0].tolist(),
                "microbatch": grid[:, 2].tolist(),
                "kind": np.where(grid[:, 3] == 0, "F", "B").tolist(),
                "direction": [0] * len(grid),
                "start_s": (1e9 + start).tolist(),
                "duration_s": dur.tolist(),
            },
        )
        bus.publish(r, keys.iterations, rec)
        size = sum(len(v) for v in r.xrevrange(keys.iterations, count=1)[0][1].values())
        data = DashboardData(r)
        _, rec_s = timed(lambda: DashboardData(r).iteration_record("big"), repeat=2)
        full = data.iteration_record("big")
        _, cached_s = timed(lambda: data.iteration_record("big"))
        _, tl16_s = timed(lambda: figures.timeline_figure(full["chunks"]).to_json(), repeat=2)
        _, pred16_s = timed(
            lambda: predict_healthy(lay, dict(full, end_s=time.time()), health), repeat=1
        )
        from dashboard.perfetto import chrome_trace_json, trace_replicas

        dps = trace_replicas(full["chunks"], None)
        tr, tr_s = timed(lambda: chrome_trace_json(full, lay, None, "big", dps), repeat=1)
        print(f"{'16k record: chunks / bytes in Redis':<40}{len(grid):>14,}{size:>16,}")
        print(
            f"{'16k record: read+validate ms / cached ms':<40}{rec_s * 1e3:>14.1f}{cached_s * 1e3:>16.2f}"
        )
        print(f"{'16k timeline (4 of 128 replicas) ms':<40}{tl16_s * 1e3:>14.1f}")
        print(f"{'16k DAG-predicted healthy timeline ms':<40}{pred16_s * 1e3:>14.1f}")
        print(f"{'16k Perfetto (4 replicas, 512 ranks) ms/B':<40}{tr_s * 1e3:>14.1f}{len(tr):>16,}")

    small = Layout.uniform(tp=1, pp=16, dp=4, num_layers=80, num_microbatches=64)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dashboard_scenario import simulate

    cols, _ = simulate(small, {5: 0.5}, 0.0)
    hp = {r: {"p": 0.5 if r == 5 else 1.0} for r in range(small.world_size)}
    fig_json, tl_s = timed(lambda: figures.timeline_figure(cols).to_json())
    _, pred_s = timed(
        lambda: predict_healthy(small, {"chunks": cols, "iteration": time.time()}, hp)
    )
    print(f"{'timeline PP16 x 64 mb x 4 DP: chunks':<40}{len(cols['stage']):>14,}")
    print(f"{'timeline figure build ms / JSON bytes':<40}{tl_s * 1e3:>14.1f}{len(fig_json):>16,}")
    print(f"{'DAG-predicted healthy timeline, ms':<40}{pred_s * 1e3:>14.1f}")
    failure_marks()
    incident_builds()


def incident_builds() -> None:
    """The overview looks for open incidents among the newest 200 reports every second and
    the incidents page lists 100: each one built from the same 2,000 iteration rows. The
    rows' columns cached once per refresh (``incidents.WallRows``) against each incident
    sorting and converting them again (a plain list, as before the cache)."""
    from dashboard import incidents
    from resihp.schemas import AdaptationPlan, FailureReport

    t0 = 1e9
    rows = [
        {
            "iteration": i,
            "iteration_time_s": 1.0,
            "samples_per_s": 10.0,
            "samples": 10,
            "start_s": float(i),
            "end_s": i + 1.0,
            "published_s": t0 + i + 1.0,
        }
        for i in range(2000)
    ]
    wr = incidents.wall_rows(rows)
    fails = [
        FailureReport(
            report_id=f"f{i}",
            kind="fail_stop" if i % 2 else "recovery",
            ranks=[i % 16],
            nodes=[0],
            detected_at_s=t0 + 12 + 6 * i,
            iteration=10 + 6 * i,
            evidence={"change_point": 9 + 6 * i},
        )
        for i in range(300)
    ]
    lay = {"layers": [4, 4], "groups": [[[0], [1]]]}
    hist = [
        AdaptationPlan(
            plan_id=j + 1,
            state="superseded",
            created_at_s=t0 + 10 + 4 * j,
            updated_at_s=t0 + 11 + 4 * j,
            reason="x",
            before=lay,
            after=lay,
            predicted_before_s=1.0,
            predicted_after_s=0.8,
            failure_ids=[f"f{(3 * j) % 300}"],
        )
        for j in range(400)
    ]
    ids = [f.report_id for f in incidents.list_incidents(fails)]

    def build(rs):
        for rid in ids:
            incidents.build_incident("j", rid, fails, hist, [], rs(), audit=[], now_s=t0 + 2005)

    _, cached_s = timed(lambda: build(lambda: wr), repeat=2)
    _, plain_s = timed(lambda: build(lambda: list(wr)), repeat=2)
    n = len(ids)
    print(
        f"\n{'incidents built (2,000 rows, 400 plans)':<40}{'cached cols':>14}{'per incident':>16}{'ratio':>8}"
    )
    print(
        f"{f'{n} incidents, ms':<40}{cached_s * 1e3:>14.1f}{plain_s * 1e3:>16.1f}"
        f"{plain_s / cached_s:>7.1f}x"
    )


def failure_marks() -> None:
    """The overview's throughput chart marks every failure with a vertical line, rebuilt
    every second: one ``add_vline`` per failure (each re-validates the whole layout)
    against all lines set in one layout update (``figures.throughput_figure``)."""
    from resihp.schemas import FailureReport

    rows = [
        {"iteration": i, "samples_per_s": 10.0, "iteration_time_s": 1.0, "published_s": 1e9 + i}
        for i in range(600)
    ]
    print(
        f"\n{'throughput chart, failures marked':<40}{'one update':>14}{'add_vline each':>16}{'ratio':>8}"
    )
    for n in (10, 100, 300):
        fails = [
            FailureReport(
                report_id=f"f{i}",
                kind="fail_slow_compute",
                ranks=[1],
                nodes=[0],
                detected_at_s=1e9 + i,
                iteration=i,
            )
            for i in range(n)
        ]

        def naive(fails=fails):
            fig = figures.throughput_figure(rows)
            for f in fails:
                fig.add_vline(x=figures._ts(f.detected_at_s).timestamp() * 1000, line={"width": 1})
            return fig

        _, one_s = timed(lambda fails=fails: figures.throughput_figure(rows, fails), repeat=2)
        _, each_s = timed(naive, repeat=1)
        print(
            f"{f'{n} failures, ms':<40}{one_s * 1e3:>14.1f}{each_s * 1e3:>16.1f}{each_s / one_s:>7.0f}x"
        )


if __name__ == "__main__":
    main()

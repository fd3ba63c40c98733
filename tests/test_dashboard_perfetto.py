"""Chrome/Perfetto trace export: one track per rank, microsecond events, migrations flagged."""

from __future__ import annotations

import json

from dashboard_scenario import simulate

from dashboard.perfetto import chrome_trace, chrome_trace_json
from resihp.topology import Layout


def test_one_track_per_rank_with_every_chunk():
    lay = Layout.uniform(tp=2, pp=4, dp=2, num_layers=32, num_microbatches=8)
    cols, t = simulate(lay, {}, 1000.0)
    pred, _ = simulate(lay, {}, 0.0)
    tr = json.loads(chrome_trace_json({"iteration": 7, "chunks": cols}, lay, pred, "job-a"))
    ev = tr["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert sorted(tid for pid, tid in names if pid == 1) == list(range(16))
    assert names[(1, 5)] == "rank 5 (dp0 stage1)"
    xs = [e for e in ev if e["ph"] == "X" and e["pid"] == 1]
    assert len(xs) == len(cols["stage"]) * 2  # each TP-group chunk drawn on both ranks
    assert min(e["ts"] for e in xs) == 0.0
    assert max(e["ts"] + e["dur"] for e in xs) == __import__("pytest").approx(t * 1e6, rel=1e-6)
    assert any(e["pid"] == 2 for e in ev if e["ph"] == "X")  # predicted process


def test_without_layout_uses_rank_columns_and_flags_migration():
    rec = {
        "iteration": 1,
        "chunks": {
            "dp": [1],
            "stage": [0],
            "src_dp": [0],
            "microbatch": [3],
            "kind": ["F"],
            "start_s": [5.0],
            "duration_s": [0.001],
        },
        "ranks": {"rank": [4, 5, 6], "dp": [1, 1, 0], "stage": [0, 0, 0]},
    }
    tr = chrome_trace(rec)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["tid"] for e in xs) == [4, 5]
    assert xs[0]["args"]["migrated"] and "from dp0" in xs[0]["name"]
    assert xs[0]["dur"] == 1000.0


def test_big_jobs_export_the_chosen_replicas():
    from dashboard.perfetto import trace_replicas

    lay = Layout.uniform(tp=2, pp=2, dp=12, num_layers=4, num_microbatches=2)
    cols, _ = simulate(lay, {}, 0.0)
    assert trace_replicas(cols, None) == [0, 1, 2, 3]
    assert trace_replicas(cols, [7, 3]) == [3, 7]
    assert trace_replicas({"dp": [0, 1]}, None) is None
    tr = chrome_trace({"iteration": 1, "chunks": cols}, lay, dps=[3, 7])
    tids = {e["tid"] for e in tr["traceEvents"] if e["ph"] == "X"}
    assert tids == {r for d in (3, 7) for st in lay.groups[d] for r in st}
    assert tr["otherData"]["dp_replicas"] == [3, 7]


def test_p2p_events_name_what_flows():
    rec = {
        "iteration": 1,
        "chunks": {
            "dp": [0, 0, 0],
            "stage": [1, 1, 1],
            "src_dp": [-1, -1, -1],
            "microbatch": [2, 2, 2],
            "kind": ["RECV", "RECV", "F"],
            "direction": [1, -1, 0],
            "start_s": [1.0, 2.0, 1.1],
            "duration_s": [0.01, 0.01, 0.1],
        },
        "ranks": {"rank": [3], "dp": [0], "stage": [1]},
    }
    names = sorted(e["name"] for e in chrome_trace(rec)["traceEvents"] if e["ph"] == "X")
    assert names == ["F mb2", "RECV act mb2", "RECV grad mb2"]


def test_a_trace_on_a_layout_that_is_not_the_records_keeps_the_ranks_that_ran():
    lay0 = Layout.uniform(tp=2, pp=4, dp=2, num_layers=32, num_microbatches=8)
    cols, _ = simulate(lay0, {}, 10.0)
    n = lay0.world_size
    coords = lay0.coords()
    rec = {
        "iteration": 5,
        "chunks": cols,
        "ranks": {
            "rank": list(range(n)),
            "dp": [coords[k][0] for k in range(n)],
            "stage": [coords[k][1] for k in range(n)],
        },
    }
    lay1 = lay0.copy()  # today's: rank 5 set aside, its partner alone in the group
    d, s = next((d, s) for d in range(2) for s in range(4) if 5 in lay0.groups[d][s])
    lay1.groups[d][s] = [x for x in lay0.groups[d][s] if x != 5]
    lay1.standby = [5]
    tids = {e["tid"] for e in chrome_trace(rec, lay1)["traceEvents"] if e["ph"] == "X"}
    assert tids == set(range(16))
    tids = {e["tid"] for e in chrome_trace(rec, lay0)["traceEvents"] if e["ph"] == "X"}
    assert tids == set(range(16))
    # a big job reports TP rank 0 of each group only: its own layout still gives every rank
    tp0 = {k: [v for i, v in enumerate(col) if i % 2 == 0] for k, col in rec["ranks"].items()}
    tids = {
        e["tid"] for e in chrome_trace({**rec, "ranks": tp0}, lay0)["traceEvents"] if e["ph"] == "X"
    }
    assert tids == set(range(16))

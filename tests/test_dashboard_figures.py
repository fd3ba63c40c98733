"""Pure dashboard logic: figures, aggregation at 16k GPUs, bubbles, prediction, config."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dashboard_scenario import simulate

from dashboard import figures, figures_skew
from dashboard.config import DashboardConfig, operators_from_env, parse_operators
from dashboard.predict import predict_healthy
from resihp.schemas import FailureReport
from resihp.topology import Layout


def _layout():
    return Layout.uniform(tp=2, pp=4, dp=2, num_layers=32, num_microbatches=8)


def _failure(rid, kind, ranks, t, it=10, **ev):
    return FailureReport(
        report_id=rid,
        kind=kind,
        ranks=ranks,
        nodes=sorted({r // 8 for r in ranks}),
        detected_at_s=t,
        iteration=it,
        evidence=ev,
    )


def test_bubble_ratio_exact_on_toy_pipeline():
    # Stage 0 computes 0-1 and 3-4; stage 1 computes 1-3: span 4 s.
    cols = {
        "dp": [0, 0, 0],
        "stage": [0, 1, 0],
        "microbatch": [0, 0, 0],
        "kind": ["F", "F", "B"],
        "start_s": [0.0, 1.0, 3.0],
        "duration_s": [1.0, 2.0, 1.0],
    }
    b = figures.bubble_ratios(cols)
    assert b[(0, 0)] == pytest.approx(0.5)
    assert b[(0, 1)] == pytest.approx(0.5)
    # Communication chunks do not count as busy time.
    cols2 = {k: [*v, v[-1]] for k, v in cols.items()}
    cols2["kind"][-1] = "SEND"
    assert figures.bubble_ratios(cols2)[(0, 0)] == pytest.approx(0.5)


def test_slow_stage_has_fewer_bubbles_than_its_neighbours():
    lay = _layout()
    healthy, _ = simulate(lay, {}, 0.0)
    slow, _ = simulate(lay, {5: 0.5}, 0.0)  # rank 5 is dp0 stage1
    hb, sb = figures.bubble_ratios(healthy), figures.bubble_ratios(slow)
    assert sb[(0, 1)] < sb[(0, 0)] and sb[(0, 1)] < sb[(0, 2)]
    assert sb[(0, 0)] > hb[(0, 0)]  # the slow device makes the others wait
    assert all(0.0 <= v <= 1.0 for v in sb.values())


def test_timeline_marks_migrations_and_adds_predicted_panel():
    cols = {
        "dp": [0, 1],
        "stage": [0, 0],
        "src_dp": [0, 0],
        "microbatch": [0, 1],
        "kind": [0, 0],
        "start_s": [10.0, 10.5],
        "duration_s": [0.2, 0.2],
    }
    fig = figures.timeline_figure(cols)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.name for b in bars] == ["F", "F (migrated)"]  # kind codes mapped to names
    assert bars[0].marker.line.width == 0.5 and bars[1].marker.line.width == 2.5
    assert bars[1].marker.pattern.shape == "/" and list(bars[1].y) == ["dp1 s0 (71% bubble)"]
    assert bars[1].text[0] == "1←dp0"  # micro-batch 1 of dp0, running on dp1
    assert bars[0].base[0] == pytest.approx(0.0) and bars[0].x[0] == pytest.approx(200.0)
    fig2 = figures.timeline_figure(cols, predicted=cols)
    assert {t.yaxis for t in fig2.data} == {"y", "y2"}
    assert figures.timeline_figure({}).layout.annotations[0].text.startswith("no chunk")


def test_timeline_limits_replicas():
    cols = {
        "dp": list(range(10)),
        "stage": [0] * 10,
        "microbatch": [0] * 10,
        "kind": ["F"] * 10,
        "start_s": [0.0] * 10,
        "duration_s": [1.0] * 10,
    }
    fig = figures.timeline_figure(cols, max_replicas=4)
    assert len(fig.data[0].y) == 4
    fig = figures.timeline_figure(cols, dps=[7, 9])
    assert sorted({y.split()[0] for y in fig.data[0].y}) == ["dp7", "dp9"]


def test_skew_grid_16k_gpus_aggregates_and_drills_down():
    world, dpn = 16384, 8
    health = {r: {"p": 1.0} for r in range(world)}
    health[12345] = {"p": 0.31}
    p, state = figures_skew.device_arrays(world, health, dead=[777], standby=[16000])
    grid = figures_skew.skew_grid(p, state, dpn, max_rows=64)
    assert grid.level == "groups" and len(grid.z) == 64 and grid.cells == 64 * 8
    assert grid.nodes_per_row == 32
    node = 12345 // dpn
    row, col = node // 32, 12345 % dpn
    assert grid.z[row][col] == pytest.approx(0.31)  # min keeps one slow GPU visible
    drow = 777 // dpn // 32
    assert grid.z[drow][777 % 8] == 0.0 and "1 dead" in grid.text[drow][777 % 8]
    assert any(k == "standby" for _, _, k in grid.marks)
    fig = figures_skew.skew_heatmap_figure(grid, dpn)
    assert len(fig.to_json()) < 200_000  # never one element per device in the browser
    lo, hi = grid.row_nodes[row]
    sub = figures_skew.skew_grid(p, state, dpn, (lo, hi), max_rows=64)
    assert sub.level == "nodes" and len(sub.z) == 32
    assert sub.z[node - lo][col] == pytest.approx(0.31)
    assert sub.row_labels[node - lo] == f"node {node}"


def test_skew_grid_unknown_devices_are_blank():
    p, state = figures_skew.device_arrays(20, {3: {"p": 0.8}})
    grid = figures_skew.skew_grid(p, state, 8)
    assert len(grid.z) == 3 and grid.z[0][3] == 0.8 and grid.z[0][0] is None
    assert grid.z[2][4] is None  # padding beyond the world
    # Working ranks the detector has not flagged are healthy once it reports anything.
    p, _ = figures_skew.device_arrays(20, {3: {"p": 0.8}}, active=list(range(16)))
    assert p[0] == 1.0 and p[3] == 0.8 and np.isnan(p[17])
    p, _ = figures_skew.device_arrays(20, {}, active=list(range(16)))
    assert np.isnan(p[0])  # no detector output at all: unknown


def test_coord_grid_buckets_replicas_and_takes_group_min():
    lay = Layout.uniform(tp=2, pp=2, dp=200, num_layers=4, num_microbatches=2)
    p = np.ones(lay.world_size)
    slow = lay.groups[150][1][1]
    p[slow] = 0.4
    z, xl, yl, _ = figures_skew.coord_grid(p, lay.groups, max_cols=64)
    assert len(yl) == 2 and len(xl) == 50  # 4 replicas per column
    assert z[1][150 // 4] == pytest.approx(0.4) and z[0][150 // 4] == 1.0
    _, _, _, text = figures_skew.coord_grid(p, lay.groups, max_cols=64)
    assert text[1][150 // 4].endswith(f"min at rank {slow} (dp150, stage 1, tp1)")
    assert text[0][0] == "TP 2"


def test_predicted_series_priority_and_change_points():
    rows = [{"iteration": i, "iteration_time_s": 1.0} for i in range(6)]
    rows[5]["predicted_iteration_time_s"] = 0.7
    fails = [_failure("a", "fail_slow_compute", [1], 0.0, it=3, predicted_s=0.9, change_point=2)]
    assert figures.predicted_series(rows, fails, 0.8) == [0.8, 0.8, 0.8, 0.9, 0.9, 0.7]
    assert figures.change_points(fails) == [2]
    # The detector's own keys: predicted_healthy_s wins, change point given as a dict.
    det = _failure(
        "b",
        "fail_slow_compute",
        [1],
        0.0,
        it=4,
        predicted_healthy_s=0.6,
        predicted_iteration_time_s=0.95,
        change_point={"iteration": 3, "direction": 1},
    )
    assert figures.predicted_series(rows[:5], [det]) == [None] * 4 + [0.6]
    assert figures.change_points([det]) == [3]
    fig = figures.iteration_time_figure(rows, fails, 0.8)
    names = [t.name for t in fig.data]
    assert "predicted (healthy)" in names and "failure" in names
    assert any(s.x0 == 2 for s in fig.layout.shapes)


def test_recurring_culprits_and_filters():
    fs = [
        _failure("a", "fail_slow_compute", [5], 100.0),
        _failure("b", "fail_slow_compute", [5, 9], 200.0),
        _failure("c", "fail_stop", [9], 300.0),
        _failure("d", "recovery", [5], 400.0),
    ]
    top = figures.recurring_culprits(fs, 8)
    assert [(c["rank"], c["reports"]) for c in top[:2]] in ([(5, 2), (9, 2)], [(9, 2), (5, 2)])
    assert {c["rank"] for c in top} == {5, 9}
    assert [f.report_id for f in figures.filter_failures(fs, 8, kinds=["fail_stop"])] == ["c"]
    assert [f.report_id for f in figures.filter_failures(fs, 8, rank=5)] == ["a", "b", "d"]
    assert [f.report_id for f in figures.filter_failures(fs, 8, node=1)] == ["b", "c"]
    assert [f.report_id for f in figures.filter_failures(fs, 8, since_s=150, until_s=350)] == [
        "b",
        "c",
    ]


def test_plan_diff_rows_flag_changes():
    before = _layout()
    after = before.copy()
    after.layers = [9, 7, 8, 8]
    after.groups[0][1] = [2]
    after.standby = [3]
    rows = {r["what"]: r for r in figures.plan_diff_rows(before.to_dict(), after.to_dict())}
    assert rows["stage 0 layers"]["changed"] and rows["stage 1 layers"]["after"] == "7"
    assert not rows["stage 2 layers"]["changed"]
    assert rows["stage 1 TP per DP replica"]["after"] == "1/2"
    assert rows["standby ranks"]["changed"] and not rows["dead ranks"]["changed"]
    assert rows["ranks leaving work"]["after"] == "4, 5" and rows["ranks leaving work"]["changed"]
    assert not rows["ranks joining work"]["changed"]
    assert not rows["migrated micro-batch stages"]["changed"]


def test_dag_prediction_recovers_the_healthy_timeline():
    lay = _layout()
    healthy, healthy_t = simulate(lay, {}, 50.0)
    slow, slow_t = simulate(lay, {5: 0.5}, 50.0)
    health = {r: {"p": 0.5 if r == 5 else 1.0} for r in range(16)}
    res = predict_healthy(lay, {"chunks": slow, "iteration": 1, "end_s": 50 + slow_t}, health)
    assert slow_t > healthy_t * 1.3
    assert res["iteration_time_s"] == pytest.approx(healthy_t, rel=1e-6)
    assert len(res["chunks"]["stage"]) == len(healthy["stage"])
    assert min(res["chunks"]["start_s"]) == pytest.approx(50.0)
    # Without device health the prediction is the observed critical path.
    res2 = predict_healthy(lay, {"chunks": slow, "iteration": 2, "end_s": 1.0}, {})
    assert res2["iteration_time_s"] == pytest.approx(slow_t, rel=1e-6)
    assert predict_healthy(None, {"chunks": slow}) is None


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="port"):
        DashboardConfig(port=70000)
    with pytest.raises(ValueError, match="refresh_interval_s"):
        DashboardConfig(refresh_interval_s=5.0)
    with pytest.raises(ValueError, match="job_id"):
        DashboardConfig(job_id="bad job")
    assert parse_operators("alice:s3:cret, bob:pw") == {"alice": "s3:cret", "bob": "pw"}
    with pytest.raises(ValueError, match="entry 2"):
        parse_operators("alice:pw,bob")
    env = {
        "RESIHP_OPERATORS": "alice:pw",
        "RESIHP_OPERATOR_USER": "carol",
        "RESIHP_OPERATOR_PASSWORD": "x",
    }
    assert operators_from_env(env) == {"alice": "pw", "carol": "x"}
    with pytest.raises(ValueError, match="together"):
        operators_from_env({"RESIHP_OPERATOR_USER": "carol"})
    assert DashboardConfig().host == "127.0.0.1" and DashboardConfig().port == 8050
    from dashboard.__main__ import _serve_parser
    from dashboard.config import config_from_args

    cfg = config_from_args(_serve_parser().parse_args([]), env={"REDIS_URL": "redis://x:1/0"})
    assert (cfg.host, cfg.port, cfg.redis_url) == ("127.0.0.1", 8050, "redis://x:1/0")
    assert cfg.refresh_interval_s <= 1.0 and cfg.operators == {}


def test_evidence_figure_and_failure_rows():
    f = _failure(
        "x",
        "fail_slow_comm",
        [3, 4],
        1000.0,
        observed_s=2.0,
        predicted_s=1.0,
        ratios={"3": 0.5, "4": 0.9},
    )
    fig = figures.evidence_figure(f)
    # time/predicted ratios: the slowest rank first
    assert list(fig.data[0].y) == [0.9, 0.5] and list(fig.data[1].y) == [2.0, 1.0]
    assert "slowest first" in fig.layout.annotations[0].text
    # the detector's own key wins over the older ones
    g = _failure("g", "fail_slow_compute", [3, 4], 1.0, rank_ratios={"3": 1.7, "4": 1.02})
    assert list(figures.evidence_figure(g).data[0].x) == ["rank 3", "rank 4"]
    # without ratios: p_i, lowest first
    h = _failure("h", "fail_slow_compute", [3, 4], 1.0)
    h.severity = {"3": 0.9, "4": 0.4}
    fig = figures.evidence_figure(h)
    assert list(fig.data[0].y) == [0.4, 0.9] and fig.layout.annotations[0].text == "per-rank p_i"
    # a dead rank (p = 0) has no bar: its value is written, on a 0..1 axis (plotly's
    # automatic range for all-zero bars was -1..1, an empty-looking chart)
    h.severity = {"150": 0.0}
    fig = figures.evidence_figure(h)
    assert list(fig.data[0].text) == ["0.00 dead"] and tuple(fig.layout.yaxis.range) == (0, 1.1)
    row = figures.failure_rows([f], 8)[0]
    assert row["ranks"] == "3, 4" and row["nodes"] == "0" and row["kind"] == "fail_slow_comm"
    json.dumps(row)


def test_timeline_names_what_p2p_chunks_carry():
    cols = {
        "dp": [0, 0, 0, 0],
        "stage": [1, 1, 1, 1],
        "src_dp": [-1, -1, -1, -1],
        "microbatch": [0, 0, 0, 1],
        "kind": ["RECV", "F", "RECV", "RECV"],
        "direction": [1, 0, -1, 0],
        "start_s": [0.0, 0.1, 0.5, 0.6],
        "duration_s": [0.05, 0.2, 0.05, 0.05],
    }
    fig = figures.timeline_figure(cols)
    names = [t.name for t in fig.data if t.type == "bar"]
    assert names == ["F", "RECV act", "RECV grad", "RECV"]  # legend order follows the kinds
    grad = next(t for t in fig.data if t.name == "RECV grad")
    assert list(grad.base) == [500.0] and "RECV grad mb" in grad.hovertemplate


def test_predicted_series_keeps_evidence_to_the_layout_it_was_reported_under():
    """The newest failure's evidence stood for every later row: after two plans changed the
    layout the gauge still showed the first failure's predicted time (3.12 s at 2.47 s)."""
    rows = [{"iteration": i, "iteration_time_s": 1.0, "layout_id": i // 4} for i in range(12)]
    fails = [_failure("a", "fail_slow_compute", [1], 0.0, it=2, predicted_healthy_s=0.9)]
    pred = figures.predicted_series(rows, fails, 0.5, healthy_layout_id=2)
    # layout 0 before the report: no prediction of that layout; layout 1: none either
    assert pred == [None, None, 0.9, 0.9] + [None] * 4 + [0.5] * 4
    # without the current layout's id the DAG prediction stands for any uncovered row
    assert figures.predicted_series(rows, fails, 0.5) == [0.5, 0.5, 0.9, 0.9] + [0.5] * 8


def test_dag_prediction_runs_migrated_chunks_in_the_simulators_order():
    # The layout of the probe's plan 7: 13 migrated micro-batch stages, all devices healthy.
    from resihp.assembly import build_record
    from resihp.topology import Migration
    from trainer.sim import ClusterSim, SimConfig

    cfg = SimConfig(model="llama2-7b", tp=4, pp=2, dp=2, microbatches=8, noise=0.0, seed=1)
    lay = cfg.initial_layout()
    lay.layers = [15, 17]
    lay.migrations = [
        Migration(*m)
        for m in (
            (0, 0, 7, 1),
            (0, 1, 3, 0),
            (0, 1, 4, 0),
            (0, 1, 5, 0),
            (0, 1, 6, 0),
            (0, 1, 7, 0),
            (1, 0, 1, 1),
            (1, 0, 2, 1),
            (1, 0, 6, 1),
            (1, 0, 7, 1),
            (1, 1, 4, 0),
            (1, 1, 5, 0),
            (1, 1, 7, 0),
        )
    ]
    lay.validate()
    step = ClusterSim(cfg, layout=lay).step()
    rec = build_record(step.iteration, step.chunk_rows, step.mb_stats_messages()).to_dict()
    res = predict_healthy(lay, rec, {})
    # healthy devices: the prediction is the observed iteration (it was 2.25 s for 1.70 s)
    assert res["iteration_time_s"] == pytest.approx(rec["iteration_time_s"], rel=1e-4)
    moved = [s != d for s, d in zip(res["chunks"]["src_dp"], res["chunks"]["dp"], strict=True)]
    assert sum(moved) == 13 * 2  # each migrated micro-batch stage: its F and its B
    # A device the detector holds slow: its chunks get shorter in the order that ran, so
    # the healthy prediction is never slower than what was observed (an order re-timed on
    # the shortened chunks was, by up to 4 %).
    for grp in (g for st in lay.groups for g in st):
        for p in (0.6, 0.3684):
            res = predict_healthy(lay, rec, {grp[0]: {"p": p}})
            assert res["iteration_time_s"] <= rec["iteration_time_s"] * (1 + 1e-6), (grp, p)


def _rows_at(ends):
    return [
        {"iteration": i, "samples_per_s": 10.0, "iteration_time_s": 1.0, "published_s": t}
        for i, t in enumerate(ends)
    ]


def test_throughput_line_breaks_where_the_job_stood_still():
    rng = np.random.default_rng(0)
    ends = list(1e9 + np.cumsum(rng.uniform(1.6, 1.8, 40)))
    ends[20:] = [t + 150.0 for t in ends[20:]]  # hung 2.5 min after iteration 19
    fig = figures.throughput_figure(_rows_at(ends))
    xs, its = list(fig.data[0].x), list(fig.data[0].customdata)
    assert len(xs) == 41 and xs[20] is None and its[19:22] == [19, None, 20]
    assert fig.data[0].y[20] is None
    # jitter and one slow iteration are the job running, not a stall
    ends = list(1e9 + np.cumsum(rng.uniform(1.6, 1.8, 40)))
    ends[10:] = [t + 4.0 for t in ends[10:]]
    assert None not in list(figures.throughput_figure(_rows_at(ends)).data[0].x)
    # a fast job (20 iterations/s) pausing 3 s for a checkpoint: below the floor
    ends = [1e9 + 0.05 * i + (3.0 if i >= 30 else 0.0) for i in range(60)]
    assert figures.stall_breaks(ends) == []
    assert figures.stall_breaks([1e9 + 2 * i + (60 if i > 5 else 0) for i in range(12)]) == [6]


def test_a_rank_that_rejoined_after_the_layout_is_standby_not_dead():
    written = 1000.0
    hist = [
        {"at_s": 900.0, "layout_id": 0, "key": "a"},
        {"at_s": written, "layout_id": 1, "key": "b"},
        {"at_s": 1100.0, "layout_id": 1, "key": "b"},  # the trainer registered again
    ]
    assert figures_skew.layout_since_s(hist, 1) == written
    assert (
        figures_skew.layout_since_s(hist, 2) is None and figures_skew.layout_since_s([], 1) is None
    )
    health = {
        12: {"p": 1.0, "state": "healthy", "since": written + 40},  # re-joined since
        13: {"p": 1.0, "state": "healthy", "since": written - 40},  # stale: before the layout
        14: {"p": 0.0, "state": "dead", "since": written + 40},
        15: {"p": 1.0, "state": "healthy"},  # no time: cannot tell
    }
    dead = [12, 13, 14, 15, 11]  # 11: no verdict at all
    assert figures_skew.rejoined_ranks(dead, health, written) == {12}
    assert figures_skew.rejoined_ranks(dead, health, None) == set()
    assert figures_skew.rejoined_ranks(dead, {"12": health[12]}, written) == {12}
    p, state = figures_skew.device_arrays(16, health, dead, [], list(range(11)), written)
    assert state[12] == 2 and p[12] == 1.0
    assert all(state[r] == 1 and p[r] == 0.0 for r in (11, 13, 14, 15))
    p, state = figures_skew.device_arrays(16, health, dead, [], list(range(11)))
    assert state[12] == 1 and p[12] == 0.0  # no layout time: the layout's word stands


def test_a_plan_from_a_layout_that_cannot_run_draws_no_bar():
    before, after = _layout().to_dict(), _layout().to_dict()
    fig = figures.plan_layers_figure(before, after, (-1.0, 1.83))
    bars = next(t for t in fig.data if list(t.x) == ["before", "after"])
    assert list(bars.y) == [None, 1.83]
    assert [a.text for a in fig.layout.annotations if a.text == "cannot run"] == ["cannot run"]
    assert (
        figures.predicted_text(-1.0) == "cannot run" and figures.predicted_text(1.83) == "1.830 s"
    )
    fig = figures.plan_layers_figure(before, after, (2.5, 1.83))
    assert "cannot run" not in [a.text for a in fig.layout.annotations]


def test_culprits_over_time_has_whole_rank_ticks_and_a_readable_time_range():
    # One report: plotly zoomed to a millisecond around it (08:27:56.0175, .018, ...) and
    # ticked the rank axis at 3, 3.5, 4.
    t = 1_790_000_000.0175
    fig = figures.recurrence_figure([_failure("fr-1", "fail_slow_compute", [3], t)], 8)
    y, x = fig.layout.yaxis, fig.layout.xaxis
    assert y.dtick == 1 and y.tickformat == "d"
    lo, hi = y.range
    assert lo < 3 < hi and hi - lo <= 6  # the rank with a rank of room either side
    x0, x1 = (figures._ts(0).fromisoformat(str(v)) for v in x.range)
    assert (x1 - x0).total_seconds() >= 60 and x0 < figures._ts(t) < x1
    assert x.tickformat == "%H:%M:%S"
    # Many ranks over a long time: plotly's own range and tick spacing, still whole ranks.
    many = [
        _failure(f"fr-{i}", "fail_slow_compute", [i * 7], t + 3600 * i, it=i) for i in range(10)
    ]
    fig = figures.recurrence_figure(many, 8)
    assert fig.layout.yaxis.tickformat == "d" and fig.layout.yaxis.dtick is None
    assert fig.layout.xaxis.range is None

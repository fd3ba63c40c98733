"""DAG engine: critical path vs brute force, eq. 2 semantics, bubble formula, migrations, batching."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from resihp.pipeline import PipelineDAG, build_schedule
from resihp.pipeline import dag as dag_mod
from resihp.topology import Layout, Migration


def _uniform_costs(dag, f=1.0, b=1.0, w=1.0):
    c = np.full(dag.num_chunks, f)
    c[dag.chunk_kind == 1] = b if dag.split_w else b + w
    c[dag.chunk_kind == 2] = w
    return c


def _migrated_layout(kind="1f1b"):
    lay = Layout.uniform(2, 4, 3, 8, 5, schedule=kind)
    lay.microbatches = [5, 4, 6]
    lay.migrations = [Migration(1, 0, 2, 1), Migration(2, 1, 3, 0), Migration(3, 2, 5, 1)]
    lay.validate()
    return lay


def _explicit_longest_path(dag, cost, edge):
    """Longest path by enumerating every source->sink path through explicit edge lists."""
    succ = {c: [] for c in range(dag.num_chunks)}
    for c in range(dag.num_chunks):
        u = int(dag.pred_data[c])
        if u >= 0:
            e = int(dag.in_edge[c])
            succ[u].append((c, edge[e] if e >= 0 else 0.0))
        u = int(dag.pred_res[c])
        if u >= 0:
            succ[u].append((c, 0.0))
    sources = [c for c in range(dag.num_chunks) if dag.pred_data[c] < 0 and dag.pred_res[c] < 0]
    best = 0.0
    stack = [(s, cost[s]) for s in sources]
    while stack:  # exhaustive DFS: exponential, only for tiny DAGs
        u, t = stack.pop()
        best = max(best, t)
        for v, ec in succ[u]:
            stack.append((v, t + ec + cost[v]))
    return best


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zbh1"])
def test_critical_path_equals_brute_force_on_small_dags(kind):
    rng = np.random.default_rng(7)
    for p, dp, m in [(2, 1, 2), (3, 2, 3), (2, 2, 3), (3, 1, 4)]:
        lay = Layout.uniform(1, p, dp, p * 2, m, schedule=kind)
        if dp > 1:
            lay.migrations = [Migration(p - 1, 0, 0, 1)]
            lay.validate()
        dag = PipelineDAG.from_layout(lay)
        for _ in range(3):
            cost = rng.uniform(0.1, 2.0, dag.num_chunks)
            edge = rng.uniform(0.0, 0.5, dag.num_edges)
            res = dag.evaluate(cost, edge)
            brute = _explicit_longest_path(dag, cost, edge)
            assert res.pipeline_time_s == pytest.approx(brute, rel=1e-12)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zbh1"])
def test_single_replica_matches_dag_built_from_schedule_by_hand(kind):
    """Edges rebuilt here from the schedule's order (not the engine's arrays), then brute force."""
    rng = np.random.default_rng(11)
    p, m = 3, 4
    lay = Layout.uniform(1, p, 1, p, m, schedule=kind)
    dag = PipelineDAG.from_layout(lay)
    sched = build_schedule(kind, p, m)
    code = {"F": 0, "B": 1, "W": 2}
    cid = {
        (int(dag.chunk_mb[c]), int(dag.chunk_stage[c]), int(dag.chunk_kind[c])): c
        for c in range(dag.num_chunks)
    }
    cost = rng.uniform(0.2, 2.0, dag.num_chunks)
    p2p = rng.uniform(0.0, 0.5, (m, p, 2))  # per micro-batch, receiving stage, act/grad
    preds = {c: [] for c in range(dag.num_chunks)}
    for s, order in enumerate(sched.order):
        prev = None
        for k, j in order:
            c = cid[(j, s, code[k])]
            if prev is not None:
                preds[c].append((prev, 0.0))
            prev = c
            if k == "F" and s > 0:
                preds[c].append((cid[(j, s - 1, 0)], p2p[j, s, 0]))
            if k == "B":
                if s == p - 1:
                    preds[c].append((cid[(j, s, 0)], 0.0))
                else:
                    preds[c].append((cid[(j, s + 1, 1)], p2p[j, s, 1]))
            if k == "W":
                preds[c].append((cid[(j, s, 1)], 0.0))
    edge = np.array(
        [
            p2p[dag.chunk_mb[v], dag.chunk_stage[v], 0 if dag.chunk_kind[v] == 0 else 1]
            for v in dag.edge_dst
        ]
    )

    def paths(c):  # every path ending at c, as total length
        if not preds[c]:
            return [cost[c]]
        return [t + ec + cost[c] for u, ec in preds[c] for t in paths(u)]

    brute = max(max(paths(c)) for c in range(dag.num_chunks))
    assert dag.evaluate(cost, edge).pipeline_time_s == pytest.approx(brute, rel=1e-12)


@pytest.mark.parametrize("kind", ["1f1b", "zbh1"])
def test_eq2_start_is_max_over_predecessors(kind):
    lay = _migrated_layout(kind)
    dag = PipelineDAG.from_layout(lay)
    rng = np.random.default_rng(1)
    cost = rng.uniform(0.5, 1.5, dag.num_chunks)
    edge = rng.uniform(0.0, 0.3, dag.num_edges)
    r = dag.evaluate(cost, edge)
    for c in range(dag.num_chunks):
        ready = 0.0
        if dag.pred_data[c] >= 0:
            e = dag.in_edge[c]
            ready = r.end_s[dag.pred_data[c]] + (edge[e] if e >= 0 else 0.0)
        if dag.pred_res[c] >= 0:
            ready = max(ready, r.end_s[dag.pred_res[c]])
        assert r.start_s[c] == pytest.approx(ready)
    assert r.pipeline_time_s == pytest.approx(dag.brute_force_iteration(cost, edge))


def test_uniform_1f1b_bubble_fraction():
    for p, m in [(2, 4), (4, 8), (8, 8), (16, 64), (5, 3)]:
        lay = Layout.uniform(1, p, 2, p, m)
        dag = PipelineDAG.from_layout(lay)
        r = dag.evaluate(_uniform_costs(dag))
        expect = (p - 1) / (m + p - 1)
        assert np.allclose(r.bubble_ratio, expect), (p, m)
        assert r.iteration_time_s == pytest.approx((m + p - 1) * 3.0)
        assert np.allclose(r.makespan_s, r.iteration_time_s)


def test_zbh1_beats_1f1b_with_split_backward():
    for p, m in [(4, 8), (8, 16), (16, 64)]:
        lay = Layout.uniform(1, p, 1, p, m)
        one = PipelineDAG.from_layout(lay, "1f1b")
        zb = PipelineDAG.from_layout(lay, "zbh1")
        t1 = one.evaluate(_uniform_costs(one)).iteration_time_s
        tz = zb.evaluate(_uniform_costs(zb)).iteration_time_s
        assert tz < t1
        assert tz >= 3 * m  # never faster than the work of one stage


def test_chunk_arrays_cover_each_chunk_once_and_follow_migrations():
    lay = _migrated_layout("zbh1")
    dag = PipelineDAG.from_layout(lay)
    keys = list(zip(dag.chunk_src_dp, dag.chunk_mb, dag.chunk_stage, dag.chunk_kind, strict=True))
    assert len(keys) == len(set(keys)) == dag.num_chunks == 3 * 4 * sum(lay.microbatches)
    moved = {(m.src_dp, m.microbatch, m.stage): m.dst_dp for m in lay.migrations}
    for c in range(dag.num_chunks):
        key = (int(dag.chunk_src_dp[c]), int(dag.chunk_mb[c]), int(dag.chunk_stage[c]))
        assert dag.chunk_dp[c] == moved.get(key, key[0])
    # Cross-replica edges: each migration adds 2 activation + 2 gradient edges (fewer at pipeline ends).
    assert (
        dag.edge_cross.sum()
        == sum((m.stage > 0) + (m.stage < lay.pp - 1) for m in lay.migrations) * 2
    )
    # Every device's chunks run in one chain that holds exactly that device's chunks.
    for d, s in itertools.product(range(lay.dp), range(lay.pp)):
        run = dag.device_chunks(d, s)
        expect = np.flatnonzero((dag.chunk_dp == d) & (dag.chunk_stage == s))
        assert sorted(run.tolist()) == expect.tolist()


def test_cross_replica_edges_carry_transfer_time():
    lay = _migrated_layout()
    dag = PipelineDAG.from_layout(lay)
    cost = _uniform_costs(dag)
    base = dag.evaluate(cost, np.zeros(dag.num_edges)).iteration_time_s
    edge = np.where(dag.edge_cross, 5.0, 0.0)
    slower = dag.evaluate(cost, edge).iteration_time_s
    assert slower > base


def test_fail_stop_stage_fully_migrated():
    lay = Layout.uniform(1, 3, 2, 3, 4)
    lay.dead = lay.groups[1][1][:]
    lay.groups[1][1] = []
    lay.migrations = [Migration(1, 1, j, 0) for j in range(4)]
    lay.validate()
    dag = PipelineDAG.from_layout(lay)
    assert not ((dag.chunk_dp == 1) & (dag.chunk_stage == 1)).any()
    r = dag.evaluate(_uniform_costs(dag))
    assert np.isnan(r.bubble_ratio[1, 1])
    assert r.busy_s[0, 1] == pytest.approx(8 * 3.0)
    healthy = PipelineDAG.from_layout(Layout.uniform(1, 3, 2, 3, 4))
    assert r.iteration_time_s > healthy.evaluate(_uniform_costs(healthy)).iteration_time_s


def test_batch_matches_single_and_kernel_matches_numpy():
    lay = _migrated_layout("zbh1")
    lay2 = Layout.uniform(1, 4, 6, 4, 5, schedule="zbh1")
    for layout in (lay, lay2):
        dag = PipelineDAG.from_layout(layout)
        rng = np.random.default_rng(3)
        costs = rng.uniform(0.5, 1.5, (7, dag.num_chunks))
        edge = rng.uniform(0, 0.2, dag.num_edges)
        ar = rng.uniform(0, 1.0, layout.pp)
        batch = dag.evaluate_batch(costs, edge, ar)
        single = [dag.evaluate(c, edge, ar).iteration_time_s for c in costs]
        assert np.allclose(batch, single)
        prev = dag_mod.use_kernel()
        try:
            dag_mod.use_kernel(False)
            numpy_batch = dag.evaluate_batch(costs, edge, ar)
            numpy_single = dag.evaluate(costs[0], edge, ar)
        finally:
            dag_mod.use_kernel(prev)
        assert np.allclose(numpy_batch, batch)
        assert np.allclose(numpy_single.end_s, dag.evaluate(costs[0], edge, ar).end_s)


def test_identical_replicas_share_one_template_and_dedupe():
    lay = Layout.uniform(1, 4, 16, 4, 6)
    dag = PipelineDAG.from_layout(lay)
    assert len(dag.groups) == 1 and dag.groups[0].rows == 16
    cost = _uniform_costs(dag)
    cost[(dag.chunk_dp == 5) & (dag.chunk_stage == 2)] *= 2.0  # one slow device
    r = dag.evaluate(cost)
    assert np.argmax(r.makespan_s) == 5
    assert np.allclose(np.delete(r.makespan_s, 5), (6 + 3) * 3.0)
    assert r.iteration_time_s == pytest.approx(r.makespan_s[5])


def test_allreduce_after_last_replica():
    lay = Layout.uniform(1, 2, 2, 2, 2)
    dag = PipelineDAG.from_layout(lay)
    cost = _uniform_costs(dag)
    r0 = dag.evaluate(cost)
    r1 = dag.evaluate(cost, allreduce_s=np.array([0.5, 10.0]))
    # Stage 1 finishes its last B before stage 0 does; its long all-reduce still dominates.
    assert r1.iteration_time_s == pytest.approx(r1.end_s[dag.dev_last[:, 1]].max() + 10.0)
    assert r1.iteration_time_s > r0.iteration_time_s


def test_bad_shapes_rejected():
    dag = PipelineDAG.from_layout(Layout.uniform(1, 2, 1, 2, 2))
    with pytest.raises(ValueError, match="chunk_cost_s"):
        dag.evaluate(np.ones(3))
    with pytest.raises(ValueError, match="edge_cost_s"):
        dag.evaluate(np.ones(dag.num_chunks), np.ones(dag.num_edges + 1))
    with pytest.raises(ValueError, match="interleaved"):
        PipelineDAG.from_layout(Layout.uniform(1, 2, 1, 2, 2), "interleaved")


def test_migrations_that_deadlock_naive_per_device_orders():
    # Per-device ZB-H1 orders rebuilt for each device's own micro-batch count wait on
    # each other in a cycle here; the shared logical clock orders them safely.
    lay = Layout.uniform(1, 3, 3, 3, 3, schedule="zbh1")
    lay.migrations = [Migration(0, 0, 2, 1), Migration(0, 0, 1, 2), Migration(1, 0, 1, 2)]
    lay.validate()
    dag = PipelineDAG.from_layout(lay)
    assert not dag.schedule_fallback
    rng = np.random.default_rng(5)
    cost = rng.uniform(0.5, 1.5, dag.num_chunks)
    edge = rng.uniform(0, 0.2, dag.num_edges)
    assert dag.evaluate(cost, edge).pipeline_time_s == pytest.approx(
        _explicit_longest_path(dag, cost, edge)
    )
    for d, s in itertools.product(range(lay.dp), range(lay.pp)):
        run = dag.device_chunks(d, s)
        assert (
            sorted(run.tolist())
            == np.flatnonzero((dag.chunk_dp == d) & (dag.chunk_stage == s)).tolist()
        )
        pos = {
            (int(dag.chunk_src_dp[c]), int(dag.chunk_mb[c]), int(dag.chunk_kind[c])): i
            for i, c in enumerate(run)
        }
        for (o, j, k), i in pos.items():
            if k > 0:
                assert pos[(o, j, k - 1)] < i  # F before B before W on the device
    # A migrated chunk runs right after the local chunk of the same micro-batch index.
    run = dag.device_chunks(1, 0).tolist()
    moved = next(
        c
        for c in run
        if dag.chunk_src_dp[c] == 0 and dag.chunk_mb[c] == 2 and dag.chunk_kind[c] == 0
    )
    before = run[run.index(moved) - 1]
    assert (dag.chunk_src_dp[before], dag.chunk_mb[before], dag.chunk_kind[before]) == (1, 2, 0)
    # Still better than no zero-bubble split at all.
    g = PipelineDAG.from_layout(lay, "1f1b")
    unit = _uniform_costs(dag)
    assert dag.evaluate(unit).pipeline_time_s <= g.evaluate(_uniform_costs(g)).pipeline_time_s


def test_random_layouts_with_migrations_and_empty_replicas():
    rng = np.random.default_rng(21)
    for _ in range(80):
        p, dp, m = int(rng.integers(2, 5)), int(rng.integers(2, 4)), int(rng.integers(1, 6))
        kind = ["gpipe", "1f1b", "zbh1"][int(rng.integers(3))]
        lay = Layout.uniform(1, p, dp, p, m, schedule=kind)
        lay.microbatches = [int(x) for x in rng.integers(0, m + 1, dp)]
        migs = {}
        for _ in range(int(rng.integers(0, 7))):
            s, d, e = int(rng.integers(p)), int(rng.integers(dp)), int(rng.integers(dp))
            if lay.microbatches[d] and e != d:
                migs[(s, d, int(rng.integers(lay.microbatches[d])))] = e
        lay.migrations = [Migration(s, d, j, e) for (s, d, j), e in migs.items()]
        lay.validate()
        dag = PipelineDAG.from_layout(lay)
        kinds = 3 if kind == "zbh1" else 2
        assert dag.num_chunks == sum(lay.microbatches) * p * kinds
        cost = rng.uniform(0.1, 1.0, dag.num_chunks)
        edge = rng.uniform(0.0, 0.1, dag.num_edges)
        res = dag.evaluate(cost, edge)
        assert res.pipeline_time_s == pytest.approx(dag.brute_force_iteration(cost, edge))
        if dag.num_chunks:
            both = dag.evaluate_batch(np.stack([cost, 2 * cost]), edge)
            assert both[0] == pytest.approx(res.iteration_time_s)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_replicas_with_fewer_microbatches_run_their_own_schedule(kind):
    lay = Layout.uniform(1, 4, 3, 4, 8, schedule=kind)
    lay.microbatches = [8, 5, 3]
    lay.migrations = [Migration(2, 0, 7, 2)]  # couples replicas 0 and 2 into one component
    lay.validate()
    dag = PipelineDAG.from_layout(lay)
    for d, m in enumerate(lay.microbatches):
        sched = build_schedule(kind, 4, m)
        for s in range(4):
            run = [
                ("FB"[dag.chunk_kind[c]], int(dag.chunk_mb[c]))
                for c in dag.device_chunks(d, s)
                if dag.chunk_src_dp[c] == d
            ]
            expect = [c for c in sched.order[s] if not (d == 0 and s == 2 and c[1] == 7)]
            assert run == expect, (d, s)


def _slow_source_costs(dag, slow_dp=0, slow_stage=1, factor=1 / 0.6):
    cost = _uniform_costs(dag, 1.0, 1.0, 1.0)
    cost[(dag.chunk_dp == slow_dp) & (dag.chunk_stage == slow_stage)] *= factor
    return cost


@pytest.mark.parametrize("kind", ["1f1b", "zbh1"])
def test_several_migrations_into_one_stage_do_not_stall_it(kind):
    p, m = 4, 8
    base = Layout.uniform(1, p, 2, 4 * p, m, schedule=kind)
    plain = PipelineDAG.from_layout(base)
    t_none = plain.evaluate(_slow_source_costs(plain)).iteration_time_s
    for k in (2, 3):
        lay = Layout.uniform(1, p, 2, 4 * p, m, schedule=kind)
        lay.migrations = [Migration(1, 0, m - 1 - i, 1) for i in range(k)]
        lay.validate()
        logical = PipelineDAG.from_layout(lay)
        t_logical = logical.evaluate(_slow_source_costs(logical)).iteration_time_s
        dag = logical.retimed(_slow_source_costs(logical))
        cost = _slow_source_costs(dag)
        res = dag.evaluate(cost)
        assert res.iteration_time_s == pytest.approx(dag.brute_force_iteration(cost))
        # the slow source sheds work: the iteration gets shorter than doing nothing
        assert res.iteration_time_s < t_none - 1.0, (k, res.iteration_time_s, t_none)
        assert res.iteration_time_s <= t_logical + 1e-9
        # the destination never idles waiting for a migrated chunk while one of its
        # own chunks that runs later had already arrived (the stall of pinned orders)
        ready = np.zeros(dag.num_chunks)
        has = dag.pred_data >= 0
        ready[has] = res.end_s[dag.pred_data[has]]
        run = dag.device_chunks(1, 1)
        for i in range(1, len(run)):
            prev, c = run[i - 1], run[i]
            if dag.chunk_src_dp[c] != 1 and res.start_s[c] > res.end_s[prev] + 1e-9:
                later_local = [x for x in run[i + 1 :] if dag.chunk_src_dp[x] == 1]
                assert all(ready[x] > res.end_s[prev] + 1e-9 for x in later_local), (k, i)
    # three migrations now gain more than pinning them next to their local twins
    assert res.iteration_time_s < t_logical - 1e-9


@pytest.mark.parametrize("list_limit", [10**9, 0], ids=["list-scheduled", "arrival-pass"])
def test_retimed_orders_are_valid_and_textbook_without_migrations(monkeypatch, list_limit):
    monkeypatch.setattr(dag_mod, "LIST_SCHEDULE_MAX_CHUNKS", list_limit)
    rng = np.random.default_rng(5)
    plain = PipelineDAG.from_layout(Layout.uniform(1, 4, 3, 8, 6, schedule="zbh1"))
    assert plain.retimed(rng.uniform(0.5, 1.5, plain.num_chunks)) is plain
    for _ in range(60):
        p, dp, m = int(rng.integers(2, 5)), int(rng.integers(2, 4)), int(rng.integers(1, 7))
        kind = ["gpipe", "1f1b", "zbh1"][int(rng.integers(3))]
        lay = Layout.uniform(1, p, dp, p, m, schedule=kind)
        migs = {}
        for _ in range(int(rng.integers(1, 8))):
            s, d, e = int(rng.integers(p)), int(rng.integers(dp)), int(rng.integers(dp))
            if e != d:
                migs[(s, d, int(rng.integers(m)))] = e
        lay.migrations = [Migration(s, d, j, e) for (s, d, j), e in migs.items()]
        lay.validate()
        logical = PipelineDAG.from_layout(lay)
        speed = rng.uniform(0.3, 1.0, (dp, p))
        cost0 = (
            rng.uniform(0.5, 1.5, logical.num_chunks) / speed[logical.chunk_dp, logical.chunk_stage]
        )
        edge0 = rng.uniform(0.0, 0.2, logical.num_edges)
        dag = logical.retimed(cost0, edge0)
        assert dag.num_chunks == logical.num_chunks
        # never longer than the twin order under the costs it was timed for
        same = np.lexsort((dag.chunk_kind, dag.chunk_stage, dag.chunk_mb, dag.chunk_src_dp))
        old = np.lexsort(
            (logical.chunk_kind, logical.chunk_stage, logical.chunk_mb, logical.chunk_src_dp)
        )
        c_new = np.empty(dag.num_chunks)
        c_new[same] = cost0[old]
        e_new = np.zeros(dag.num_chunks)
        e_new[logical.edge_dst] = edge0
        e_map = np.empty(dag.num_chunks)
        e_map[same] = e_new[old]
        t_new = dag.evaluate(c_new, e_map[dag.edge_dst]).pipeline_time_s
        assert t_new <= logical.evaluate(cost0, edge0).pipeline_time_s + 1e-9
        cost = rng.uniform(0.1, 1.0, dag.num_chunks)
        edge = rng.uniform(0.0, 0.1, dag.num_edges)
        res = dag.evaluate(cost, edge)
        assert res.pipeline_time_s == pytest.approx(dag.brute_force_iteration(cost, edge))
        sched = build_schedule(kind, p, m)
        for d in range(dp):
            for s in range(p):
                ch = dag.device_chunks(d, s)
                seen = {
                    (int(dag.chunk_src_dp[c]), int(dag.chunk_mb[c]), int(dag.chunk_kind[c]))
                    for c in ch
                }
                assert len(seen) == len(ch)
                run = [
                    ("FBW"[dag.chunk_kind[c]], int(dag.chunk_mb[c]))
                    for c in ch
                    if dag.chunk_src_dp[c] == d
                ]
                # local chunks keep the schedule's order (restricted to those not moved out)
                gone = {(j) for (s2, d2, j) in migs if s2 == s and d2 == d}
                assert run == [c for c in sched.order[s] if c[1] not in gone], (d, s)

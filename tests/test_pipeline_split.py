"""Split backward for migrated chunks (engine kind ``1f1bsplit``, §6.3)."""

from __future__ import annotations

import pytest

from resihp.pipeline.schedule import build_schedule
from resihp.topology import Layout, Migration
from scheduler.predict import Predictor


def test_split_schedule_times_like_fused_1f1b():
    for p, m in ((2, 4), (4, 8), (8, 8)):
        split = build_schedule("1f1bsplit", p, m)
        assert split.split_w
        assert split.makespan_units(1, 1, 1) == build_schedule("1f1b", p, m).makespan_units(1, 1, 1)


@pytest.fixture(scope="module")
def pred():
    return Predictor("llama2-7b")


def _evicted() -> Layout:
    lay = Layout.uniform(2, 4, 2, 32, 8)
    lay.groups[1][2] = []
    lay.migrations = [Migration(2, 1, j, 0) for j in range(8)]
    return lay


def test_fault_free_layout_is_unchanged_by_the_split(pred):
    lay = Layout.uniform(2, 4, 2, 32, 8)
    assert pred.iteration_s(lay, {}, schedule="1f1bsplit") == pytest.approx(
        pred.iteration_s(lay, {}), rel=1e-12
    )


def test_migrated_chunks_defer_w_and_send_gradients_after_b(pred):
    lay = _evicted()
    fused = pred.iteration_s(lay, {})
    split = pred.iteration_s(lay, {}, schedule="1f1bsplit")
    assert split < fused
    dag, cost, edges = pred._timed(lay, {}, "1f1bsplit")
    res = dag.evaluate(cost, edges)
    # on the destination, every migrated W starts after the last local B it could follow
    dev = (dag.chunk_dp == 0) & (dag.chunk_stage == 2)
    moved_w = dev & (dag.chunk_src_dp == 1) & (dag.chunk_kind == 2)
    local_f = dev & (dag.chunk_src_dp == 0) & (dag.chunk_kind == 0)
    assert moved_w.sum() == 8
    assert res.start_s[moved_w].max() > res.start_s[local_f].max()


def test_affine_batch_evaluation_matches_one_by_one(pred):
    """The layer what-ifs (dedup of identical replicas) give each partition's own time."""
    lay = Layout.uniform(2, 4, 3, 16, 4)
    p = {lay.groups[1][2][0]: 0.5}
    cands = [[4, 4, 4, 4], [5, 3, 4, 4], [4, 4, 3, 5], [3, 5, 5, 3]]
    got = pred.layer_evaluator(lay, p)(cands)
    for c, t in zip(cands, got, strict=True):
        one = lay.copy()
        one.layers = c
        assert t == pytest.approx(pred.iteration_s(one, p), rel=1e-12)


def test_work_exchanges_are_named():
    """Two replicas trading chunks of one stage, or a micro-batch run whole on another
    replica, move no work: under split backward they would only defer W."""
    lay = Layout.uniform(2, 2, 2, 8, 4)
    lay.migrations = [Migration(0, 0, 3, 1), Migration(0, 1, 2, 0), Migration(1, 0, 1, 1)]
    assert {tuple(m.to_list()) for m in lay.exchange_migrations()} == {(0, 0, 3, 1), (0, 1, 2, 0)}
    lay.migrations = [Migration(0, 0, 3, 1), Migration(1, 0, 3, 1)]  # mb 3 runs whole on 1
    assert len(lay.exchange_migrations()) == 2
    lay.migrations = [Migration(0, 0, 3, 1), Migration(1, 0, 2, 1)]  # one-way, partial
    assert lay.exchange_migrations() == []


def test_split_plans_are_chosen_under_the_split_and_stay_physical():
    """The simulated ResiHP plans under the schedule it runs with; a plan after a device
    loss never beats the fault-free layout (exchanges did: 8.40 vs 8.05 samples/s)."""
    from scheduler.planner import PlanOptions, plan, timed_s
    from scheduler.policies import get_policy

    pred = Predictor("llama2-13b")
    lay = Layout.uniform(4, 4, 2, 40, 8)
    pol = get_policy("resihp")
    assert pol.options.migrated_schedule == "1f1bsplit"
    p = {5: 0.0}
    res = plan(lay.copy(), p, pred, PlanOptions(migrated_schedule="1f1bsplit"))
    after = res.after
    assert after.migrations and not after.exchange_migrations()
    assert res.predicted_after_s == pytest.approx(timed_s(pred, after, p, "1f1bsplit"), rel=1e-12)
    assert res.predicted_after_s == pytest.approx(pol.iteration_s([after], p, pred), rel=1e-12)
    assert res.predicted_after_s > pred.iteration_s(lay, {})


def test_runs_dead_looks_only_at_the_listed_ranks():
    lay = Layout.uniform(2, 2, 2, 8, 4)
    assert not lay.runs_dead({}) and not lay.runs_dead({3: 0.5})
    assert lay.runs_dead({3: 0.0})
    lay.groups[0][0] = [lay.groups[0][0][0]]  # rank 1 left its group: its death stops nothing
    assert not lay.runs_dead({1: 0.0})

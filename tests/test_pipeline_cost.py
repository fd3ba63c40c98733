"""Cost model: calibration presets, eq. 1, and layouts that must get slower or faster."""

from __future__ import annotations

import numpy as np
import pytest

from resihp.pipeline import CostModel, PipelineDAG
from resihp.pipeline.models import MODEL_PRESETS, cost_model_for, table3_layout
from resihp.topology import Layout, Migration

CALIBRATION_MS = {  # calibration.md per-layer forward times at 4K/8K/16K/32K
    "llama2-7b": (12, 25, 57, 141),
    "llama2-13b": (18, 38, 84, 204),
    "llama2-70b": (47, 97, 208, 472),
}


def test_presets_reproduce_calibration_table():
    for name, table in CALIBRATION_MS.items():
        pre = MODEL_PRESETS[name]
        for seq, ms in zip((4096, 8192, 16384, 32768), table, strict=True):
            assert pre.forward_layer_s(seq) * 1e3 == pytest.approx(ms, rel=0.06), (name, seq)
    assert len(MODEL_PRESETS) == 8
    with pytest.raises(ValueError, match="unknown model"):
        cost_model_for("gpt-5", 4096)
    with pytest.raises(ValueError, match="layers"):
        cost_model_for("llama2-7b", 4096, Layout.uniform(1, 2, 1, 40, 2))


def test_eq1_linear_plus_quadratic_per_chunk():
    lay = Layout.uniform(2, 2, 1, 4, 3, schedule="zbh1")
    cm = CostModel(alpha_layer_s_per_token=1e-6, beta_layer_s_per_token2=1e-9, hidden=1024)
    dag = PipelineDAG.from_layout(lay)
    n = [[4096, 4096, 4096]]
    sq = [[4096**2, 2 * 2048**2, 4 * 1024**2]]  # one, two and four packed documents
    compute, comm = cm.chunk_cost_parts(dag, lay, cm.stage_coefficients(lay), n, sq)
    f = (dag.chunk_kind == 0) & (dag.chunk_stage == 0)
    expect = [2 * (1e-6 * 4096 + 1e-9 * s) / 2 for s in sq[0]]  # 2 layers, TP 2
    got = compute[f][np.argsort(dag.chunk_mb[f])]
    assert np.allclose(got, expect)
    assert (comm[dag.chunk_kind == 2] == 0).all() and (comm[dag.chunk_kind == 0] > 0).all()
    w = (dag.chunk_kind == 2) & (dag.chunk_stage == 0)
    assert np.allclose(np.sort(compute[w]), np.sort(got))  # W ~ F by default


def _predict(lay, cm, speed=None, link=None, seq=4096):
    return cm.predict_iteration_s(lay, seq, seq**2 / 3, speed, link)


def test_uneven_layers_and_repartition_direction():
    cm = cost_model_for("llama2-13b", 4096, head_alpha_s_per_token=0.0)
    even = Layout.uniform(4, 4, 1, 40, 8)
    skew = even.copy()
    skew.layers = [7, 16, 9, 8]
    assert _predict(skew, cm) > _predict(even, cm) * 1.2
    # Fig. 5: a slow stage 1; moving layers off it (and onto healthy stages) helps.
    slow = {r: 0.5 for r in even.groups[0][1]}
    before = _predict(even, cm, slow)
    fixed = even.copy()
    fixed.layers = [12, 6, 11, 11]
    assert _predict(fixed, cm, slow) < before
    assert before > _predict(even, cm) * 1.4


def test_heterogeneous_tp_and_slow_device_direction():
    cm = cost_model_for("llama2-7b", 8192)
    lay = Layout.uniform(4, 2, 2, 32, 8)
    base = _predict(lay, cm)
    shrunk = lay.copy()
    shrunk.dead = [shrunk.groups[1][0][3]]
    shrunk.standby = [shrunk.groups[1][0][2]]
    shrunk.groups[1][0] = shrunk.groups[1][0][:2]
    shrunk.validate()
    t_shrunk = _predict(shrunk, cm)
    assert t_shrunk > base * 1.3
    slow_one = _predict(lay, cm, {lay.groups[1][0][0]: 0.5})
    assert slow_one > base * 1.3  # a TP group runs at its slowest member's speed
    # Selective exclusion (eq. 4): TP2 at full speed beats TP4 bottlenecked at 0.3.
    assert t_shrunk < _predict(lay, cm, {lay.groups[1][0][0]: 0.3})


def test_p2p_rule_and_link_slowdown():
    cm = cost_model_for("llama2-7b", 4096)
    lay = Layout.uniform(4, 2, 2, 32, 4)
    same = cm.p2p_time_s(lay, (0, 0), (0, 1))
    het = lay.copy()
    het.groups[0][1] = het.groups[0][1][:2]
    het.standby = lay.groups[0][1][2:]
    het.validate()
    assert cm.p2p_time_s(het, (0, 0), (0, 1)) > same  # fewer NICs on the smaller group
    slow = cm.p2p_time_s(lay, (0, 0), (0, 1), {lay.groups[0][1][0]: 0.1})
    assert slow > 5 * same
    intra = Layout.uniform(2, 2, 1, 32, 4)  # both stages on node 0: NVLink only
    assert cm.p2p_time_s(intra, (0, 0), (0, 1)) < cm.p2p_time_s(lay, (0, 0), (0, 1))
    link = {lay.groups[0][1][0]: 0.05}
    assert _predict(lay, cm, None, link) > _predict(lay, cm)


def test_allreduce_scales_with_replicas():
    cm = cost_model_for("llama2-70b", 4096)
    one = cm.allreduce_costs(Layout.uniform(4, 16, 1, 80, 4))
    four = cm.allreduce_costs(Layout.uniform(4, 16, 4, 80, 4))
    assert (one == 0).all() and (four > 0).all()
    assert four[0] > four[1]  # embedding/head gradients on the first and last stages


def test_migration_relieves_a_slow_replica():
    cm = cost_model_for("qwen2.5-7b", 8192)
    lay = table3_layout("qwen2.5-7b", 8)
    slow = {r: 0.4 for r in lay.groups[1][1]}
    before = _predict(lay, cm, slow)
    moved = lay.copy()
    moved.migrations = [Migration(1, 1, j, 0) for j in (5, 6, 7)]
    moved.validate()
    after = _predict(moved, cm, slow)
    assert after < before
    res = cm.evaluate(moved, 8192, 8192**2 / 3, slow)
    dag = cm.dag_for(moved)
    edges = cm.edge_costs(dag, moved)
    assert (edges[dag.edge_cross] > 0).all()
    assert res.makespan_s[1] < cm.evaluate(lay, 8192, 8192**2 / 3, slow).makespan_s[1]


def test_bad_inputs():
    cm = cost_model_for("llama2-7b", 4096)
    lay = Layout.uniform(4, 2, 2, 32, 4)
    dag = cm.dag_for(lay)
    with pytest.raises(ValueError, match="token_budget"):
        cm.chunk_costs(dag, lay, [[4096] * 4], 1.0)
    with pytest.raises(ValueError, match="ratio_b"):
        CostModel(alpha_layer_s_per_token=1.0, beta_layer_s_per_token2=0.0, ratio_b=-1)
    with pytest.raises(ValueError, match="device speed"):
        cm.predict_iteration_s(lay, 4096, 1e6, {0: 0.0})


def test_vectorized_edge_costs_follow_the_p2p_rule():
    lay = Layout.uniform(4, 4, 3, 32, 5)
    lay.groups[1][2] = lay.groups[1][2][:2]
    lay.migrations = [Migration(2, 1, 3, 0), Migration(1, 2, 4, 1)]
    lay.standby = [r for r in range(lay.world_size) if r not in lay.coords()]
    lay.validate()
    cm = cost_model_for("llama2-7b", 4096, lay)
    dag = cm.dag_for(lay)
    link = {5: 0.3, 40: 0.5}
    got = cm.edge_costs(dag, lay, link)
    ref = [
        cm.p2p_time_s(
            lay,
            (int(dag.chunk_dp[a]), int(dag.chunk_stage[a])),
            (int(dag.chunk_dp[b]), int(dag.chunk_stage[b])),
            link,
        )
        for a, b in zip(dag.edge_src, dag.edge_dst, strict=True)
    ]
    assert np.allclose(got, ref)
    assert len(set(np.round(got, 12))) >= 4  # heterogeneous TP, slow links, cross-replica edges

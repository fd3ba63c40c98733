"""TP selective exclusion (eq. 3-4), standby reuse, §7 P2P mapping, optimal PP partition."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resihp.topology import Layout
from scheduler.memory import MemoryModel
from scheduler.pp import PartitionError, makespan_estimate, min_bottleneck, optimal_partition
from scheduler.tp import adapt_tp, feasible_degrees, p2p_mapping, p2p_moves, select_subgroup


def test_feasible_degrees_are_powers_of_two_in_range():
    assert feasible_degrees(1, 7) == [1, 2, 4]
    assert feasible_degrees(2, 8) == [2, 4, 8]
    assert feasible_degrees(4, 3) == []
    with pytest.raises(ValueError):
        feasible_degrees(3, 8)


def test_eq4_keeps_degree_when_slowdown_is_weak_and_drops_severe_straggler():
    grp = [0, 1, 2, 3]
    weak = select_subgroup(grp, {2: 0.65})
    assert weak.k == 4 and weak.score == pytest.approx(2.6)
    severe = select_subgroup(grp, {2: 0.3})
    assert severe.k == 2 and 2 not in severe.ranks and severe.score == pytest.approx(2.0)


def test_fail_stop_three_survivors_gives_degree_two_with_fastest():
    ch = select_subgroup([0, 1, 2, 3], {1: 0.0, 3: 0.8})
    assert ch.k == 2 and set(ch.ranks) == {0, 2}


def test_k_min_above_survivors_is_infeasible():
    assert select_subgroup([0, 1, 2, 3], {0: 0, 1: 0, 2: 0}, k_min=2) is None


def test_must_include_is_respected():
    ch = select_subgroup([0, 1, 2, 3], {2: 0.3}, must_include=[2])
    assert 2 in ch.ranks and ch.k == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8), st.sampled_from([1, 2, 4]))
def test_eq4_is_the_argmax_over_all_power_of_two_subsets(ps, k_min):
    p = dict(enumerate(ps))
    ch = select_subgroup(range(len(ps)), p, k_min)
    best = 0.0
    for k in feasible_degrees(k_min, len(ps)):
        for sub in itertools.combinations(range(len(ps)), k):
            if all(p[r] > 0 for r in sub):
                best = max(best, k * min(p[r] for r in sub))
    if ch is None:
        assert best == 0.0
    else:
        assert all(p[r] > 0 for r in ch.ranks)
        assert ch.score == pytest.approx(best)


def test_adapt_tp_parks_standby_and_reuses_it_on_next_intra_node_failure():
    lay = Layout.uniform(tp=4, pp=2, dp=2, num_layers=32, num_microbatches=8)
    # node 0 holds ranks 0-7: stage 0 of replica 0 (0-3) and replica 1 (4-7)
    r1 = adapt_tp(lay, {1: 0.0})
    assert len(r1.layout.groups[0][0]) == 2 and 1 not in r1.layout.groups[0][0]
    assert len(r1.layout.standby) == 1 and r1.layout.node_of(r1.layout.standby[0]) == 0
    assert 1 in r1.layout.dead
    parked = r1.layout.standby[0]
    r2 = adapt_tp(r1.layout, {1: 0.0, 5: 0.0})
    g = r2.layout.groups[1][0]
    assert len(g) == 4 and parked in g and 5 not in g
    assert r2.layout.standby == []
    assert any(m["what"] == "standby" and m["action"] == "reuse" for m in r2.moves)


def test_adapt_tp_non_selective_drops_whole_group():
    lay = Layout.uniform(tp=4, pp=2, dp=2, num_layers=32, num_microbatches=8)
    r = adapt_tp(lay, {1: 0.0}, selective=False)
    assert r.layout.groups[0][0] == [] and (0, 0) in r.emptied


def test_adapt_tp_respects_memory_k_min():
    lay = Layout.uniform(tp=4, pp=2, dp=2, num_layers=32, num_microbatches=8)
    # 16 layers of 3.2 GB state need >= 2 devices of 40 GB
    mem = MemoryModel(
        device_mem_bytes=40e9, layer_state_bytes=3.2e9, act_bytes_per_mb_layer=1e6, reserve_bytes=0
    )
    r = adapt_tp(lay, {0: 0, 1: 0, 2: 0}, memory=mem)
    assert r.layout.groups[0][0] == [] and 3 in r.layout.standby


def test_p2p_mapping_scatter_allgather():
    m = p2p_mapping([0, 1], [8, 9, 10, 11])
    assert m["chunks"] == 4
    assert m["pairs"] == [[0, 8], [0, 9], [1, 10], [1, 11]]
    m2 = p2p_mapping([8, 9, 10, 11], [0, 1])
    assert m2["pairs"] == [[8, 0], [9, 0], [10, 1], [11, 1]]
    # each destination chunk crosses the link once
    assert len({tuple(p) for p in m["pairs"]}) == 4


def test_p2p_moves_only_for_heterogeneous_neighbours():
    lay = Layout.uniform(tp=4, pp=2, dp=2, num_layers=32, num_microbatches=8)
    assert p2p_moves(lay) == []
    r = adapt_tp(lay, {1: 0.0})
    mv = p2p_moves(r.layout)
    assert len(mv) == 1 and mv[0]["dp"] == 0 and mv[0]["chunks"] == 4


def test_paper_partition_444_to_525():
    assert optimal_partition(12, [1.0, 2.0, 1.0], 8) == [5, 2, 5]
    assert min_bottleneck(12, [1.0, 2.0, 1.0]) == [5, 2, 5]


def test_partition_respects_caps_and_raises_when_impossible():
    n = optimal_partition(12, [1.0, 2.0, 1.0], 8, cap=[4, 12, 12])
    assert n[0] <= 4 and sum(n) == 12
    with pytest.raises(PartitionError):
        optimal_partition(12, [1, 1, 1], 4, cap=[3, 3, 3])


def _brute(L, w, m, cap, e):
    best = None
    for n in itertools.product(*[range(1, min(c, L) + 1) for c in cap]):
        if sum(n) != L:
            continue
        v = makespan_estimate(n, w, m, e)
        if best is None or v < best - 1e-12:
            best = v
    return best


@settings(max_examples=120, deadline=None)
@given(
    st.integers(3, 14),
    st.lists(st.floats(0.2, 5.0), min_size=1, max_size=4),
    st.integers(1, 12),
    st.data(),
)
def test_partition_is_optimal_against_brute_force(L, w, m, data):
    P = len(w)
    if L < P:
        return
    cap = data.draw(st.lists(st.integers(1, L), min_size=P, max_size=P))
    e = data.draw(st.lists(st.floats(0.0, 2.0), min_size=P, max_size=P))
    brute = _brute(L, w, m, cap, e)
    if brute is None:
        with pytest.raises(PartitionError):
            optimal_partition(L, w, m, cap, e)
        return
    n = optimal_partition(L, w, m, cap, e)
    assert sum(n) == L and all(1 <= x <= c for x, c in zip(n, cap, strict=True))
    assert makespan_estimate(n, w, m, e) == pytest.approx(brute, rel=1e-9)

"""The engine bound's layout search (scheduler.bound): valid layouts that only use live devices."""

from __future__ import annotations

from resihp.topology import Layout
from scheduler.bound import best_relayout, tp_groups
from scheduler.predict import Predictor


def test_the_search_holds_the_starting_layout_and_uses_only_live_devices():
    pred = Predictor("llama2-7b", 4096)
    home = Layout.uniform(4, 2, 2, 32, 8)
    healthy, lay = best_relayout(home, {}, pred)
    # the Table 3 shape itself (DP2 x PP2 x TP4, Megatron order) is one of the candidates
    assert healthy >= pred.samples_per_s(home, {}) * (1 - 1e-9)
    assert lay.total_microbatches == home.total_microbatches
    p = {3: 0.0, 9: 0.0, 12: 0.4}
    got, lay = best_relayout(home, p, pred)
    lay.validate()
    used = set(lay.coords())
    assert not used & {3, 9} and lay.total_microbatches == 16
    assert 0 < got < healthy
    assert abs(got - pred.samples_per_s(lay, p)) < 1e-9 * got


def test_tp_groups_stay_inside_a_node_and_leave_the_slow_device_over():
    home = Layout.uniform(4, 2, 2, 32, 8)
    groups = tp_groups(home, {1: 0.0, 2: 0.5}, 2)
    assert all(len({r // 8 for r in g}) == 1 and len(g) == 2 for _, g in groups)
    # node 0 has 7 live devices, fastest first: 3 pairs, and the degraded one left over
    assert len(groups) == 7 and all(1 not in g and 2 not in g for _, g in groups)
    assert all(v == 1.0 for v, _ in groups)
    slow = tp_groups(home, {1: 0.0, 2: 0.5, 3: 0.0}, 2)  # 6 live: the slow one must pair
    assert [v for v, g in slow if 2 in g] == [0.5] and slow[-1][0] == 0.5

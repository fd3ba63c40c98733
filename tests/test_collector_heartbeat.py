"""Two-level heartbeat decisions (resihp.liveness), driven by explicit arrival times."""

from __future__ import annotations

import pytest

from resihp.liveness import LivenessCoordinator

IV = 1.0  # heartbeat interval (s)


def _run(coord, beats, t_end, step=0.25, t_start=0.0):
    """Feed beats {rank: (node, [arrival times])} and check every `step`; return events."""
    arrivals = sorted((t, r, n) for r, (n, ts) in beats.items() for t in ts)
    events = []
    t = t_start
    i = 0
    while t <= t_end + 1e-9:
        while i < len(arrivals) and arrivals[i][0] <= t:
            at, r, n = arrivals[i]
            coord.observe(r, n, at, seq=i)
            i += 1
        for ev in coord.check(t):
            events.append((t, ev))
        t += step
    return events


def _beats(start, stop, phase=0.0):
    out, t = [], start + phase
    while t <= stop:
        out.append(t)
        t += IV
    return out


def _two_nodes(coord):
    coord.set_expected({r: r // 4 for r in range(8)}, set(), 0.0)


def test_rank_dead_after_k_missed_beats_within_three_intervals():
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 20, phase=0.1 * r)) for r in range(8)}
    beats[2] = (0, _beats(0, 5.2, phase=0.2))  # last beat at 5.2, dies right after
    events = _run(coord, beats, 20)
    assert len(events) == 1
    t, ev = events[0]
    assert (ev.scope, ev.state, ev.ranks, ev.node) == ("rank", "dead", [2], 0)
    assert ev.last_seen_s == pytest.approx(5.2)
    # K=2 beats missed (expected at 6.2 and 7.2) plus half a beat of slack, no later
    # than three intervals after the failure.
    assert 5.2 + 2 * IV < t <= 5.2 + 3 * IV
    assert ev.missed_beats >= 2
    assert coord.dead_ranks() == [2]


def test_larger_k_waits_longer():
    coord = LivenessCoordinator(IV, k=4)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 20)) for r in range(8)}
    beats[6] = (1, _beats(0, 5))
    events = _run(coord, beats, 20)
    assert [(e.ranks, e.state) for _, e in events] == [([6], "dead")]
    assert 5 + 4 * IV < events[0][0] <= 5 + 5 * IV


def test_late_beat_within_jitter_is_not_a_miss():
    coord = LivenessCoordinator(IV, k=1)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 10)) for r in range(8)}
    # rank 1's beats arrive 0.4 interval late, then on time again
    beats[1] = (0, [0, 1, 2, 3.4, 4, 5, 6.4, 7, 8, 9, 10])
    assert _run(coord, beats, 10, step=0.05) == []


def test_whole_node_down_is_one_node_event():
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    beats = {r: (0, _beats(0, 20, 0.1 * r)) for r in range(4)}
    # node 1's four devices die together at t=8.05 (their last beats differ by phase)
    for r in range(4, 8):
        beats[r] = (1, _beats(0, 8.05, 0.25 * (r - 4)))
    events = _run(coord, beats, 20)
    assert len(events) == 1, events
    t, ev = events[0]
    assert (ev.scope, ev.state, ev.node, ev.ranks) == ("node", "dead", 1, [4, 5, 6, 7])
    assert t <= 8.05 + 3 * IV
    assert coord.node_down == {1}
    assert coord.dead_ranks() == [4, 5, 6, 7]


def test_rank_rejoin_and_node_rejoin():
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 30, 0.1 * r)) for r in range(8)}
    beats[1] = (0, _beats(0, 5) + _beats(12, 30))  # dead, then back at 12
    for r in range(4, 8):  # node 1 down at 15, back at 25
        beats[r] = (1, _beats(0, 15, 0.1 * r) + _beats(25, 30, 0.1 * r))
    events = [(round(t, 2), e.scope, e.state, e.ranks) for t, e in _run(coord, beats, 30)]
    kinds = [(s, st, r) for _, s, st, r in events]
    assert kinds[0] == ("rank", "dead", [1])
    assert kinds[1] == ("rank", "rejoined", [1])
    assert kinds[2] == ("node", "dead", [4, 5, 6, 7])
    # The node comes back: one node-level rejoin, then any device not yet heard
    # rejoins individually; every device of node 1 is alive again in the end.
    assert kinds[3][0:2] == ("node", "rejoined")
    back = set(kinds[3][2])
    for s, st, r in kinds[4:]:
        assert (s, st) == ("rank", "rejoined")
        back |= set(r)
    assert back == {4, 5, 6, 7}
    assert coord.dead_ranks() == []
    assert 12 <= events[1][0] <= 12.25
    assert 25 <= events[3][0] <= 25.25 + 0.7


def test_rank_that_never_beats_is_detected_from_layout():
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 10)) for r in range(8) if r != 5}
    events = _run(coord, beats, 10)
    assert [(e.scope, e.ranks) for _, e in events] == [("rank", [5])]
    assert events[0][0] <= 3 * IV


def test_layout_dead_rank_beating_is_a_rejoin_and_new_ranks_get_grace():
    coord = LivenessCoordinator(IV, k=2)
    coord.set_expected({0: 0, 1: 0, 2: 0}, {2}, 0.0)
    beats = {0: (0, _beats(0, 10)), 1: (0, _beats(0, 10)), 2: (0, [6.0, 7.0, 8.0, 9.0, 10.0])}
    events = _run(coord, beats, 10)
    assert [(e.ranks, e.state) for _, e in events] == [([2], "rejoined")]
    # A rank added by a new layout at t=20 has until 22.5 to say something.
    coord.set_expected({0: 0, 1: 0, 2: 0, 3: 0}, set(), 20.0)
    events = _run(coord, {r: (0, _beats(10, 30)) for r in range(3)}, 30, t_start=10)
    assert [(e.ranks, e.state) for _, e in events] == [([3], "dead")]
    assert 22.5 <= events[0][0] <= 23.0


def test_resume_after_outage_restarts_deadlines():
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    _run(coord, {r: (r // 4, _beats(0, 5)) for r in range(8)}, 5)
    # Bus down from 5 to 30: nothing heard, nothing judged; then resumed.
    coord.resume(30.0)
    events = _run(coord, {r: (r // 4, _beats(30.5, 40)) for r in range(8)}, 40, t_start=30)
    assert events == []


def test_runtime_k_change_and_validation():
    coord = LivenessCoordinator(IV, k=2)
    with pytest.raises(ValueError, match="k"):
        coord.set_k(0)
    with pytest.raises(ValueError, match="interval_s"):
        LivenessCoordinator(0.0, 2)
    coord.set_k(5)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 20)) for r in range(8)}
    beats[0] = (0, _beats(0, 3))
    events = _run(coord, beats, 20)
    assert 3 + 5 * IV < events[0][0] <= 3 + 6 * IV


def test_ranks_known_only_from_their_beats():
    # No layout: ranks are tracked from their first beat, with the node it names.
    coord = LivenessCoordinator(IV, k=2)
    beats = {r: (r // 4, _beats(1, 20, 0.1 * r)) for r in range(8)}
    beats[1] = (0, _beats(1, 6))
    for r in range(4, 8):
        beats[r] = (1, _beats(1, 12, 0.1 * r))
    events = _run(coord, beats, 20)
    got = [(e.scope, e.state, e.node, e.ranks) for _, e in events]
    assert got == [("rank", "dead", 0, [1]), ("node", "dead", 1, [4, 5, 6, 7])]
    node_ev = events[1][1]
    assert 11 < node_ev.last_seen_s <= 12  # the node's last beat, a real time
    assert coord.node_last_heard()[1] == node_ev.last_seen_s


def test_an_old_beat_read_again_does_not_bring_a_dead_rank_back():
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 10)) for r in range(8) if r != 7}
    beats[7] = (1, [0.0, 1.0])
    events = _run(coord, beats, 10)
    assert [(e.ranks, e.state) for _, e in events] == [([7], "dead")]
    coord.observe(7, 1, 1.0, seq=99)  # its last entry, reclaimed after a consumer restart
    assert coord.check(10.5) == []
    coord.observe(7, 1, 10.6, seq=100)  # a new beat is news
    assert [(e.ranks, e.state) for e in coord.check(10.75)] == [([7], "rejoined")]


def test_a_rank_the_layout_keeps_dead_rejoins_once_not_at_every_layout_rewrite():
    coord = LivenessCoordinator(IV, k=2)
    coord.set_expected({0: 0, 1: 0}, {1}, 0.0)
    beats = {0: (0, _beats(0, 10)), 1: (0, _beats(2, 10))}
    events = _run(coord, beats, 4)
    assert [(e.ranks, e.state) for _, e in events] == [([1], "rejoined")]
    for t in (5.0, 6.0, 7.0):  # plans rewrite the layout; rank 1 is still listed dead
        coord.set_expected({0: 0, 1: 0}, {1}, t)
    events = _run(coord, beats, 10, t_start=4.25)
    assert events == []

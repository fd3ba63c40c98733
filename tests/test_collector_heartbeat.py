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


def test_rank_that_never_beats_is_detected_from_layout_after_the_first_beat_grace():
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 18)) for r in range(8) if r != 5}
    # rank 6 starts late (an import under load), inside its grace, and dies at 13.5
    beats[6] = (1, _beats(9.5, 13.5))
    events = _run(coord, beats, 18)
    got = [(e.scope, e.ranks, t) for t, e in events]
    # the layout's promise is not a beat: FIRST_BEAT_DEADLINES (4) deadlines of 2.5 I;
    # a rank heard once is back on the one deadline
    assert got == [("rank", [5], 10.0 * IV), ("rank", [6], 13.5 + 2.5 * IV)]


def test_layout_dead_rank_beating_is_a_rejoin_and_new_ranks_get_grace():
    coord = LivenessCoordinator(IV, k=2)
    coord.set_expected({0: 0, 1: 0, 2: 0}, {2}, 0.0)
    beats = {0: (0, _beats(0, 10)), 1: (0, _beats(0, 10)), 2: (0, [6.0, 7.0, 8.0, 9.0, 10.0])}
    events = _run(coord, beats, 10)
    assert [(e.ranks, e.state) for _, e in events] == [([2], "rejoined")]
    # A rank added by a new layout at t=20 has until 30 (its first-beat grace) to say something.
    coord.set_expected({0: 0, 1: 0, 2: 0, 3: 0}, set(), 20.0)
    events = _run(coord, {r: (0, _beats(10, 40)) for r in range(3)}, 40, t_start=10)
    assert [(e.ranks, e.state) for _, e in events] == [([3], "dead")]
    assert 30.0 <= events[0][0] <= 30.5


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


# --- job-wide silence: every node quiet together is a stall, not N node failures ---------


def _checks(coord, beats, t_end, t_start=0.0, step=0.25):
    """Like _run, but also the coordinator's silent state after every check:
    -> (events, {check time: job_silent_since_s})."""
    arrivals = sorted((t, r, n) for r, (n, ts) in beats.items() for t in ts)
    events, silent = [], {}
    i = 0
    for q in range(int(round(t_start / step)), int(round(t_end / step)) + 1):
        t = q * step
        while i < len(arrivals) and arrivals[i][0] <= t:
            at, r, n = arrivals[i]
            coord.observe(r, n, at, seq=i)
            i += 1
        events += [(t, ev) for ev in coord.check(t)]
        silent[t] = coord.job_silent_since_s
    return events, silent


def _four_nodes(coord):
    coord.set_expected({r: r // 4 for r in range(16)}, set(), 0.0)


def test_a_job_silent_for_less_than_the_hold_gets_no_verdict_and_is_said_silent():
    coord = LivenessCoordinator(IV, k=2, hold_deadlines=2.0)
    _four_nodes(coord)
    # every rank beats at its own phase (up to 0.75 interval apart, as separate processes
    # do); the whole job stalls at 10.02 for 4 s (the soak's longest gap was 4.3 s)
    beats = {
        r: (r // 4, _beats(0, 10.02, 0.05 * r) + _beats(14.05, 30, 0.05 * r)) for r in range(16)
    }
    events, silent = _checks(coord, beats, 30)
    assert events == []
    # node 1 (last beat 9.35) reaches its deadline first, at 11.85: from the next check
    # the job is said silent since its last beat (rank 0's, at 10.0), until it is heard
    assert silent[11.75] is None
    assert all(silent[t] == pytest.approx(10.0) for t in silent if 12.0 <= t <= 14.0)
    assert all(silent[t] is None for t in silent if t >= 14.25)
    assert coord.dead_ranks() == [] and coord.node_down == set()


def test_a_job_silent_past_the_hold_is_declared_dead_node_by_node():
    coord = LivenessCoordinator(IV, k=2, hold_deadlines=2.0)
    _four_nodes(coord)
    beats = {r: (r // 4, _beats(0, 10.05, 0.05 * r) + _beats(30, 40, 0.05 * r)) for r in range(16)}
    events, silent = _checks(coord, beats, 40)
    dead = [(t, e) for t, e in events if e.state == "dead"]
    assert sorted(e.node for _, e in dead) == [0, 1, 2, 3]
    assert all(e.scope == "node" for _, e in dead)
    for t, e in dead:
        # one deadline (2.5 s) plus the hold of two more after the node's last beat,
        # at the first check past it
        assert e.last_seen_s + 3 * 2.5 * IV <= t < e.last_seen_s + 3 * 2.5 * IV + 0.25
        assert e.ranks == [4 * e.node + i for i in range(4)]
    assert max(t for t, _ in dead) <= 10.05 + 3 * 2.5 * IV + 0.25
    assert silent[15.0] is not None
    assert all(silent[t] is None for t in silent if t >= max(t for t, _ in dead))
    # and the job coming back is one re-join per node, as after any node failure
    back = [e for t, e in events if e.state == "rejoined"]
    assert sorted(e.node for e in back if e.scope == "node") == [0, 1, 2, 3]
    assert coord.dead_ranks() == []


def test_without_a_hold_a_silent_job_is_dead_at_the_plain_deadline():
    coord = LivenessCoordinator(IV, k=2, hold_deadlines=0)
    _four_nodes(coord)
    beats = {r: (r // 4, _beats(0, 10.05)) for r in range(16)}
    events, silent = _checks(coord, beats, 20)
    assert [(t, e.node) for t, e in events] == [(12.5, n) for n in range(4)]
    assert set(silent.values()) == {None}
    with pytest.raises(ValueError, match="hold_deadlines"):
        LivenessCoordinator(IV, k=2, hold_deadlines=-1)


@pytest.mark.parametrize("dying", [[1], [1, 2, 3]])
def test_nodes_dying_while_one_talks_are_dead_at_the_plain_deadline(dying):
    """A node, or every node but one, going silent is reported exactly when it would be
    without the hold: the job kept talking, so their silence is their own."""
    got = {}
    for hold in (0.0, 2.0):
        coord = LivenessCoordinator(IV, k=2, hold_deadlines=hold)
        _four_nodes(coord)
        beats = {r: (r // 4, _beats(0, 30, 0.05 * r)) for r in range(16)}
        for r in range(16):
            if r // 4 in dying:  # these nodes die at 8.05 (their last beats differ by phase)
                beats[r] = (r // 4, _beats(0, 8.05, 0.05 * r))
        events, silent = _checks(coord, beats, 30)
        assert set(silent.values()) == {None}
        got[hold] = [(t, e.scope, e.state, e.node) for t, e in events]
    assert got[2.0] == got[0.0]
    assert [(s, st, n) for _, s, st, n in got[2.0]] == [("node", "dead", n) for n in dying]
    assert all(t <= 8.05 + 2.75 * IV for t, *_ in got[2.0])


def test_after_a_silence_every_deadline_runs_from_when_the_job_is_heard_again():
    """Nobody is judged on a job-wide silence (as on an outage of the bus): a device that
    beats again at its own phase a moment after its peers is not dead, and a node still
    silent once the job talks again is dead one deadline after that."""
    coord = LivenessCoordinator(IV, k=2, hold_deadlines=2.0)
    _four_nodes(coord)
    # the whole job stalls at 10.05; all but node 3 are back at 14.05, at their phases
    beats = {
        r: (r // 4, _beats(0, 10.05, 0.05 * r) + _beats(14.05, 30, 0.05 * r)) for r in range(12)
    }
    beats.update({r: (3, _beats(0, 10.05, 0.05 * r)) for r in range(12, 16)})
    events, silent = _checks(coord, beats, 30)
    # heard again at 14.05 (first check 14.25): node 3 dead at 14.05 + 2.5, next check
    assert [(t, e.scope, e.state, e.node) for t, e in events] == [(16.75, "node", "dead", 3)]
    assert events[0][1].last_seen_s == pytest.approx(9.75)  # its real last beat
    assert silent[14.0] is not None and silent[14.25] is None


def test_a_device_dying_during_normal_beats_is_unaffected_by_the_hold():
    coord = LivenessCoordinator(IV, k=2, hold_deadlines=2.0)
    _two_nodes(coord)
    beats = {r: (r // 4, _beats(0, 20, phase=0.1 * r)) for r in range(8)}
    beats[2] = (0, _beats(0, 5.2, phase=0.2))
    events, silent = _checks(coord, beats, 20)
    assert [(t, e.scope, e.ranks) for t, e in events] == [(7.75, "rank", [2])]
    assert set(silent.values()) == {None}


def test_the_deadline_stretches_with_the_jitter_a_loaded_job_shows_and_relaxes_after():
    """Late or silent (issue 24): gaps of a live node near the 2.5 I deadline (a loaded
    host) stretch it to 1.5 x the longest gap, at most 2x; a stopped node never completes
    its gap; a minute of beats on time brings the static deadline back."""
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    late = [0.0, 1.0, 3.2, 4.2, 5.2]  # node 1 heard again 2.2 I after a beat: late, alive
    beats = {r: (r // 4, _beats(0, 40)) for r in range(4)}
    beats |= {r: (1, late + _beats(6.2, 30.2)) for r in range(4, 8)}
    events = _run(coord, beats, 34)
    assert coord.deadline_s() == pytest.approx(1.5 * 2.2 * IV)
    # node 1 stops after 30.2: dead at the stretched deadline, not the static 2.5 I
    # (static: 32.7; checks every 0.25 I)
    assert [(e.node, t) for t, e in events] == [(1, pytest.approx(30.2 + 3.3 * IV))]
    # a minute and more of beats on time: back to the static deadline
    more = {r: (0, _beats(40, 130)) for r in range(4)}
    _run(coord, more, 130, t_start=34.25)
    assert coord.deadline_s() == 2.5 * IV
    # and never beyond DEADLINE_STRETCH_MAX x the static deadline
    coord = LivenessCoordinator(IV, k=2, stretch_max=1.2)
    _two_nodes(coord)
    _run(coord, beats, 10)
    assert coord.deadline_s() == pytest.approx(1.2 * 2.5 * IV)


def test_a_rank_in_the_jobs_first_iteration_gets_the_start_grace_then_the_deadline():
    """Model build and first collectives starve a rank's beats (CI: the torch trainer's
    ranks went quiet > 1.25 s in iteration 0): a rank whose beats still say iteration 0
    is starting and gets FIRST_BEAT_DEADLINES deadlines; beating a later one, K beats."""
    coord = LivenessCoordinator(IV, k=2)
    _two_nodes(coord)
    t = 0.0
    events = []

    def run_to(t_end, quiet=(), iteration=lambda t: 0):
        nonlocal t
        while t <= t_end + 1e-9:
            if abs(t - round(t)) < 1e-9:
                for r in range(8):
                    if r not in quiet:
                        coord.observe(r, r // 4, t, seq=int(t), iteration=iteration(t))
            events.extend((t, e) for e in coord.check(t))
            t += 0.25

    # rank 6 beats iteration 0 then goes quiet at 3 while its node talks: alive at 9.5
    run_to(3.0)
    run_to(9.5, quiet={6})
    assert events == []
    # ... dead at its start deadline (4 x 2.5 I after its last beat)
    run_to(14.0, quiet={6})
    assert [(e.ranks, e.state, tt) for tt, e in events] == [([6], "dead", 13.0)]
    # the job trains on (iteration 1 and later): rank 6 back, then the plain deadline
    run_to(20.0, iteration=lambda t: int(t) - 14)
    assert [(e.ranks, e.state) for _, e in events[1:]] == [([6], "rejoined")]
    del events[:]
    run_to(25.0, quiet={2}, iteration=lambda t: int(t) - 14)
    assert [(e.ranks, e.state, tt) for tt, e in events] == [([2], "dead", 22.5)]

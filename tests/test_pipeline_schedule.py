"""Schedules: validity over many shapes, the validator's error messages, bubble and memory properties."""

from __future__ import annotations

import pytest

from resihp.pipeline import Schedule, build_schedule

SHAPES = [(p, m) for p in range(1, 9) for m in range(1, 13)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zbh1"])
def test_every_shape_is_valid_and_complete(kind):
    for p, m in SHAPES:
        s = build_schedule(kind, p, m)
        s.validate()
        kinds = ("F", "B", "W") if kind == "zbh1" else ("F", "B")
        for st in range(p):
            chunks = sorted(s.order[st])
            assert chunks == sorted((k, j) for k in kinds for j in range(m)), (kind, p, m, st)


def test_interleaved_shapes_are_valid():
    for p in range(1, 7):
        for m in range(p, 4 * p + 1, p):
            for v in (2, 3):
                s = build_schedule("interleaved", p, m, v)
                s.validate()
                assert sum(len(o) for o in s.order) == 2 * m * p * v
    with pytest.raises(ValueError, match="divisible"):
        build_schedule("interleaved", 4, 6)


def test_uniform_makespan_matches_bubble_formula():
    for p, m in SHAPES:
        # F=1, fused B=2: (m + p - 1)(F + B) for both GPipe and 1F1B.
        assert build_schedule("1f1b", p, m).makespan_units(1, 1, 1) == (m + p - 1) * 3
        assert build_schedule("gpipe", p, m).makespan_units(1, 1, 1) == (m + p - 1) * 3
        zb = build_schedule("zbh1", p, m).makespan_units(1, 1, 1)
        assert 3 * m + (p - 1) <= zb <= (m + p - 1) * 3
        if p >= 2 and m >= p:
            assert zb < (m + p - 1) * 3, (p, m)  # W chunks fill cool-down bubbles


def _peak_in_flight(order, minus):
    live = peak = 0
    for k, _ in order:
        if k == "F":
            live += 1
        elif k == minus:
            live -= 1
        peak = max(peak, live)
    return peak


def test_memory_limits():
    for p, m in SHAPES:
        for s, order in enumerate(build_schedule("1f1b", p, m).order):
            assert _peak_in_flight(order, "B") <= min(p - s, m)
        for s, order in enumerate(build_schedule("zbh1", p, m).order):
            assert _peak_in_flight(order, "B") <= min(p - s, m)
            assert _peak_in_flight(order, "W") <= min(p, m)
        # GPipe keeps every micro-batch alive.
        assert _peak_in_flight(build_schedule("gpipe", p, m).order[0], "B") == m


def _custom(order, split=False):
    return Schedule("custom", len(order), 2, tuple(tuple(o) for o in order), split_w=split)


def test_validator_names_the_problem():
    good = [[("F", 0), ("F", 1), ("B", 0), ("B", 1)], [("F", 0), ("B", 0), ("F", 1), ("B", 1)]]
    _custom(good).validate()
    with pytest.raises(ValueError, match="twice"):
        _custom([good[0] + [("F", 0)], good[1]]).validate()
    with pytest.raises(ValueError, match="never runs B1"):
        _custom([good[0][:-1], good[1]]).validate()
    with pytest.raises(ValueError, match="B0 before F0"):
        _custom([[("B", 0), ("F", 0), ("F", 1), ("B", 1)], good[1]]).validate()
    with pytest.raises(ValueError, match="kind 'W'"):
        _custom([good[0] + [("W", 0)], good[1]]).validate()
    with pytest.raises(ValueError, match="W1 before B1"):
        _custom(
            [
                [("F", 0), ("F", 1), ("B", 0), ("W", 0), ("W", 1), ("B", 1)],
                [("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)],
            ],
            split=True,
        ).validate()
    # Stage 1 runs micro-batch 1 first; stage 0 needs B0 (last on stage 1) before F1.
    deadlock = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("B", 1), ("F", 0), ("B", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        _custom(deadlock).validate()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule kind"):
        build_schedule("pipedream", 4, 4)
    with pytest.raises(ValueError, match="num_stages"):
        build_schedule("1f1b", 0, 4)

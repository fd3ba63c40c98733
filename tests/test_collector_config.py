"""CollectorConfig: validation names the bad field; CLI arguments map onto fields."""

from __future__ import annotations

import argparse

import pytest

from collector.config import CollectorConfig


@pytest.mark.parametrize(
    "field,value",
    [
        ("heartbeat_k", 0),
        ("heartbeat_interval_s", 0.0),
        ("heartbeat_interval_s", -1),
        ("grace_s", "5"),
        ("read_count", 0),
        ("jitter_beats", 1.0),
        ("check_interval_s", 2.0),  # longer than the heartbeat interval
        ("tp_dedup", "yes"),
        ("iterations_budget_mb", 0),
        ("job_id", "bad id!"),
        ("instance", ""),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CollectorConfig(**{field: value})


def test_defaults_detect_within_three_intervals():
    cfg = CollectorConfig()
    assert cfg.heartbeat_interval_s == 1.0 and cfg.heartbeat_k == 2
    # K missed beats, the jitter slack and one check period stay inside 3 intervals.
    worst = (cfg.heartbeat_k + cfg.jitter_beats) * cfg.heartbeat_interval_s + cfg.check_every_s
    assert worst <= 3 * cfg.heartbeat_interval_s


def test_from_args():
    p = argparse.ArgumentParser()
    CollectorConfig.add_arguments(p)
    a = p.parse_args(
        [
            "--job-id",
            "j1",
            "--heartbeat-k",
            "3",
            "--tp-dedup",
            "--grace-s",
            "2.5",
            "--instance",
            "b",
        ]
    )
    cfg = CollectorConfig.from_args(a)
    assert (cfg.job_id, cfg.heartbeat_k, cfg.tp_dedup, cfg.grace_s, cfg.instance) == (
        "j1",
        3,
        True,
        2.5,
        "b",
    )
    with pytest.raises(ValueError, match="heartbeat_k"):
        CollectorConfig.from_args(p.parse_args(["--heartbeat-k", "-2"]))

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


@pytest.mark.parametrize(
    "env,want",
    [
        ("1", True),
        ("true", True),
        ("True", True),
        ("TRUE", True),
        ("on", True),
        ("Yes", True),
        (" yes ", True),
        ("0", False),
        ("false", False),
        ("OFF", False),
        ("No", False),
        ("", False),
    ],
)
def test_tp_dedup_env_is_read_in_any_case(monkeypatch, env, want):
    # "True", "on" and "Yes" used to read as false
    monkeypatch.setenv("RESIHP_COLLECTOR_TP_DEDUP", env)
    p = argparse.ArgumentParser()
    CollectorConfig.add_arguments(p)
    assert CollectorConfig.from_args(p.parse_args([])).tp_dedup is want
    assert CollectorConfig.from_args(p.parse_args(["--tp-dedup"])).tp_dedup is True


def test_tp_dedup_env_refuses_what_is_not_a_yes_or_no(monkeypatch, capsys):
    from collector.__main__ import main

    monkeypatch.setenv("RESIHP_COLLECTOR_TP_DEDUP", "ture")
    assert main(["--check-health"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("collector: bad setting: tp_dedup (RESIHP_COLLECTOR_TP_DEDUP): ")
    assert "'ture'" in err and "1/true/yes/on or 0/false/no/off" in err and err.count("\n") == 1

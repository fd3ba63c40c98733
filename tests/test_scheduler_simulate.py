"""Policies on the analytical timeline and the ``simulate`` CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from resihp.pipeline.models import table3_layout
from resihp.scenario import ScenarioError, ScenarioEvent, parse_scenario
from scheduler.policies import POLICIES, Abort, get_policy
from scheduler.predict import Predictor
from scheduler.simulate import (
    calibrate,
    run_timeline,
    severity_factor,
)


def Event(at_s, at_iteration, action, ranks=(), **kw):  # noqa: N802 - reads like the old tuple
    return ScenarioEvent(action, at_iteration=at_iteration, at_s=at_s, ranks=tuple(ranks), **kw)


MODEL = "llama2-13b"


@pytest.fixture(scope="module")
def setup():
    lay = table3_layout(MODEL, 8)
    pred = Predictor(MODEL)
    calibrate(pred, lay, 8.05)
    return lay, pred


def test_calibration_hits_fault_free_throughput(setup):
    lay, pred = setup
    assert pred.samples_per_s(lay, {}) == pytest.approx(8.05, rel=1e-9)


def test_baselines_drop_whole_groups_and_abort_when_a_stage_is_gone(setup):
    lay, pred = setup
    # rank 5 is replica 1 stage 0, rank 1 is replica 0 stage 0
    st = get_policy("recycle").adapt([lay], {5: 0.0}, pred)
    assert st[0].groups[1][0] == [] and len(st[0].migrations) == 8
    with pytest.raises(Abort, match="stage 0"):
        get_policy("recycle").adapt(st, {5: 0.0, 1: 0.0}, pred)
    st2 = get_policy("resihp").adapt([lay], {5: 0.0, 1: 0.0}, pred)
    assert all(st2[0].groups[d][0] for d in range(2))
    with pytest.raises(Abort):
        get_policy("greyhound").adapt([lay], {5: 0.0}, pred)


def test_recycle_reroutes_within_its_fault_free_1f1b_memory(setup):
    lay, pred = setup
    ff = pred.iteration_s(lay, {})
    rates = {}
    for name in ("recycle", "recycle-ideal"):
        pol = get_policy(name)
        st = pol.adapt(pol.initial_state(lay), {5: 0.0}, pred)
        rates[name] = ff / pol.iteration_s(st, {5: 0.0}, pred)
    # the peer runs its own 8 and the 8 rerouted micro-batches as one 1F1B sequence of 16
    twice = table3_layout(MODEL, 16)
    assert rates["recycle"] == pytest.approx(ff / pred.iteration_s(twice, {}), rel=1e-9)
    assert 0.5 < rates["recycle"] < 0.65  # (m + p - 1) / (2m + p - 1) = 11/19 for PP 4
    # unbounded memory lets the list-scheduled reroute use idle slots: faster, never slower
    assert rates["recycle-ideal"] > rates["recycle"] + 0.05


def test_oobleck_rebuilds_heterogeneous_pipelines(setup):
    lay, pred = setup
    pol = get_policy("oobleck")
    st = pol.adapt(pol.initial_state(lay), {5: 0.0}, pred)
    assert sum(x.total_microbatches for x in st) == lay.total_microbatches
    assert all(5 not in x.coords() for x in st)
    assert sum(len(x.groups[0]) for x in st) == 7  # every intact TP group is reused


def test_oobleck_reinstantiates_from_start_templates(setup):
    lay, pred = setup
    pol = get_policy("oobleck")
    st = pol.initial_state(lay)
    # a whole pipeline's groups lost: training goes on with the other (Oobleck's own
    # reconfiguration tests), the partition of its unchanged template
    p = {lay.groups[1][s][0]: 0.0 for s in range(lay.pp)}
    out = pol.adapt(st, p, pred)
    assert len(out) == 1 and out[0].groups[0] == lay.groups[0]
    assert out[0].total_microbatches == lay.total_microbatches
    # every group damaged: no template fits
    p = {lay.groups[d][s][0]: 0.0 for d in range(lay.dp) for s in range(lay.pp)}
    with pytest.raises(Abort, match="template"):
        pol.adapt(pol.initial_state(lay), p, pred)
    # a pipeline's partition is its size's template from the start, whatever the speeds
    pol = get_policy("oobleck")
    out = pol.adapt(pol.initial_state(lay), {5: 0.0, 24: 0.3}, pred)
    tmpl = pol.templates(pred)
    assert all(x.layers == tmpl[len(x.groups[0])] for x in out)


def test_adaptra_gains_only_the_slack_the_straggler_made(setup):
    lay, pred = setup
    p = {9: 0.5}
    t_ff = pred.iteration_s(lay, {})
    t_slow = pred.iteration_s(lay, p)
    for name in ("adaptra", "adaptra-ideal"):
        pol = get_policy(name)
        st = pol.adapt(pol.initial_state(lay), p, pred)
        assert st[0].schedule == "zbh1"
        t = pol.iteration_s(st, p, pred)
        if name == "adaptra":
            assert t_ff < t <= t_slow
            faithful = t
        else:
            assert t < faithful  # the ideal one also keeps ZB-H1's fault-free bubble saving
    pol = get_policy("adaptra")
    pol.initial_state(lay)
    assert pol.adapt([lay], {}, pred)[0].schedule == "1f1b"  # recovered: back to the job's


def test_greyhound_balances_on_measured_replica_times(setup):
    lay, pred = setup
    p = {9: 0.5}  # replica 0 stage 1 slow
    for name in ("greyhound", "greyhound-ideal"):
        st = get_policy(name).adapt([lay], p, pred)
        m = st[0].microbatches
        assert sum(m) == lay.total_microbatches and m[0] < m[1]


def test_resihp_beats_baselines_on_fail_stop_timeline(setup):
    lay, pred = setup
    events = [Event(1800.0, None, "kill_device", (5,)), Event(5400.0, None, "kill_device", (1,))]
    out = {
        p: run_timeline(get_policy(p), lay, events, pred, 4 * 3600.0, MODEL)
        for p in ("resihp", "recycle", "oobleck")
    }
    assert not out["resihp"].aborted
    assert out["recycle"].aborted and out["recycle"].abort_at_s == pytest.approx(5400.0, abs=60)
    assert out["resihp"].samples_per_s > out["oobleck"].samples_per_s
    assert out["resihp"].samples_per_s < 8.05
    # training halts between the kill and the reconfiguration
    seg = [s for s in out["resihp"].segments if s[0] >= 1800.0 and s[1] <= 1830.0]
    assert seg and seg[0][2] == 0.0


def test_fail_slow_severity_matches_the_unmitigated_drop(setup):
    lay, pred = setup
    f = severity_factor(pred, lay, [5], "medium")
    assert 0 < f < 1
    t0 = pred.iteration_s(lay, {})
    assert pred.iteration_s(lay, {5: f}) == pytest.approx(t0 / 0.45, rel=1e-3)
    ev = [Event(600.0, None, "slow_device", (5,), severity="medium")]
    none = run_timeline(get_policy("none"), lay, ev, pred, 7200.0, MODEL)
    res = run_timeline(get_policy("resihp"), lay, ev, pred, 7200.0, MODEL)
    grey = run_timeline(get_policy("greyhound"), lay, ev, pred, 7200.0, MODEL)
    assert none.samples_per_s < grey.samples_per_s < res.samples_per_s


def test_every_policy_runs_a_mixed_timeline(setup):
    lay, pred = setup
    ev = [
        Event(600.0, None, "slow_device", (20,), factor=0.4),
        Event(1200.0, None, "kill_device", (9,)),
    ]
    for name in POLICIES:
        r = run_timeline(get_policy(name), lay, ev, pred, 3600.0, MODEL)
        assert r.samples_per_s > 0
        slow_only = ("none", "greyhound", "adaptra", "greyhound-ideal", "adaptra-ideal")
        assert r.aborted == (name in slow_only)


def test_scenario_errors_name_the_line():
    text = "events:\n  - {at_s: 10, action: kill_device, rank: 1}\n  - {at_s: 20, action: slow_device, rank: 2}\n"
    with pytest.raises(
        ScenarioError, match=r"s.yaml:3: slow_device needs exactly one of factor or severity"
    ):
        parse_scenario(text, "s.yaml")
    sc = parse_scenario("name: x\nevents:\n  - {at_iteration: 5, action: kill_node, node: 1}\n")
    assert sc.name == "x" and sc.events[0].targets(8) == list(range(8, 16))


def test_simulate_cli(tmp_path):
    sc = tmp_path / "sc.yaml"
    sc.write_text("events:\n  - {at_s: 600, action: kill_device, rank: 5}\n")
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "scheduler",
        "simulate",
        "--scenario",
        str(sc),
        "--policy",
        "resihp",
        "--out",
        str(out),
        "--model",
        MODEL,
        "--duration-s",
        "3600",
        "--fault-free-samples-per-s",
        "8.05",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert d["policy"] == "resihp" and not d["aborted"] and 0 < d["samples_per_s"] < 8.05
    bad = tmp_path / "bad.yaml"
    bad.write_text("events:\n  - {at_s: 600, action: explode, rank: 5}\n")
    p = subprocess.run(cmd[:5] + [str(bad)] + cmd[6:], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "bad.yaml:2" in p.stderr
    far = tmp_path / "far.yaml"
    far.write_text("events:\n  - {at_s: 600, action: kill_device, rank: 99}\n")
    p = subprocess.run(cmd[:5] + [str(far)] + cmd[6:], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "far.yaml:2" in p.stderr and "outside" in p.stderr


def test_oobleck_split_pipelines_match_the_engine_when_healthy(setup):
    lay, pred = setup
    pol = get_policy("oobleck")
    assert pol.iteration_s(pol.initial_state(lay), {}, pred) == pytest.approx(
        pred.iteration_s(lay, {}), rel=1e-9
    )


def test_link_only_recover_leaves_compute_slow(setup):
    lay, pred = setup
    slow = Event(600.0, None, "slow_device", (5,), factor=0.4)
    rates = {}
    for what in ("link", "all"):
        ev = [slow, ScenarioEvent("recover", at_s=1200.0, ranks=(5,), what=what)]
        r = run_timeline(get_policy("none"), lay, ev, pred, 1800.0, MODEL)
        rates[what] = r.segments[-1][2]
    assert rates["link"] < 0.9 * rates["all"]


def test_greyhound_style_detection_pays_its_false_alarm_validations(setup):
    lay, pred = setup
    healthy = pred.iteration_s(lay, {})
    for name in ("greyhound", "recycle+greyhound", "oobleck+greyhound"):
        pol = get_policy(name)
        t = pol.iteration_s(pol.initial_state(lay), {}, pred)
        # a few % of a healthy iteration: ~1 validation pause of 3.3 s per 47 iterations
        assert t - healthy == pytest.approx(3.28 * 3.4 / 160, rel=0.05)
    for name in ("resihp", "recycle", "oobleck", "adaptra"):
        pol = get_policy(name)
        assert pol.iteration_s(pol.initial_state(lay), {}, pred) == pytest.approx(healthy, rel=0.01)


@pytest.mark.parametrize(
    "opt,value,msg",
    [
        ("--microbatches", "0", "--microbatches: must be an integer >= 1, got 0"),  # ZeroDivision
        ("--seq-len", "0", "--seq-len: must be an integer >= 1"),  # ValueError traceback
        ("--duration-s", "nan", "--duration-s: must be a finite number > 0, got nan"),
        ("--duration-s", "-5", "--duration-s: must be a finite number > 0, got -5.0"),
        ("--fault-free-samples-per-s", "-1", "--fault-free-samples-per-s: must be a finite"),
    ],
)
def test_simulate_refuses_bad_options_in_one_line(tmp_path, capsys, opt, value, msg):
    from scheduler.__main__ import main

    sc = tmp_path / "s.yaml"
    sc.write_text("events:\n  - {at_s: 10, action: kill_device, rank: 1}\n")
    out = tmp_path / "r.json"
    argv = ["simulate", "--scenario", str(sc), "--policy", "resihp", "--out", str(out)]
    assert main([*argv, opt, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"simulate: bad setting: {msg}") and err.count("\n") == 1, err
    assert not out.exists()  # nothing simulated or written


def test_paper_kill_process_follows_section_8_3(setup):
    """Table 6's kills: half the nodes untouched, the other half gone at 30m; ReCycle aborts at G+1."""
    import random

    from scheduler.simulate import paper_kill_events

    lay, pred = setup
    half = lay.world_size // 2
    evs = paper_kill_events(lay, 1800.0, lay.world_size / 4 * 3600.0, random.Random(7))
    ranks = [e.ranks[0] for e in evs]
    assert len(ranks) == len(set(ranks)) == half  # 50 % of the GPUs, each once
    assert [e.at_s for e in evs] == [900.0 + 1800.0 * k for k in range(half)]
    nodes = {lay.node_of(r) for r in ranks}
    assert len(nodes) == lay.num_nodes // 2  # the other half of the nodes is never touched
    assert all(set(lay.node_ranks(n)) <= set(ranks) for n in nodes)  # and this half is gone
    for n in nodes:  # inside a node: ascending local index; the nodes take turns
        mine = [r for r in ranks if lay.node_of(r) == n]
        assert mine == sorted(mine)
    assert len({lay.node_of(r) for r in ranks[: len(nodes)]}) == len(nodes)
    # whole-TP-group dropping: survives the first G kills (1h), aborts at kill G + 1 (30m)
    g = lay.dp * lay.pp
    pol = get_policy("recycle")
    st = pol.initial_state(lay)
    for k in range(1, len(ranks) + 1):
        p = {x: 0.0 for x in ranks[:k]}
        if k <= g:
            st = pol.adapt(st, p, pred)
        else:
            with pytest.raises(Abort, match="every DP replica"):
                pol.adapt(st, p, pred)
            break
    assert k == g + 1

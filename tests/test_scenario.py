"""Scenario files: YAML and JSON parse alike; every error names the bad line; the timeline cursor."""

from __future__ import annotations

import json

import pytest

from resihp.scenario import (
    ScenarioCursor,
    ScenarioError,
    default_factor,
    load_scenario,
    parse_scenario,
)

YAML = """\
name: mixed
seed: 4
events:
  - at_iteration: 5
    action: slow_device
    rank: 3
    severity: medium
    duration_iterations: 4
  - {at_s: 30.5, action: kill_node, node: 1}
  - {at_iteration: 7, action: slow_link, ranks: [2, 9], factor: 0.25}
  - {at_iteration: 9, action: recover, rank: 2, what: link}
  - {at_iteration: 20, action: rejoin, node: 1}
"""


def test_yaml_and_json_parse_the_same(tmp_path):
    y = parse_scenario(YAML, "s.yaml")
    import yaml

    j_path = tmp_path / "s.json"
    j_path.write_text(json.dumps(yaml.safe_load(YAML), indent=2))
    j = load_scenario(j_path)
    assert y.name == j.name == "mixed" and y.seed == j.seed == 4

    def strip(evs):
        return [
            (e.action, e.at_iteration, e.at_s, e.ranks, e.node, e.factor, e.severity) for e in evs
        ]

    assert strip(y.events) == strip(j.events)
    assert [e.line for e in y.events] == [4, 9, 10, 11, 12]
    assert y.events[1].targets(8) == list(range(8, 16))
    assert y.events[2].ranks == (2, 9)
    assert all(e.line > 0 for e in j.events)
    assert parse_scenario("", "empty.yaml").events == []
    # A bare list of events is accepted too.
    assert len(parse_scenario("- {at_iteration: 1, action: kill_device, rank: 0}\n").events) == 1


BAD = [
    ("events:\n  - {at_iteration: 1, action: explode, rank: 0}\n", 2, "action must be one of"),
    ("events:\n  - at_iteration: 1\n    action: kill_device\n    rnk: 3\n", 4, "unknown key 'rnk'"),
    ("events:\n  - {action: kill_device, rank: 0}\n", 2, "exactly one of at_iteration or at_s"),
    ("events:\n  - {at_s: 1, at_iteration: 2, action: kill_device, rank: 0}\n", 2, "exactly one"),
    (
        "events:\n  - {at_iteration: 1, action: kill_device, rank: 0}\n  - {at_iteration: 2, action: slow_device, rank: 1, severity: awful}\n",
        3,
        "severity must be one of",
    ),
    (
        "events:\n  - at_iteration: 1\n    action: slow_device\n    rank: 1\n    factor: 1.5\n",
        5,
        "factor must be in",
    ),
    (
        "events:\n  - {at_iteration: 1, action: slow_device, rank: 1}\n",
        2,
        "exactly one of factor or severity",
    ),
    ("events:\n  - {at_iteration: 1, action: kill_node, rank: 1}\n", 2, "kill_node needs 'node'"),
    (
        "events:\n  - {at_iteration: -3, action: kill_device, rank: 1}\n",
        2,
        "at_iteration must be an integer",
    ),
    (
        "events:\n  - {at_iteration: 1, action: kill_device, rank: 1, duration_s: 5}\n",
        2,
        "durations apply only",
    ),
    ("events:\n  - {at_iteration: 1, action: recover}\n", 2, "needs 'rank', 'ranks' or 'node'"),
    ("events:\n  - 42\n", 2, "must be a mapping"),
    ("events:\n  - {at_iteration: 1, action: kill_device, rank: 1\n", 3, "invalid YAML"),
    ("evnts: []\n", 1, "unknown top-level key"),
    ("events: {a: 1}\n", 1, "'events' must be a list"),
]


@pytest.mark.parametrize("text,line,msg", BAD)
def test_errors_name_the_bad_line(text, line, msg):
    with pytest.raises(ScenarioError) as ei:
        parse_scenario(text, "bad.yaml")
    assert str(ei.value).startswith(f"bad.yaml:{line}:"), str(ei.value)
    assert msg in str(ei.value)


def test_json_errors_name_the_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(
        '{\n  "events": [\n    {"at_iteration": 1, "action": "kill_device" "rank": 0}\n  ]\n}\n'
    )
    with pytest.raises(ScenarioError, match=r"bad.json:3: invalid JSON"):
        load_scenario(p)
    p.write_text(
        '{\n  "events": [\n    {"at_iteration": 1,\n     "action": "kill_device",\n     "rank": 0,\n     "severity": "weak"}\n  ]\n}\n'
    )
    with pytest.raises(ScenarioError, match=r"bad.json:6: kill_device takes no factor or severity"):
        load_scenario(p)
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")


def test_check_against_the_job():
    sc = parse_scenario(
        "events:\n  - {at_iteration: 1, action: kill_device, rank: 0}\n  - {at_iteration: 1, action: kill_device, rank: 64}\n",
        "j.yaml",
    )
    sc.check(128, 8)
    with pytest.raises(ScenarioError, match=r"j.yaml:3: rank 64 outside the job's 64 ranks"):
        sc.check(64, 8)
    sc = parse_scenario("events:\n  - {at_iteration: 1, action: kill_node, node: 9}\n", "n.yaml")
    with pytest.raises(ScenarioError, match=r"n.yaml:2: node 9 outside"):
        sc.check(64, 8)


def test_cursor_fires_in_time_and_ends_timed_slowdowns():
    sc = parse_scenario(YAML)
    cur = ScenarioCursor(sc)
    assert cur.due(4, 29.0) == []
    fired = cur.due(5, 29.0)
    assert [e.action for e in fired] == ["slow_device"]
    assert cur.next_kill_at_s() == 30.5
    assert [e.action for e in cur.due(5, 31.0)] == ["kill_node"]
    due = cur.due(9, 40.0)
    assert sorted(e.action for e in due) == ["recover", "recover", "slow_link"]
    gen = [e for e in due if e.line == 0]
    assert len(gen) == 1 and gen[0].what == "compute" and gen[0].ranks == (3,)
    assert [e.action for e in cur.due(100, 1e9)] == ["rejoin"]
    assert cur.pending == []


def test_severity_defaults_follow_the_paper():
    assert default_factor("weak") == pytest.approx(0.65)
    assert default_factor("medium") == pytest.approx(0.45)
    assert default_factor("severe") == pytest.approx(0.30)


def test_generators_round_trip_and_respect_limits(tmp_path):
    from resihp.scenario import dump_scenario, failslow_scenario, failstop_scenario

    fs = failstop_scenario(16, 1800, 8 * 3600, seed=3)
    assert len(fs.events) == 8  # the 30-minute scenario stops at half the cluster
    killed = [r for e in fs.events for r in e.ranks]
    assert len(set(killed)) == 8 and all(0 <= r < 16 for r in killed)
    fl = failslow_scenario(64, 24000, seed=1)
    gaps = [b.at_s - a.at_s for a, b in zip(fl.events, fl.events[1:], strict=False)]
    assert 150 < sum(gaps) / len(gaps) < 350  # Poisson, mean 240 s
    assert all(60 < e.duration_s < 180 and e.severity == "medium" for e in fl.events)
    for sc, name in ((fs, "fs.yaml"), (fl, "fl.json")):
        dump_scenario(sc, tmp_path / name)
        back = load_scenario(tmp_path / name)
        assert [(e.action, e.at_s, e.ranks, e.duration_s) for e in back.events] == [
            (e.action, e.at_s, e.ranks, e.duration_s) for e in sc.events
        ]


def test_scenario_cli(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("events:\n  - {at_iteration: 1, action: kill_node, node: 40}\n")
    cmd = [sys.executable, "-m", "trainer", "scenario", "check", str(bad), "--world", "64"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"{bad}:2: node 40 outside" in out.stderr
    gen = tmp_path / "g.yaml"
    cmd = [sys.executable, "-m", "trainer", "scenario", "failstop", "--world", "8"]
    cmd += ["--every-s", "60", "--horizon-s", "600", "--out", str(gen)]
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    assert len(load_scenario(gen).events) == 4


def test_the_scenarios_the_docs_ship_load():
    from pathlib import Path

    from resihp.scenario import load_scenario

    files = sorted((Path(__file__).resolve().parents[1] / "docs" / "scenarios").glob("*.yaml"))
    assert files
    for f in files:
        assert load_scenario(str(f)).events, f


def test_seed_must_be_a_non_negative_integer_named_on_its_line():
    # -1 passed `scenario check` and `resihp up`, then the simulator died in numpy
    text = "name: x\n# a comment\nseed: -1\nevents: []\n"
    with pytest.raises(ScenarioError, match=r"^bad.yaml:3: seed must be an integer >= 0, got -1$"):
        parse_scenario(text, "bad.yaml")
    assert parse_scenario("seed: 0\nevents: []\n").seed == 0


def test_flow_style_yaml_is_read_as_yaml_when_it_is_not_json(tmp_path):
    ev = "{at_iteration: 5, action: kill_device, rank: 1}"
    for text in (f"[{ev}]", f"{{events: [{ev}]}}", f"{{name: flow,\n events: [\n  {ev}]}}"):
        sc = parse_scenario(text, "flow.yaml")
        assert [(e.action, e.at_iteration, e.ranks) for e in sc.events] == [
            ("kill_device", 5, (1,))
        ], text
    p = tmp_path / "flow.json"  # a .json name does not stop the YAML reading either
    p.write_text(f"[{ev}]\n")
    assert load_scenario(p).events[0].ranks == (1,)
    # neither JSON nor YAML: the JSON error, with its line
    with pytest.raises(ScenarioError, match=r"^bad.yaml:2: invalid JSON: "):
        parse_scenario('{"events": [\n  {"at_s": 1,, "action": "x"}]}', "bad.yaml")
    # flow YAML errors past the parse still name the event's line
    with pytest.raises(ScenarioError, match=r"^bad.yaml:3: action must be one of"):
        parse_scenario("{events: [\n  " + ev + ",\n  {at_s: 2, action: explode}]}", "bad.yaml")


@pytest.mark.parametrize(
    "text,msg,fixed",
    [
        ("{at_s: 1e3, action: kill_device, rank: 1}", "write 1.0e+3 or 1000)", "1.0e+3"),
        ("{at_s: 25e-4, action: kill_device, rank: 1}", "write 25.0e-4 or 0.0025)", "25.0e-4"),
        ("{at_iteration: 1e3, action: kill_device, rank: 1}", "write 1000)", "1000"),
        (
            "{at_iteration: 1, action: slow_device, rank: 1, factor: 5e-1}",
            "factor must be a number, got '5e-1' (YAML reads 5e-1 as text: write 5.0e-1 or 0.5)",
            "5.0e-1",
        ),
    ],
)
def test_exponent_numbers_yaml_reads_as_text_say_how_to_write_them(text, msg, fixed):
    with pytest.raises(ScenarioError) as ei:
        parse_scenario(f"events:\n  - {text}\n", "bad.yaml")
    assert str(ei.value).startswith("bad.yaml:2: ") and msg in str(ei.value), str(ei.value)
    bad = next(w for w in ("1e3", "25e-4", "5e-1") if w in text)
    assert parse_scenario(f"events:\n  - {text.replace(bad, fixed)}\n").events  # the advice works

"""Failure-scenario files: events on a timeline, shared by the simulator, the torch trainer and
the scheduler's analytical timeline (it lives in the core so services need not import each other).

A scenario is YAML or JSON (format in docs/scenario.md)::

    name: medium fail-slow then a node loss
    events:
      - {at_iteration: 50, action: slow_device, rank: 12, severity: medium}
      - {at_s: 300, action: kill_node, node: 1}
      - {at_iteration: 80, action: slow_link, rank: 9, factor: 0.2, duration_iterations: 40}
      - {at_iteration: 400, action: rejoin, node: 1}

Actions: ``kill_device`` / ``kill_node`` (fail-stop), ``slow_device``
(compute speed multiplied by ``factor`` or set by ``severity``
weak/medium/severe, §8.3: ~35/55/70 % unmitigated throughput drop),
``slow_link`` (bandwidth of the rank's links multiplied by ``factor`` or set
by severity), ``recover`` (full compute and/or link speed again), ``rejoin``
(a dead device or node comes back, idle, for the scheduler to use).
Times are iterations (``at_iteration``) or seconds of training time since job
start (``at_s``).  Every error names the file and line of the bad entry.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ACTIONS = ("kill_device", "kill_node", "slow_device", "slow_link", "recover", "rejoin")
#: §8.3: unmitigated throughput drop of weak / medium / severe fail-slows.
SEVERITY_DROP = {"weak": 0.35, "medium": 0.55, "severe": 0.70}
_KEYS = {
    "action",
    "at_iteration",
    "at_s",
    "rank",
    "ranks",
    "node",
    "factor",
    "severity",
    "duration_iterations",
    "duration_s",
    "what",
    "comment",
}
_TOP_KEYS = {"name", "seed", "events", "description"}


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message starts with ``file:line:``."""


def default_factor(severity: str) -> float:
    """Speed multiplier giving the severity's throughput drop when the device is the bottleneck."""
    return 1.0 - SEVERITY_DROP[severity]


@dataclass(frozen=True)
class ScenarioEvent:
    """One timeline entry. ``line`` is its line in the file (0 for generated events)."""

    action: str
    at_iteration: int | None = None
    at_s: float | None = None
    ranks: tuple[int, ...] = ()
    node: int | None = None
    factor: float | None = None
    severity: str | None = None
    duration_iterations: int | None = None
    duration_s: float | None = None
    what: str = "all"  # recover: "compute" | "link" | "all"
    line: int = 0
    source: str = ""

    def targets(self, devices_per_node: int) -> list[int]:
        """Ranks the event touches (a node expands to its devices)."""
        out = list(self.ranks)
        if self.node is not None:
            lo = self.node * devices_per_node
            out.extend(range(lo, lo + devices_per_node))
        return sorted(set(out))

    def where(self) -> str:
        return f"{self.source}:{self.line}" if self.line else "(generated)"

    def describe(self) -> str:
        tgt = f"node {self.node}" if self.node is not None else f"ranks {list(self.ranks)}"
        how = (
            f" severity={self.severity}"
            if self.severity
            else (f" factor={self.factor}" if self.factor is not None else "")
        )
        when = (
            f"iteration {self.at_iteration}" if self.at_iteration is not None else f"t={self.at_s}s"
        )
        return f"{self.action} {tgt}{how} at {when}"


@dataclass
class Scenario:
    events: list[ScenarioEvent] = field(default_factory=list)
    name: str = ""
    seed: int | None = None
    source: str = ""

    def check(self, world_size: int, devices_per_node: int) -> None:
        """Raise ScenarioError (with the line) for ranks or nodes outside the job."""
        nodes = -(-world_size // devices_per_node)
        for ev in self.events:
            for r in ev.ranks:
                if not 0 <= r < world_size:
                    raise ScenarioError(
                        f"{ev.where()}: rank {r} outside the job's {world_size} ranks"
                    )
            if ev.node is not None and not 0 <= ev.node < nodes:
                raise ScenarioError(f"{ev.where()}: node {ev.node} outside the job's {nodes} nodes")


# --------------------------------------------------------------------------- parsing


def _line_map(
    text: str,
) -> tuple[int, dict[str, int], list[int], list[dict[str, int]], tuple[int, str] | None]:
    """(top line, top-level {key: line}, per-event line, per-event {key: line}, first
    duplicated key as (line, key) or None) from the YAML node tree (1-based).  YAML and
    JSON loaders keep the last of two equal keys without a word; a scenario must not lose
    an event's first ``at_s`` that way."""
    try:
        root = yaml.compose(text.replace("\t", " "), Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return 1, {}, [], [], None
    if root is None:
        return 1, {}, [], [], None
    dup: tuple[int, str] | None = None

    def keys_of(node) -> dict[str, int]:
        nonlocal dup
        out: dict[str, int] = {}
        for k, _v in node.value:
            name, line = str(getattr(k, "value", "")), k.start_mark.line + 1
            if name in out and dup is None:
                dup = (line, name)
            out.setdefault(name, line)
        return out

    seq = None
    top_keys: dict[str, int] = {}
    if isinstance(root, yaml.SequenceNode):
        seq = root
    elif isinstance(root, yaml.MappingNode):
        top_keys = keys_of(root)
        for k, v in root.value:
            if getattr(k, "value", None) == "events" and isinstance(v, yaml.SequenceNode):
                seq = v
    ev_lines: list[int] = []
    key_lines: list[dict[str, int]] = []
    if seq is not None:
        for item in seq.value:
            ev_lines.append(item.start_mark.line + 1)
            key_lines.append(keys_of(item) if isinstance(item, yaml.MappingNode) else {})
    return root.start_mark.line + 1, top_keys, ev_lines, key_lines, dup


def _empty(source: str) -> ScenarioError:
    return ScenarioError(
        f"{source}:1: empty scenario file (no events; write 'events: []' for a run "
        "without failures)"
    )


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(e, "problem", None) or str(e)
        raise ScenarioError(f"{source}:{line}: invalid YAML: {problem}") from None
    except (ValueError, RecursionError) as e:
        raise ScenarioError(f"{source}:1: invalid YAML: {type(e).__name__}: {e}") from None


def _load_json_or_yaml(text: str, source: str) -> Any:
    """Text that looks like JSON (a ``.json`` file, or text opening with ``{`` or ``[``):
    JSON, else YAML (a flow-style YAML list or mapping, ``[{at_iteration: 5, ...}]``,
    opens the same way).  When both fail the JSON error is the one said."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        json_err = ScenarioError(f"{source}:{e.lineno}: invalid JSON: {e.msg}")
    except (ValueError, RecursionError) as e:  # e.g. an integer of 5,000 digits
        json_err = ScenarioError(f"{source}:1: invalid JSON: {e}")
    try:
        return _load_yaml(text, source)
    except ScenarioError:
        raise json_err from None


def parse_scenario(text: str, source: str = "<scenario>", allow_empty: bool = True) -> Scenario:
    """Parse scenario text (YAML, or JSON when it looks like JSON and parses as JSON).

    Text with no content (blank, or YAML comments only) is a scenario without events
    unless ``allow_empty`` is False (a scenario *file*: see :func:`load_scenario`). A
    mapping must have ``events``; ``events: []`` says on purpose that there are none."""
    stripped = text.lstrip()
    if not stripped and not allow_empty:
        raise _empty(source)  # before JSON, which would call it invalid
    if source.endswith(".json") or stripped.startswith(("{", "[")):
        data = _load_json_or_yaml(text, source)
    else:
        data = _load_yaml(text, source)
    try:
        top_line, top_keys, ev_lines, key_lines, dup = _line_map(text)
    except RecursionError:
        top_line, top_keys, ev_lines, key_lines, dup = 1, {}, [], [], None
    if dup is not None:
        raise ScenarioError(f"{source}:{dup[0]}: duplicate key {dup[1]!r}")
    if data is None:
        if not allow_empty:
            raise _empty(source)
        return Scenario(source=source)
    name, seed = "", None
    if isinstance(data, dict):
        unknown = set(map(str, data)) - _TOP_KEYS
        if unknown:
            raise ScenarioError(
                f"{source}:{top_line}: unknown top-level key(s) {sorted(unknown)}; "
                f"expected {sorted(_TOP_KEYS)}"
            )
        name = str(data.get("name", ""))
        seed = data.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            # the simulator's random generator takes no negative seed (numpy refuses it)
            raise ScenarioError(
                f"{source}:{top_keys.get('seed', top_line)}: seed must be an integer >= 0, "
                f"got {seed!r}{_text_number_hint(seed, integer=True)}"
            )
        if "events" not in data:
            raise ScenarioError(
                f"{source}:{top_line}: no events: the scenario has no 'events' list "
                "(write 'events: []' for a run without failures)"
            )
        items = data["events"]
    elif isinstance(data, list):
        items = data
    else:
        raise ScenarioError(
            f"{source}:{top_line}: a scenario is a mapping with 'events' or a list of events"
        )
    if not isinstance(items, list):
        raise ScenarioError(f"{source}:{top_keys.get('events', top_line)}: 'events' must be a list")
    events = []
    for i, item in enumerate(items):
        line = ev_lines[i] if i < len(ev_lines) else 0
        keys = key_lines[i] if i < len(key_lines) else {}
        events.append(_parse_event(item, source, line, keys))
    return Scenario(events=events, name=name, seed=seed, source=source)


def _text_number_hint(v: Any, integer: bool = False) -> str:
    """For a number YAML read as text (YAML 1.1 takes ``1e3`` for a string: a float
    needs a dot and a signed exponent), how to write it; else ''."""
    if not isinstance(v, str):
        return ""
    try:
        x = float(v.strip())
    except ValueError:
        return ""
    if not math.isfinite(x):
        return ""
    plain = repr(int(x)) if x.is_integer() and abs(x) < 1e16 else repr(x)
    if integer:
        return f" (YAML reads {v} as text: write {plain})" if x.is_integer() else ""
    mant, e, exp = v.strip().lower().partition("e")
    forms = []
    if e:
        if "." not in mant:
            mant += ".0"
        if exp[:1] not in ("+", "-"):
            exp = "+" + exp
        forms.append(f"{mant}e{exp}")
    if "e" not in plain:
        forms.append(plain)
    return f" (YAML reads {v} as text: write {' or '.join(forms)})" if forms else ""


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioError(f"{p}:0: cannot read scenario file: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = p.read_bytes()[: e.start].count(b"\n") + 1
        raise ScenarioError(f"{p}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return parse_scenario(text, str(p), allow_empty=False)


def _parse_event(item: Any, source: str, line: int, keys: dict[str, int]) -> ScenarioEvent:
    def fail(msg: str, key: str | None = None) -> ScenarioError:
        ln = keys.get(key, line) if key else line
        return ScenarioError(f"{source}:{ln}: {msg}")

    if not isinstance(item, dict):
        raise fail(f"an event must be a mapping, got {type(item).__name__}")
    unknown = set(map(str, item)) - _KEYS
    if unknown:
        k = sorted(unknown)[0]
        raise fail(f"unknown key {k!r} in event; expected some of {sorted(_KEYS)}", k)
    action = item.get("action")
    if action not in ACTIONS:
        raise fail(f"action must be one of {list(ACTIONS)}, got {action!r}", "action")

    def integer(key: str, minimum: int = 0) -> int | None:
        v = item.get(key)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            hint = _text_number_hint(v, integer=True)
            raise fail(f"{key} must be an integer >= {minimum}, got {v!r}{hint}", key)
        return v

    def number(key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
        v = item.get(key)
        if v is None:
            return None
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise fail(f"{key} must be a number, got {v!r}{_text_number_hint(v)}", key)
        v = float(v)
        if not math.isfinite(v):
            raise fail(f"{key} must be a finite number, got {v}", key)
        if (v <= lo if lo_open else v < lo) or v > hi:
            raise fail(f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
        return v

    at_it = integer("at_iteration")
    at_s = number("at_s", 0.0, float("inf"))
    if (at_it is None) == (at_s is None):
        raise fail("give exactly one of at_iteration or at_s")
    ranks: list[int] = []
    if "rank" in item:
        r = integer("rank")
        ranks.append(r)
    if "ranks" in item:
        rs = item["ranks"]
        if not isinstance(rs, list) or not rs:
            raise fail(f"ranks must be a non-empty list of integers, got {rs!r}", "ranks")
        for r in rs:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise fail(f"ranks must hold integers >= 0, got {r!r}", "ranks")
            ranks.append(r)
    node = integer("node")
    factor = number("factor", 0.0, 1.0, lo_open=True)
    severity = item.get("severity")
    if severity is not None and (not isinstance(severity, str) or severity not in SEVERITY_DROP):
        raise fail(f"severity must be one of {list(SEVERITY_DROP)}, got {severity!r}", "severity")
    dur_it = integer("duration_iterations", 1)
    dur_s = number("duration_s", 0.0, float("inf"), lo_open=True)
    what = item.get("what", "all")
    if what not in ("all", "compute", "link"):
        raise fail(f"what must be 'all', 'compute' or 'link', got {what!r}", "what")
    if dur_it is not None and dur_s is not None:
        raise fail("give at most one of duration_iterations or duration_s")

    if action == "kill_node":
        if node is None or ranks:
            raise fail("kill_node needs 'node' (and no ranks); use kill_device for ranks")
    elif action == "kill_device":
        if not ranks or node is not None:
            raise fail("kill_device needs 'rank' or 'ranks'; use kill_node for a whole node")
    elif not ranks and node is None:
        raise fail(f"{action} needs 'rank', 'ranks' or 'node'")
    if action in ("slow_device", "slow_link"):
        if (factor is None) == (severity is None):
            raise fail(f"{action} needs exactly one of factor or severity")
    elif factor is not None or severity is not None:
        raise fail(
            f"{action} takes no factor or severity", "factor" if factor is not None else "severity"
        )
    if (dur_it is not None or dur_s is not None) and action not in ("slow_device", "slow_link"):
        raise fail("durations apply only to slow_device and slow_link")
    if "what" in item and action != "recover":
        raise fail("'what' applies only to recover", "what")
    return ScenarioEvent(
        action=action,
        at_iteration=at_it,
        at_s=at_s,
        ranks=tuple(ranks),
        node=node,
        factor=factor,
        severity=severity,
        duration_iterations=dur_it,
        duration_s=dur_s,
        what=what,
        line=line,
        source=source,
    )


# --------------------------------------------------------------------------- timeline


class ScenarioCursor:
    """Hands out events as training reaches them; schedules the end of timed slowdowns."""

    def __init__(self, scenario: Scenario | None):
        self._pending: list[ScenarioEvent] = list(scenario.events) if scenario else []
        self.fired: list[ScenarioEvent] = []

    def _is_due(self, ev: ScenarioEvent, iteration: int, t_s: float) -> bool:
        if ev.at_iteration is not None:
            return ev.at_iteration <= iteration
        return ev.at_s is not None and ev.at_s <= t_s + 1e-12

    def due(self, iteration: int, t_s: float) -> list[ScenarioEvent]:
        """Events whose time has come at (iteration, training time t_s), in file order."""
        out, keep = [], []
        for ev in self._pending:
            (out if self._is_due(ev, iteration, t_s) else keep).append(ev)
        self._pending = keep
        for ev in out:
            self.fired.append(ev)
            if ev.duration_iterations is not None or ev.duration_s is not None:
                what = "compute" if ev.action == "slow_device" else "link"
                end = replace(
                    ev,
                    action="recover",
                    factor=None,
                    severity=None,
                    duration_iterations=None,
                    duration_s=None,
                    what=what,
                    at_iteration=(iteration + ev.duration_iterations)
                    if ev.duration_iterations is not None
                    else None,
                    at_s=(t_s + ev.duration_s) if ev.duration_s is not None else None,
                    line=0,
                )
                self._pending.append(end)
        return out

    def next_at_s(self) -> float | None:
        """Earliest pending time-based event (lets a run stop an iteration at a mid-way kill)."""
        ts = [ev.at_s for ev in self._pending if ev.at_s is not None]
        return min(ts) if ts else None

    def next_kill_at_s(self) -> float | None:
        ts = [
            ev.at_s
            for ev in self._pending
            if ev.at_s is not None and ev.action in ("kill_device", "kill_node")
        ]
        return min(ts) if ts else None

    @property
    def pending(self) -> list[ScenarioEvent]:
        return list(self._pending)


# --------------------------------------------------------------------------- generators


def scenario_to_dict(sc: Scenario) -> dict[str, Any]:
    """The file form of a scenario (round-trips through :func:`parse_scenario`)."""
    events = []
    for ev in sc.events:
        d: dict[str, Any] = {"action": ev.action}
        if ev.at_iteration is not None:
            d["at_iteration"] = ev.at_iteration
        else:
            d["at_s"] = ev.at_s
        if ev.node is not None:
            d["node"] = ev.node
        if len(ev.ranks) == 1:
            d["rank"] = ev.ranks[0]
        elif ev.ranks:
            d["ranks"] = list(ev.ranks)
        for key in ("factor", "severity", "duration_iterations", "duration_s"):
            v = getattr(ev, key)
            if v is not None:
                d[key] = v
        if ev.action == "recover" and ev.what != "all":
            d["what"] = ev.what
        events.append(d)
    out: dict[str, Any] = {"name": sc.name or "generated", "events": events}
    if sc.seed is not None:
        out["seed"] = sc.seed
    return out


def dump_scenario(sc: Scenario, path: str | Path) -> None:
    p = Path(path)
    data = scenario_to_dict(sc)
    if p.suffix == ".json":
        p.write_text(json.dumps(data, indent=2) + "\n")
    else:
        p.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


def failstop_scenario(
    world_size: int,
    every_s: float,
    horizon_s: float,
    *,
    devices_per_event: int = 1,
    min_alive_fraction: float = 0.5,
    seed: int = 0,
) -> Scenario:
    """Monotonic fail-stops every ``every_s`` seconds (paper §8.3: 2h / 1h / 30m), random devices,
    never below ``min_alive_fraction`` of the cluster."""
    import random

    if every_s <= 0 or horizon_s <= 0 or world_size < 1 or devices_per_event < 1:
        raise ValueError("every_s, horizon_s, world_size and devices_per_event must be positive")
    rng = random.Random(seed)
    alive = list(range(world_size))
    floor = int(round(world_size * min_alive_fraction))
    events = []
    t = every_s
    while t <= horizon_s and len(alive) - devices_per_event >= floor:
        victims = sorted(rng.sample(alive, devices_per_event))
        alive = [r for r in alive if r not in victims]
        events.append(ScenarioEvent(action="kill_device", at_s=float(t), ranks=tuple(victims)))
        t += every_s
    name = f"fail-stop every {every_s:g}s over {horizon_s:g}s"
    return Scenario(events=events, name=name, seed=seed)


def failslow_scenario(
    world_size: int,
    horizon_s: float,
    *,
    mean_interarrival_s: float = 240.0,
    duration_mean_s: float = 120.0,
    duration_sd_s: float = 20.0,
    severity: str = "medium",
    seed: int = 0,
) -> Scenario:
    """Transient compute fail-slows with Poisson arrivals and normal durations (Greyhound's
    injection: mean 240 s apart, lasting N(120 s, 20 s))."""
    import random

    if severity not in SEVERITY_DROP:
        raise ValueError(f"severity must be one of {list(SEVERITY_DROP)}")
    if mean_interarrival_s <= 0 or horizon_s <= 0 or world_size < 1:
        raise ValueError("mean_interarrival_s, horizon_s and world_size must be positive")
    rng = random.Random(seed)
    events = []
    t = rng.expovariate(1.0 / mean_interarrival_s)
    while t <= horizon_s:
        dur = max(1.0, rng.gauss(duration_mean_s, duration_sd_s))
        events.append(
            ScenarioEvent(
                action="slow_device",
                at_s=round(t, 3),
                ranks=(rng.randrange(world_size),),
                severity=severity,
                duration_s=round(dur, 3),
            )
        )
        t += rng.expovariate(1.0 / mean_interarrival_s)
    return Scenario(
        events=events, name=f"{severity} fail-slows, Poisson {mean_interarrival_s:g}s", seed=seed
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer scenario {check,failstop,failslow}``: validate or generate scenario files."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m trainer scenario", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    ck = sub.add_parser("check", help="parse a scenario file and print its events")
    ck.add_argument("file")
    ck.add_argument("--world", type=int, default=0, help="also check ranks against this world size")
    ck.add_argument("--devices-per-node", type=int, default=8)
    fs = sub.add_parser("failstop", help="monotonic fail-stops at a fixed period")
    fs.add_argument("--world", type=int, required=True)
    fs.add_argument("--every-s", type=float, required=True)
    fs.add_argument("--horizon-s", type=float, required=True)
    fs.add_argument("--devices-per-event", type=int, default=1)
    fs.add_argument("--min-alive-fraction", type=float, default=0.5)
    fl = sub.add_parser("failslow", help="Poisson transient fail-slows")
    fl.add_argument("--world", type=int, required=True)
    fl.add_argument("--horizon-s", type=float, required=True)
    fl.add_argument("--mean-interarrival-s", type=float, default=240.0)
    fl.add_argument("--duration-mean-s", type=float, default=120.0)
    fl.add_argument("--duration-sd-s", type=float, default=20.0)
    fl.add_argument("--severity", default="medium", choices=list(SEVERITY_DROP))
    for sp in (fs, fl):
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--out", required=True, help="file to write (.yaml or .json)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "check":
            sc = load_scenario(a.file)
            if a.world:
                sc.check(a.world, a.devices_per_node)
            for ev in sc.events:
                print(f"{ev.where()}: {ev.describe()}")
            if not sc.events:
                print(f"{a.file}: 0 events (a run without failures)")
            return 0
        if a.cmd == "failstop":
            sc = failstop_scenario(
                a.world,
                a.every_s,
                a.horizon_s,
                devices_per_event=a.devices_per_event,
                min_alive_fraction=a.min_alive_fraction,
                seed=a.seed,
            )
        else:
            sc = failslow_scenario(
                a.world,
                a.horizon_s,
                mean_interarrival_s=a.mean_interarrival_s,
                duration_mean_s=a.duration_mean_s,
                duration_sd_s=a.duration_sd_s,
                severity=a.severity,
                seed=a.seed,
            )
    except (ScenarioError, ValueError) as e:
        print(f"scenario: {e}", file=sys.stderr)
        return 2
    dump_scenario(sc, a.out)
    print(f"wrote {len(sc.events)} events to {a.out}")
    return 0

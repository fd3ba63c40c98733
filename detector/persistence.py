"""Persistence and flapping policy: which confirmed slowdowns and recoveries are worth a re-plan.

The stages before this one confirm that a device *is* slow (a change point that
costs throughput, localized and validated).  This stage decides whether it has
been slow *long enough* to act on, and whether a recovery is stable enough to
give the device its work back.  docs/detector.md ("Persistence and flapping")
gives the reasoning; in short:

* **Hold a new slowdown** until the detector has seen it slow in
  ``persist_min_iters`` iterations (``evidence.seen_slow``: the points of its own
  series over the shift bar up to the finding, then each iteration its device is
  measured still at its slow level; not the iterations since the change point,
  which ruptures estimates backwards) *and* the time it has already cost (the sum over
  those iterations of throughput loss x iteration time), or what it will cost
  at its current rate over as long again (a ramp's rate climbs), but at least
  ``failslow_min_duration_s`` (40 s: a fail-slow past the straggler horizon lasts tens
  of seconds to hours), reaches
  ``replan_cost_s``, the cost of one re-plan (ski rental: staying slow is
  "renting", re-planning is "buying"; buying once the rent paid equals the
  price is never worse than twice the best choice in hindsight).  After
  ``persist_max_iters`` it is released whatever it cost: the rule must not
  wait forever on a job with short iterations.  A slowdown whose device reads
  healthy in the iteration it would be released is held on; one that the
  earlier stages see recover while held was a transient straggler and nothing
  is reported (``transient_total``).
* **Hold a recovery** of a reported device for ``stable_iters`` iterations: a
  device that turns slow again meanwhile is intermittent (flapping): the new
  slowdown is not reported again (the device stays set aside, as reported), and
  the hold starts over from its next recovery (``flaps_total``).  The recovery
  is reported once the device has been stable for the whole hold, with
  ``evidence.intermittent`` and ``evidence.flaps`` when it flapped.

Rejects: slowdowns shorter than the hold (1-3 iteration stragglers), repeated
reports of a flapping device.  Passes at once: a group the warm-up comparisons found
slow (it was slow through the whole warm-up window).  Passes severity changes of a reported device
that is not under a held recovery.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from detector.config import DetectorConfig
from detector.failslow import Finding, SlowState

#: Findings of the warm-up comparisons (detector/warmup.py): the group was slow through
#: the (re-)warm-up's iterations, longer than any hold here.
WARMUP_SIGNALS = ("warmup_peer_comparison", "warmup_prior_comparison")


@dataclass
class _Held:
    finding: Finding
    since_iteration: int  # the first slow iteration the detector saw
    seen_iters: int  # slow iterations it has seen of it (the hold counts these)
    change_point: int  # the change point's iteration (ruptures' estimate, for the evidence)
    cost_s: float = 0.0  # what it has cost so far (throughput loss x iteration time)
    found_level: float | None = None  # log slow ratio it was costed at (the finding's)
    iters: int = 0


@dataclass
class _Recovering:
    finding: Finding
    stable_iters: int = 0
    flaps: int = 0


@dataclass
class PersistenceStats:
    held_total: int = 0
    transient_total: int = 0
    flaps_total: int = 0
    log: list[dict] = field(default_factory=list)


def _overlap(a: list[int], b: list[int]) -> bool:
    return bool(set(a) & set(b))


def _still_slow(st: SlowState | None) -> bool:
    """Whether a held slowdown's device still runs at its slow level in this iteration:
    above the midpoint (log scale) between healthy and the level it was found at.

    The recovery stage's own test (within ``recovery_shift``, 3 %, of healthy) is for
    saying a device is healthy again; used here it let a 3-iteration straggler at 1.58x
    be released as "still slow" on a reading of 1.03x two iterations after it ended (one
    held-out transient job in ``bench/detection_realistic.py``)."""
    if st is None:
        return True
    if st.healthy_streak:
        return False
    return st.level is None or st.level >= 0.5 * float(np.log(max(st.factor, 1.0)))


def _seen(f: Finding, iteration: int) -> tuple[int, int, int]:
    """A new slowdown's (first slow iteration seen, slow iterations seen, change point).

    The change point (``evidence.change_point.iteration``) is ruptures' estimate of when the
    new regime began, made backwards over the window: on the torch trainer's telemetry it
    came 2 iterations before the first slow one, and a hold counted from it reported the
    rank in its 2nd slow iteration.  The hold counts what the device's own series showed
    instead (``evidence.seen_slow``, stage 5: the newest run of points each above the
    shift bar), never more than the iterations since the change point.  A finding
    without it (none of stage 5's) falls back to the change point."""
    cp = f.evidence.get("change_point") or {}
    cp_it = cp.get("iteration", iteration) if isinstance(cp, dict) else iteration
    cp_it = min(int(cp_it), iteration) if isinstance(cp_it, int | float) else iteration
    seen = f.evidence.get("seen_slow")
    if not isinstance(seen, dict) or not isinstance(seen.get("iters"), int):
        return cp_it, iteration - cp_it + 1, cp_it
    first = seen.get("since_iteration")
    since = max(cp_it, int(first)) if isinstance(first, int) else iteration + 1
    return since, max(0, min(seen["iters"], iteration - since + 1)), cp_it


def _seen_in(st: SlowState | None, iteration: int) -> bool:
    """Whether the held device's level was measured in ``iteration`` (stage 7 sets
    ``level_iteration``).  One no series measures any longer (gone with a fail-stop, or
    detached from its group by a re-plan: its probes alone judge it) counts every
    iteration, as the hold did before: it must not be held forever."""
    if st is None or (st.group is None and st.link is None):
        return True
    return st.level_iteration == iteration


class PersistenceGate:
    """Stage 6, persistence: sits between the fail-slow findings and the reports.

    Rejects slowdowns that end before the hold (stragglers: ``transient_total``) and the
    re-reports of a flapping device (``flaps_total``); see the module doc."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.held: list[_Held] = []
        self.recovering: list[_Recovering] = []
        # devices slow again during their recovery hold, waiting for their next recovery
        self._pending_flap: dict[tuple, _Recovering] = {}
        self.stats = PersistenceStats()

    def apply_config(self, cfg: DetectorConfig) -> None:
        self.cfg = cfg

    def step(
        self,
        iteration: int,
        iteration_time_s: float,
        findings: list[Finding],
        slow: dict[tuple, SlowState],
    ) -> list[Finding]:
        """This iteration's findings in, the ones to report out (held ones may come later)."""
        out: list[Finding] = []
        for f in findings:
            if f.kind == "recovery":
                out += self._on_recovery(f)
            elif f.evidence.get("signal") == "severity_change":
                out += self._on_severity(f)
            else:
                out += self._on_slow(f, iteration)
        out += self._tick_held(iteration, iteration_time_s, slow)
        out += self._tick_recovering(iteration)
        return out

    # -------------------------------------------------------------- inputs
    def _on_slow(self, f: Finding, iteration: int) -> list[Finding]:
        rec = next((r for r in self.recovering if _overlap(r.finding.ranks, f.ranks)), None)
        if rec is not None:
            # slow again before its recovery was stable: intermittent, still set aside
            rec.flaps += 1
            rec.stable_iters = 0
            self.stats.flaps_total += 1
            self._log(iteration, "flap", f)
            self.recovering.remove(rec)
            self._pending_flap[tuple(sorted(f.ranks))] = rec
            return []
        if self.cfg.persist_min_iters <= 1 and self.cfg.replan_cost_s <= 0:
            return [f]
        if f.evidence.get("signal") in WARMUP_SIGNALS:
            return [f]  # slow through a whole (re-)warm-up window: it has persisted
        since, seen, cp_it = _seen(f, iteration)
        self.held.append(_Held(f, since, seen, cp_it))
        self.stats.held_total += 1
        return []

    def _on_recovery(self, f: Finding) -> list[Finding]:
        held = next((h for h in self.held if _overlap(h.finding.ranks, f.ranks)), None)
        if held is not None:
            # recovered before it was ever reported: a transient straggler
            self.held.remove(held)
            self.stats.transient_total += 1
            self._log(f.iteration, "transient", held.finding)
            return []
        key = next((k for k in self._pending_flap if _overlap(list(k), f.ranks)), None)
        if key is not None:
            rec = self._pending_flap.pop(key)
            rec.finding = f
            rec.stable_iters = 0
            self.recovering.append(rec)
            return []
        if self.cfg.stable_iters <= 0:
            return [f]
        self.recovering.append(_Recovering(f))
        return []

    def _on_severity(self, f: Finding) -> list[Finding]:
        held = next((h for h in self.held if _overlap(h.finding.ranks, f.ranks)), None)
        if held is not None:
            held.finding.severity = dict(f.severity)
            return []
        if any(_overlap(r.finding.ranks, f.ranks) for r in self.recovering):
            return []
        if any(_overlap(list(k), f.ranks) for k in self._pending_flap):
            return []
        return [f]

    # --------------------------------------------------------------- clocks
    def _tick_held(self, iteration: int, it_s: float, slow: dict) -> list[Finding]:
        out = []
        cfg = self.cfg
        for h in list(self.held):
            f = h.finding
            loss = f.evidence.get("throughput_loss")
            loss = float(loss) if isinstance(loss, int | float) else cfg.min_throughput_loss
            st = next((s for s in slow.values() if _overlap(s.ranks, f.ranks)), None)
            loss_now = self._loss_now(h, st, loss)
            still_slow = _still_slow(st)
            if h.iters == 0:
                # the slow iterations seen up to the finding (it included), at this cost each
                h.cost_s = loss * it_s * max(1, h.seen_iters)
            else:
                h.cost_s += loss_now * it_s
                # only an iteration its device was seen slow in counts towards the hold
                if still_slow and _seen_in(st, iteration):
                    h.seen_iters += 1
            h.iters += 1
            lasted = h.seen_iters
            # ski rental: re-plan once the rent paid, or the rent still to pay at today's
            # rate over as long again as it has lasted (Lindy) but at least the shortest
            # duration a fail-slow is expected to last, reaches the re-plan's price
            expected_s = loss_now * max(it_s * lasted, cfg.failslow_min_duration_s)
            due = lasted >= cfg.persist_min_iters and (
                max(h.cost_s, expected_s) >= cfg.replan_cost_s or lasted >= cfg.persist_max_iters
            )
            if due and still_slow:
                self.held.remove(h)
                f.iteration = iteration
                f.evidence["persistence"] = {
                    "since_iteration": h.since_iteration,
                    "lasted_iters": lasted,
                    "change_point_iteration": h.change_point,
                    "cost_s": round(h.cost_s, 3),
                    "expected_cost_s": round(expected_s, 3),
                    "replan_cost_s": cfg.replan_cost_s,
                }
                out.append(f)
        return out

    @staticmethod
    def _loss_now(h: _Held, st: SlowState | None, loss: float) -> float:
        """The held slowdown's throughput loss in this iteration: the finding's cost scaled
        by how far the device's level moved since (log ratios; at most 1 - 1/ratio).

        A throttling ramp is found when it barely costs 5 % and keeps climbing: costed at
        its finding's rate it waited the whole ``persist_max_iters`` (10) and was reported
        8 iterations after crossing 5 % (tuning ramp, seed 0, at 3 s per iteration)."""
        if st is None or st.level is None or st.factor <= 1.0:
            return loss
        if h.found_level is None:
            h.found_level = float(np.log(st.factor))
        if h.found_level <= 0:
            return loss
        level = max(0.0, st.level)
        return float(min(loss * level / h.found_level, 1.0 - np.exp(-level)))

    def _tick_recovering(self, iteration: int) -> list[Finding]:
        out = []
        for r in list(self.recovering):
            r.stable_iters += 1
            if r.stable_iters >= self.cfg.stable_iters:
                self.recovering.remove(r)
                f = r.finding
                f.iteration = iteration
                f.evidence["stable_iters"] = r.stable_iters
                if r.flaps:
                    f.evidence["intermittent"] = True
                    f.evidence["flaps"] = r.flaps
                out.append(f)
        return out

    def _log(self, iteration: int, what: str, f: Finding) -> None:
        if len(self.stats.log) < 1000:
            self.stats.log.append({"iteration": iteration, "what": what, "ranks": list(f.ranks)})

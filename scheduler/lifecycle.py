"""Plan lifecycle: monotonic ids, state machine, operator actions, audit records.

States::

    proposed --acknowledge--> acknowledged --applied (trainer)--> applied --(next applied)--> superseded
        |---reject---> rejected
        |---override--> overridden   (+ a new plan, parent_plan_id = old, state acknowledged)
        |---override infeasible --> a new "refused" record carrying the reason in ``note``
    proposed/acknowledged --(a newer plan is proposed, an override or an
                             acknowledgement of another plan)--> superseded
    proposed --(made for a layout the job has left: stale)--> superseded

A new plan (proposed, an override's, or one acknowledged) leaves no other plan open:
the others are superseded with a note naming it, and it answers their reports.  A plan
whose ``before`` is not the running layout cannot be acknowledged or overridden.

    acknowledged --failed (trainer: it will not run the plan; the reason in ``note``)--> failed
    failed --override--> overridden (+ a new plan, as above)

``applied`` is a fact, not a request: the trainer picks a plan up while it is
acknowledged and may finish applying it after an operator rejected it, an override
replaced it or a newer plan superseded it.  Its confirmation is then accepted from
those states too (the audit note says what happened), because the job now runs that
layout; only a plan that was never acknowledged cannot have been applied.  ``failed`` is
the trainer's answer the other way (its layout does not run there, or the ranks it needs
died first): the job stays on, or goes back to, a layout that ran; the plan is not retried
(it would fail again) and stays where operators see it, who may override it.  A plan the
trainer gives up on after it was already closed keeps its state (the audit says so).

In ``auto`` mode a proposed plan is acknowledged by actor ``"auto"`` once its
grace period (``apply_after_s``) has passed; in ``manual`` mode it waits for an
operator.  An operator's ``hold`` stops that clock for one proposed plan (its
``apply_after_s`` becomes ``AdaptationPlan.HELD``; the state stays ``proposed``): it
then waits for an operator's decision as in manual mode.  Every operator action, accepted or refused, yields an
:class:`AuditRecord` (who, when, what, result).

This module is pure: :class:`PlanBook` keeps plans in memory and returns what
changed; the service persists snapshots (``keys.plans``, ``keys.plan_state``)
and audit records (``keys.audit``), and reloads them after a restart.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resihp.schemas import AdaptationPlan, OperatorAction

#: Allowed transitions; anything else is refused with a reason.
TRANSITIONS: dict[str, set[str]] = {
    "proposed": {"acknowledged", "overridden", "rejected", "superseded"},
    "acknowledged": {"applied", "overridden", "rejected", "superseded", "failed"},
    "overridden": {"applied"},
    # an operator who rejected a plan may still put their own in its place (the way on
    # for a job that waits on a fail-stop whose plan was rejected)
    "rejected": {"applied", "overridden"},
    "applied": {"superseded"},
    "superseded": {"applied"},
    "refused": set(),
    # the trainer could not run it: an operator may put their own plan in its place
    "failed": {"overridden"},
}

#: States a plan leaves only when the trainer confirms it applied it (see above).
LATE_APPLY = ("overridden", "rejected", "superseded")

OVERRIDE_KEYS = ("layers", "keep_ranks", "drop_ranks", "migration")


class OverrideError(ValueError):
    """An override that cannot run; the message says why."""


@dataclass
class PlanDraft:
    """What a planner produces: the content of a plan before it gets an id and a state."""

    before: dict[str, Any]
    after: dict[str, Any]
    predicted_before_s: float
    predicted_after_s: float
    moves: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    note: str = ""
    #: ``before`` with every device healthy (see AdaptationPlan.predicted_healthy_s)
    predicted_healthy_s: float = 0.0


@dataclass
class AuditRecord:
    """One operator (or automatic) action and what the scheduler did with it."""

    actor: str
    action: str
    plan_id: int
    at_s: float
    result: str  # "ok" | "refused"
    note: str = ""
    new_plan_id: int = 0
    override: dict[str, Any] = field(default_factory=dict)
    comment: str = ""
    action_id: str = ""
    recorded_at_s: float = 0.0

    def to_fields(self) -> dict[str, str]:
        return {
            "actor": self.actor,
            "action": self.action,
            "plan_id": str(self.plan_id),
            "at_s": repr(self.at_s),
            "result": self.result,
            "note": self.note,
            "new_plan_id": str(self.new_plan_id),
            "override": json.dumps(self.override, separators=(",", ":")),
            "comment": self.comment,
            "action_id": self.action_id,
            "recorded_at_s": repr(self.recorded_at_s),
        }

    @classmethod
    def of(cls, action: OperatorAction, recorded_at_s: float) -> AuditRecord:
        """The record of ``action`` as taken ("ok"; a refusal sets ``result`` and ``note``)."""
        return cls(
            action.actor,
            action.action,
            action.plan_id,
            action.at_s,
            "ok",
            override=dict(action.override),
            comment=action.comment,
            action_id=action.action_id,
            recorded_at_s=recorded_at_s,
        )

    @classmethod
    def from_fields(cls, f: dict) -> AuditRecord:
        g = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in f.items()
        }
        return cls(
            actor=g["actor"],
            action=g["action"],
            plan_id=int(g["plan_id"]),
            at_s=float(g["at_s"]),
            result=g["result"],
            note=g.get("note", ""),
            new_plan_id=int(g.get("new_plan_id", 0)),
            override=json.loads(g.get("override", "{}") or "{}"),
            comment=g.get("comment", ""),
            action_id=g.get("action_id", ""),
            recorded_at_s=float(g.get("recorded_at_s", 0.0)),
        )


@dataclass
class Changes:
    plans: list[AdaptationPlan] = field(default_factory=list)
    audit: list[AuditRecord] = field(default_factory=list)

    def extend(self, other: Changes) -> None:
        self.plans.extend(other.plans)
        self.audit.extend(other.audit)


def validate_override_shape(ov: Any) -> dict[str, Any]:
    """Type-check an override payload; raise OverrideError naming the bad field."""
    if not isinstance(ov, dict) or not ov:
        raise OverrideError("override must be a non-empty object")
    unknown = [k for k in ov if k not in OVERRIDE_KEYS]
    if unknown:
        raise OverrideError(f"unknown override field(s) {unknown}; allowed {list(OVERRIDE_KEYS)}")
    for k in ("layers", "keep_ranks", "drop_ranks"):
        if k in ov and (
            not isinstance(ov[k], list)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in ov[k])
        ):
            raise OverrideError(f"override.{k} must be a list of integers")
    if "migration" in ov and not isinstance(ov["migration"], bool):
        raise OverrideError("override.migration must be true or false")
    both = set(ov.get("keep_ranks", [])) & set(ov.get("drop_ranks", []))
    if both:
        raise OverrideError(f"ranks {sorted(both)} are both kept and dropped")
    return ov


def check_override_result(ov: dict[str, Any], after: dict[str, Any]) -> None:
    """The post-condition of every accepted override: its plan does what was asked.

    Kept ranks work in a TP group, dropped ranks are in no group and not on standby, the
    layers are the partition asked for, ``migration: false`` leaves no migration. Raises
    OverrideError naming what the plan would do instead (the override is then refused,
    never accepted with another effect than the one asked for)."""
    active = {int(r) for st in after.get("groups", []) for g in st for r in g}
    missing = sorted(set(ov.get("keep_ranks", [])) - active)
    if missing:
        where = sorted(set(missing) & set(after.get("standby", [])))
        raise OverrideError(
            f"the plan would not keep rank(s) {missing} in a TP group"
            + (f" (it parks {where} on standby)" if where else "")
        )
    still = sorted(set(ov.get("drop_ranks", [])) & (active | set(after.get("standby", []))))
    if still:
        raise OverrideError(f"the plan would not drop rank(s) {still}")
    if "layers" in ov and list(after.get("layers", [])) != list(ov["layers"]):
        raise OverrideError(
            f"the plan's layers {after.get('layers')} are not the partition asked {ov['layers']}"
        )
    if ov.get("migration") is False and after.get("migrations"):
        raise OverrideError(
            f"migration off is infeasible: the plan keeps {len(after['migrations'])} migration(s)"
        )


def _benched_for(ov: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> str:
    """Working ranks an override's ``keep_ranks`` sends to standby ('' when none): a TP
    group holds a power of two, so keeping a spare in a full group benches a healthy rank,
    which the operator who asked to keep one should read in the verdict."""
    keep = set(ov.get("keep_ranks", []))
    if not keep:
        return ""

    def active(lay: dict[str, Any]) -> set[int]:
        return {int(r) for st in lay.get("groups", []) for g in st for r in g}

    gone = active(before) - active(after) - set(ov.get("drop_ranks", []))
    benched = sorted(gone & set(after.get("standby", [])))
    if not benched:
        return ""
    return (
        f"to keep rank(s) {sorted(keep)} working, rank(s) {benched} go to standby "
        "(a TP group holds a power of two devices)"
    )


def _superseded_note(by: str, old: AdaptationPlan) -> str:
    """Why ``old`` was superseded (``by``), with what its note said before."""
    return f"{by} (was: {old.note})" if old.note else by


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _failed_note(action: OperatorAction) -> str:
    why = action.comment.strip() or "no reason given"
    return f"the trainer ({action.actor}) did not apply it: {why}"


class PlanBook:
    """All plans of a job and the rules for changing their state."""

    def __init__(
        self,
        next_id: Callable[[], int],
        clock: Callable[[], float] = time.time,
        running: Callable[[], dict[str, Any] | None] = lambda: None,
    ):
        self.next_id = next_id
        self.clock = clock
        #: the layout the job runs now (``Layout.to_dict()``), None when unknown
        self.running = running
        self.plans: dict[int, AdaptationPlan] = {}

    def load(self, plans: dict[int, AdaptationPlan]) -> None:
        self.plans = dict(plans)

    # ------------------------------------------------------------ helpers
    def _set(
        self, plan: AdaptationPlan, state: str, now: float, out: Changes, note: str = ""
    ) -> None:
        plan.state = state
        plan.updated_at_s = now
        if state == "acknowledged" and not plan.acknowledged_at_s:
            plan.acknowledged_at_s = now
        if note:
            plan.note = note
        out.plans.append(plan)

    def open_plans(self) -> list[AdaptationPlan]:
        """Plans still waiting to be applied (proposed or acknowledged)."""
        return sorted(
            (p for p in self.plans.values() if p.state in ("proposed", "acknowledged")),
            key=lambda p: p.plan_id,
        )

    def _running_id(self) -> int | None:
        run = self.running()
        if not isinstance(run, dict) or "layout_id" not in run:
            return None
        try:
            return int(run["layout_id"])
        except (TypeError, ValueError):
            return None

    def stale(self, plan: AdaptationPlan) -> str:
        """Why ``plan`` was made for a layout the job has left ('' when it was not): its
        ``before`` is not the running layout (nor is its ``after``: a plan being applied)."""
        run = self._running_id()
        if run is None:
            return ""
        ids = (int(plan.before.get("layout_id", -1)), int(plan.after.get("layout_id", -1)))
        if run in ids:
            return ""
        return (
            f"plan {plan.plan_id} was made for layout {ids[0]}; the job runs layout {run} "
            "now (stale)"
        )

    def _layout_id(self, proposed: int) -> int:
        """The layout id a new plan's ``after`` gets: above the running layout's and every
        layout a plan brought or may have brought (applied, or acknowledged: a trainer may
        have taken it up), so ids keep growing however plans interleave."""
        ids = [proposed]
        run = self._running_id()
        if run is not None:
            ids.append(run + 1)
        for p in self.plans.values():
            if p.state != "refused" and (p.state == "applied" or p.acknowledged_at_s):
                ids.append(int(p.after.get("layout_id", 0)) + 1)
        return max(ids)

    def _supersede_open(
        self, new: AdaptationPlan, now: float, out: Changes, by: str = ""
    ) -> list[str]:
        """Every open plan but ``new`` superseded, with a note naming ``new`` (and ``by``,
        how it came); returns the reports they answered (``new`` answers them now)."""
        answered: list[str] = []
        note = f"superseded by plan {new.plan_id}" + (f", {by}" if by else "")
        for old in self.open_plans():
            if old.plan_id == new.plan_id:
                continue
            self._set(old, "superseded", now, out, note=_superseded_note(note, old))
            answered += old.failure_ids
        return answered

    def latest_applied(self) -> AdaptationPlan | None:
        ap = [p for p in self.plans.values() if p.state == "applied"]
        return max(ap, key=lambda p: p.plan_id) if ap else None

    def _new(
        self,
        draft: PlanDraft,
        state: str,
        now: float,
        *,
        mode: str,
        grace_s: float,
        policy: str,
        failure_ids: list[str],
        parent: int = 0,
    ) -> AdaptationPlan:
        after = draft.after
        if state != "refused":
            after = {**after, "layout_id": self._layout_id(int(after.get("layout_id", 0)))}
        plan = AdaptationPlan(
            plan_id=int(self.next_id()),
            state=state,
            created_at_s=now,
            reason=draft.reason,
            before=draft.before,
            after=after,
            predicted_before_s=float(draft.predicted_before_s),
            predicted_after_s=float(draft.predicted_after_s),
            moves=list(draft.moves),
            failure_ids=list(failure_ids),
            parent_plan_id=parent,
            mode=mode,
            policy=policy,
            updated_at_s=now,
            apply_after_s=now + grace_s,
            note=draft.note,
            acknowledged_at_s=now if state == "acknowledged" else 0.0,
            predicted_healthy_s=float(draft.predicted_healthy_s),
        )
        plan.check()
        self.plans[plan.plan_id] = plan
        return plan

    # ------------------------------------------------------------ proposals
    def propose(
        self,
        draft: PlanDraft,
        *,
        mode: str,
        grace_s: float,
        policy: str,
        failure_ids: list[str],
        why: str = "",
    ) -> Changes:
        """A new plan; every older plan not yet applied is superseded by it (their note
        names it, and ``why`` it came when given)."""
        now = self.clock()
        out = Changes()
        plan = self._new(
            draft,
            "proposed",
            now,
            mode=mode,
            grace_s=grace_s,
            policy=policy,
            failure_ids=list(dict.fromkeys(failure_ids)),
        )
        # the new plan is computed from every failure known so far: it answers the
        # reports of the plans it replaces as well as the new one
        answered = self._supersede_open(plan, now, out, why)
        plan.failure_ids = list(dict.fromkeys([*answered, *plan.failure_ids]))
        out.plans.append(plan)
        return out

    def withdraw(self, why: str) -> Changes:
        """Every open plan superseded with ``why``: the current layout already is the
        best answer to what is known now (e.g. the device a plan drops recovered)."""
        now = self.clock()
        out = Changes()
        for old in self.open_plans():
            self._set(old, "superseded", now, out, note=why)
        return out

    def same_as_open(self, draft: PlanDraft) -> AdaptationPlan | None:
        """The open plan that already proposes exactly ``draft``'s layout, if any (its
        layout id aside: a plan's id is set above every layout id already used)."""

        def shape(d: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in d.items() if k != "layout_id"}

        want = shape(draft.after)
        return next((p for p in self.open_plans() if shape(p.after) == want), None)

    def retime(self, *, grace_s: float, old_grace_s: float, restart: bool) -> Changes:
        """The grace period changed (``grace_s``), or auto mode starts again (``restart``):
        re-time every plan still waiting for it. Its grace runs from when it started (the
        plan's creation, or the switch to auto that started it), now ``grace_s`` long;
        ``restart`` starts it afresh now, so no plan proposed long ago is acknowledged the
        moment auto mode is switched on."""
        now = self.clock()
        out = Changes()
        for p in self.open_plans():
            if p.state != "proposed" or p.apply_after_s < 0:  # held: an operator decides
                continue
            start = now if restart else max(p.created_at_s, p.apply_after_s - old_grace_s)
            due = start + grace_s
            if due != p.apply_after_s:
                p.apply_after_s = due
                p.updated_at_s = now
                out.plans.append(p)
        return out

    def tick(self, mode: str) -> Changes:
        """Auto mode: acknowledge proposed plans whose grace period is over (actor ``auto``).

        A proposed plan made for a layout the job has left is superseded instead (in any
        mode): acknowledged, it would replace the running layout with one planned for
        another."""
        out = Changes()
        now = self.clock()
        for p in self.open_plans():
            why = self.stale(p) if p.state == "proposed" else ""
            if why:
                self._set(p, "superseded", now, out, note=f"superseded: {why}")
        if mode != "auto":
            return out
        for p in self.open_plans():
            if p.state == "proposed" and 0 <= p.apply_after_s <= now:
                self._set(p, "acknowledged", now, out)
                out.audit.append(
                    AuditRecord(
                        "auto",
                        "acknowledge",
                        p.plan_id,
                        now,
                        "ok",
                        note="grace period elapsed",
                        recorded_at_s=now,
                    )
                )
        return out

    # ------------------------------------------------------------ actions
    @staticmethod
    def override_draft(
        plan: AdaptationPlan,
        override: Any,
        replan: Callable[[AdaptationPlan, dict[str, Any]], PlanDraft],
    ) -> tuple[PlanDraft, str]:
        """The plan an override of ``plan`` makes and the note on ranks it benches ('' when
        none); OverrideError when the scheduler refuses it.  Shared by :meth:`act` and
        :meth:`preview`, so a preview says what the override itself will do."""
        validate_override_shape(override)
        draft = replan(plan, override)
        check_override_result(override, draft.after)
        benched = _benched_for(override, plan.before, draft.after)
        if benched:
            draft.note = (f"{draft.note}; " if draft.note else "") + benched
        return draft, benched

    def preview(
        self,
        plan_id: int,
        override: Any,
        replan: Callable[[AdaptationPlan, dict[str, Any]], PlanDraft],
    ) -> tuple[PlanDraft | None, str]:
        """What :meth:`act` would do with an override of plan ``plan_id`` now, changing
        nothing: (the plan it would make, its note) or (None, why it would be refused)."""
        plan = self.plans.get(plan_id)
        if plan is None:
            return None, f"unknown plan {plan_id}"
        if "overridden" not in TRANSITIONS[plan.state]:
            return None, f"plan {plan.plan_id} is {plan.state}; cannot override"
        why = self.stale(plan)
        if why:
            return None, f"{why}: it cannot be overridden"
        try:
            draft, _ = self.override_draft(plan, override, replan)
        except OverrideError as e:
            return None, str(e)
        return draft, draft.note

    def act(
        self,
        action: OperatorAction,
        replan: Callable[[AdaptationPlan, dict[str, Any]], PlanDraft],
        *,
        mode: str,
        policy: str,
    ) -> Changes:
        """Apply one operator/trainer action; refusals are audited, never raised."""
        now = self.clock()
        out = Changes()
        rec = AuditRecord.of(action, now)
        out.audit.append(rec)

        def refuse(reason: str) -> Changes:
            rec.result = "refused"
            rec.note = reason
            return out

        if action.override and action.action in ("acknowledge", "reject"):
            # audited beside "ok", it read as an override the scheduler had taken
            return refuse(
                f"{action.action} takes no override (an override is a plan of its own: "
                "action override)"
            )
        plan = self.plans.get(action.plan_id)
        if plan is None:
            return refuse(f"unknown plan {action.plan_id}")
        if action.action == "hold":
            if plan.state != "proposed":
                return refuse(f"plan {plan.plan_id} is {plan.state}; only a proposed plan is held")
            if plan.apply_after_s < 0:
                rec.note = f"plan {plan.plan_id} was already held"
                return out
            plan.apply_after_s = AdaptationPlan.HELD
            plan.updated_at_s = now
            out.plans.append(plan)
            rec.note = f"auto-apply of plan {plan.plan_id} held: it waits for an operator"
            return out
        target = {
            "acknowledge": "acknowledged",
            "reject": "rejected",
            "applied": "applied",
            "override": "overridden",
            "failed": "failed",
        }.get(action.action)
        if target is None:
            return refuse(f"action {action.action!r} does not change a plan")
        if action.action in ("applied", "failed") and plan.state == "proposed":
            return refuse(f"plan {plan.plan_id} was never acknowledged")
        if action.action == "failed" and plan.state != "acknowledged":
            if not plan.acknowledged_at_s:
                return refuse(f"plan {plan.plan_id} was never acknowledged")
            # closed since the trainer took it up: nothing waits on it any more
            rec.note = f"plan {plan.plan_id} was already {plan.state} when the trainer gave it up"
            return out
        if action.action == "failed":
            self._set(plan, "failed", now, out, note=_failed_note(action))
            return out
        if action.action == "applied" and plan.state in LATE_APPLY:
            if not plan.acknowledged_at_s:
                return refuse(f"plan {plan.plan_id} was never acknowledged")
            rec.note = (
                f"the trainer had already taken plan {plan.plan_id} up when it was "
                f"{plan.state}: the job runs it now"
            )
        elif target not in TRANSITIONS[plan.state]:
            why = f"plan {plan.plan_id} is {plan.state}; cannot {action.action}"
            now_open = [p for p in self.open_plans() if p.plan_id != plan.plan_id]
            if now_open and action.action in ("acknowledge", "reject", "override"):
                # plans churn while a failure develops: the id an operator read a few
                # seconds ago is stale; say which one to act on instead
                latest = now_open[-1]
                why += f" (plan {latest.plan_id}, {latest.state}, is the one open now)"
            return refuse(why)
        if action.action in ("acknowledge", "override"):
            why = self.stale(plan)
            if why:
                return refuse(f"{why}: it cannot be {target}")
        if action.action == "override":
            try:
                draft, benched = self.override_draft(plan, action.override, replan)
            except OverrideError as e:
                reason = str(e)
                refused = self._new(
                    PlanDraft(
                        plan.before,
                        plan.before,
                        plan.predicted_before_s,
                        plan.predicted_before_s,
                        [{"what": "override_request", **action.override}]
                        if isinstance(action.override, dict)
                        else [],
                        reason=f"override of plan {plan.plan_id} by {action.actor}",
                        note=reason,
                    ),
                    "refused",
                    now,
                    mode=mode,
                    grace_s=0.0,
                    policy=policy,
                    failure_ids=plan.failure_ids,
                    parent=plan.plan_id,
                )
                out.plans.append(refused)
                rec.new_plan_id = refused.plan_id
                return refuse(reason)
            if benched:
                rec.note = benched
            draft.reason = draft.reason or f"override of plan {plan.plan_id} by {action.actor}"
            new = self._new(
                draft,
                "acknowledged",
                now,
                mode=mode,
                grace_s=0.0,
                policy=policy,
                failure_ids=plan.failure_ids,
                parent=plan.plan_id,
            )
            self._set(
                plan,
                "overridden",
                now,
                out,
                note=f"overridden by {action.actor} (plan {new.plan_id})",
            )
            # the operator's plan is now the one the job is to run: no other open plan may
            # be acknowledged and applied over it later; it answers their reports too
            answered = self._supersede_open(
                new, now, out, f"the override of plan {plan.plan_id} by {action.actor}"
            )
            new.failure_ids = list(dict.fromkeys([*plan.failure_ids, *answered]))
            out.plans.append(new)
            rec.new_plan_id = new.plan_id
            return out
        if action.action == "reject" and plan.state == "acknowledged":
            rec.note = (
                f"plan {plan.plan_id} was acknowledged at {_hms(plan.acknowledged_at_s)}: a "
                "trainer that already took it up still applies it (recorded applied then)"
            )
        if action.action == "acknowledge":
            # the acknowledged plan is the one to run: none other stays open beside it
            answered = self._supersede_open(plan, now, out, f"acknowledged by {action.actor}")
            plan.failure_ids = list(dict.fromkeys([*plan.failure_ids, *answered]))
        if action.action == "applied":
            for old in self.plans.values():
                if old.state == "applied" and old.plan_id != plan.plan_id:
                    self._set(
                        old,
                        "superseded",
                        now,
                        out,
                        note=f"superseded by applied plan {plan.plan_id}",
                    )
        self._set(plan, target, now, out)
        return out

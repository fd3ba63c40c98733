"""Plan lifecycle: monotonic ids, state machine, operator actions, audit records.

States::

    proposed --acknowledge--> acknowledged --applied (trainer)--> applied --(next applied)--> superseded
        |---reject---> rejected
        |---override--> overridden   (+ a new plan, parent_plan_id = old, state acknowledged)
        |---override infeasible --> a new "refused" record carrying the reason in ``note``
    proposed/acknowledged --(a newer plan is proposed)--> superseded

``applied`` is a fact, not a request: the trainer picks a plan up while it is
acknowledged and may finish applying it after an operator rejected it, an override
replaced it or a newer plan superseded it.  Its confirmation is then accepted from
those states too (the audit note says what happened), because the job now runs that
layout; only a plan that was never acknowledged cannot have been applied.

In ``auto`` mode a proposed plan is acknowledged by actor ``"auto"`` once its
grace period (``apply_after_s``) has passed; in ``manual`` mode it waits for an
operator.  Every operator action, accepted or refused, yields an
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
    "acknowledged": {"applied", "overridden", "rejected", "superseded"},
    "overridden": {"applied"},
    # an operator who rejected a plan may still put their own in its place (the way on
    # for a job that waits on a fail-stop whose plan was rejected)
    "rejected": {"applied", "overridden"},
    "applied": {"superseded"},
    "superseded": {"applied"},
    "refused": set(),
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


class PlanBook:
    """All plans of a job and the rules for changing their state."""

    def __init__(self, next_id: Callable[[], int], clock: Callable[[], float] = time.time):
        self.next_id = next_id
        self.clock = clock
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
        plan = AdaptationPlan(
            plan_id=int(self.next_id()),
            state=state,
            created_at_s=now,
            reason=draft.reason,
            before=draft.before,
            after=draft.after,
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
        )
        plan.check()
        self.plans[plan.plan_id] = plan
        return plan

    # ------------------------------------------------------------ proposals
    def propose(
        self, draft: PlanDraft, *, mode: str, grace_s: float, policy: str, failure_ids: list[str]
    ) -> Changes:
        """A new plan; every older plan not yet applied is superseded by it."""
        now = self.clock()
        out = Changes()
        answered: list[str] = []
        for old in self.open_plans():
            self._set(old, "superseded", now, out, note=old.note or "superseded by a newer plan")
            answered += old.failure_ids
        # the new plan is computed from every failure known so far: it answers the
        # reports of the plans it replaces as well as the new one
        ids = list(dict.fromkeys([*answered, *failure_ids]))
        plan = self._new(
            draft,
            "proposed",
            now,
            mode=mode,
            grace_s=grace_s,
            policy=policy,
            failure_ids=ids,
        )
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
        """The open plan that already proposes exactly ``draft``'s layout, if any."""
        return next((p for p in self.open_plans() if p.after == draft.after), None)

    def tick(self, mode: str) -> Changes:
        """Auto mode: acknowledge proposed plans whose grace period is over (actor ``auto``)."""
        out = Changes()
        if mode != "auto":
            return out
        now = self.clock()
        for p in self.open_plans():
            if p.state == "proposed" and now >= p.apply_after_s:
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
        rec = AuditRecord(
            action.actor,
            action.action,
            action.plan_id,
            action.at_s,
            "ok",
            override=dict(action.override),
            comment=action.comment,
            action_id=action.action_id,
            recorded_at_s=now,
        )
        out.audit.append(rec)

        def refuse(reason: str) -> Changes:
            rec.result = "refused"
            rec.note = reason
            return out

        plan = self.plans.get(action.plan_id)
        if plan is None:
            return refuse(f"unknown plan {action.plan_id}")
        target = {
            "acknowledge": "acknowledged",
            "reject": "rejected",
            "applied": "applied",
            "override": "overridden",
        }.get(action.action)
        if target is None:
            return refuse(f"action {action.action!r} does not change a plan")
        if action.action == "applied" and plan.state == "proposed":
            return refuse(f"plan {plan.plan_id} was never acknowledged")
        if action.action == "applied" and plan.state in LATE_APPLY:
            if not plan.acknowledged_at_s:
                return refuse(f"plan {plan.plan_id} was never acknowledged")
            rec.note = (
                f"the trainer had already taken plan {plan.plan_id} up when it was "
                f"{plan.state}: the job runs it now"
            )
        elif target not in TRANSITIONS[plan.state]:
            return refuse(f"plan {plan.plan_id} is {plan.state}; cannot {action.action}")
        if action.action == "override":
            try:
                validate_override_shape(action.override)
                draft = replan(plan, action.override)
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
            self._set(plan, "overridden", now, out, note=f"overridden by {action.actor}")
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
            out.plans.append(new)
            rec.new_plan_id = new.plan_id
            return out
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

"""Reading plans and layouts from Redis: the trainer-side half of the plan protocol.

The scheduler owns plan state (``keys.plans`` snapshots, ``keys.plan_state``
hash).  A trainer (simulator or torch) asks :class:`PlanFollower` for plans
that became ``acknowledged`` and that it has not applied yet, applies them at
an iteration boundary, then calls :meth:`PlanFollower.confirm_applied`, which
writes the new layout and publishes ``OperatorAction(action="applied")`` for
the scheduler to mark the plan applied.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from resihp.bus import publish, register_job, set_job_state
from resihp.keys import JobKeys
from resihp.schemas import AdaptationPlan, OperatorAction, SchemaError, decode_json
from resihp.topology import Layout


def read_layout(client: redis.Redis, keys: JobKeys) -> Layout | None:
    raw = client.get(keys.layout)
    if not raw:
        return None
    return Layout.from_json(raw)


def write_layout(client: redis.Redis, keys: JobKeys, layout: Layout) -> None:
    """The current layout, and its entry in the layout history (``keys.layouts``)."""
    layout.validate()
    raw = json.dumps(layout.to_dict(), separators=(",", ":"))
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.layout, raw)
    pipe.xadd(keys.layouts, {"layout": raw}, maxlen=10_000, approximate=True)
    pipe.execute()


def register_running(client: redis.Redis, keys: JobKeys, layout: Layout) -> None:
    """A trainer's registration: the job listed, its state ``running``, its layout. The
    layout goes last: trainers take its presence for "registered" and write all three
    again when it is gone (Redis restarted without its data), so a registration cut short
    by an outage is redone, not left without its state."""
    register_job(client, keys)
    set_job_state(client, keys, "running")
    write_layout(client, keys, layout)


def layout_history(client: redis.Redis, keys: JobKeys) -> list[tuple[float, dict]]:
    """(time it was written in seconds, layout) for every layout the trainer wrote, oldest
    first (``keys.layouts``); empty for a job whose trainer predates that stream."""
    out: list[tuple[float, dict]] = []
    for entry_id, fields in client.xrange(keys.layouts):
        raw = fields.get(b"layout", fields.get("layout"))
        try:
            layout = json.loads(raw)
        except (TypeError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        if not out or out[-1][1] != layout:
            out.append((int(eid.split("-", 1)[0]) / 1000.0, layout))
    if out:
        out[0] = (0.0, out[0][1])  # the first one also labels anything older
    return out


def first_layout(client: redis.Redis, keys: JobKeys) -> dict | None:
    """The first layout the trainer wrote for this run (before any failure), or None when
    the history is empty or its first entry is unreadable."""
    entries = client.xrange(keys.layouts, count=1)
    if not entries:
        return None
    raw = entries[0][1].get(b"layout", entries[0][1].get("layout"))
    try:
        layout = json.loads(raw)
    except (TypeError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return layout if isinstance(layout, dict) else None


def latest_plans(client: redis.Redis, keys: JobKeys) -> dict[int, AdaptationPlan]:
    """plan_id -> latest snapshot, from the scheduler's persistent hash."""
    out: dict[int, AdaptationPlan] = {}
    for pid, raw in client.hgetall(keys.plan_state).items():
        try:
            plan = decode_json(raw)
        except SchemaError:
            continue
        if isinstance(plan, AdaptationPlan):
            out[int(pid)] = plan
    return out


@dataclass
class PlanFollower:
    """Finds acknowledged plans to apply; confirms them once applied."""

    client: redis.Redis
    keys: JobKeys
    actor: str = "trainer"
    applied: set[int] = field(default_factory=set)

    def poll(self) -> list[AdaptationPlan]:
        """Acknowledged plans not yet applied by anyone, oldest first.

        Only the newest acknowledged plan matters when several queued up: older
        ones are superseded by it, so it alone is returned.
        """
        plans = latest_plans(self.client, self.keys)
        ready = [
            p for pid, p in plans.items() if p.state == "acknowledged" and pid not in self.applied
        ]
        ready.sort(key=lambda p: p.plan_id)
        return ready[-1:]

    def confirm_applied(self, plan: AdaptationPlan, layout: Layout, comment: str = "") -> None:
        self.applied.add(plan.plan_id)
        write_layout(self.client, self.keys, layout)
        publish(
            self.client,
            self.keys.actions,
            OperatorAction(
                action="applied",
                plan_id=plan.plan_id,
                actor=self.actor,
                at_s=time.time(),
                comment=comment,
            ),
        )

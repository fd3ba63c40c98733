"""Reading plans and layouts from Redis: the trainer-side half of the plan protocol.

The scheduler owns plan state (``keys.plans`` snapshots, ``keys.plan_state``
hash).  A trainer (simulator or torch) asks :class:`PlanFollower` for plans
that became ``acknowledged`` and that it has not applied yet, applies them at
an iteration boundary, then calls :meth:`PlanFollower.confirm_applied`, which
writes the new layout and publishes ``OperatorAction(action="applied")`` for
the scheduler to mark the plan applied.  A plan it will not run is answered with
:meth:`PlanFollower.report_not_applied` (``action="failed"``, the reason in the comment).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

import redis

from resihp.acl import publish_action
from resihp.bus import (
    JOB_HEARTBEAT_INTERVAL_S,
    JOB_REPORTS_TP0_ONLY,
    register_job,
    set_job_state,
)
from resihp.keys import JobKeys
from resihp.schemas import AdaptationPlan, OperatorAction, SchemaError
from resihp.topology import Layout
from resihp.wire import decode_json


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


def register_running(
    client: redis.Redis,
    keys: JobKeys,
    layout: Layout,
    trainer: str | None = None,
    heartbeat_interval_s: float | None = None,
    reports_tp0_only: bool = False,
) -> None:
    """A trainer's registration: the job listed, its state ``running``, its layout. The
    layout goes last: trainers take its presence for "registered" and write all three
    again when it is gone (Redis restarted without its data), so a registration cut short
    by an outage is redone, not left without its state.  ``heartbeat_interval_s``: the
    period its ranks beat at, which the collector's fail-stop deadline then follows
    (:data:`resihp.bus.JOB_HEARTBEAT_INTERVAL_S`).  ``reports_tp0_only``: only TP rank
    0 of each group sends chunk rows, which the collector's assembler then expects alone
    (:data:`resihp.bus.JOB_REPORTS_TP0_ONLY`); always written, so a registration never
    inherits another trainer's."""
    register_job(client, keys)
    extra: dict = {"trainer": trainer} if trainer else {}
    if heartbeat_interval_s is not None:
        extra[JOB_HEARTBEAT_INTERVAL_S] = float(heartbeat_interval_s)
    extra[JOB_REPORTS_TP0_ONLY] = bool(reports_tp0_only)
    set_job_state(client, keys, "running", **extra)
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
    """plan_id -> latest snapshot, from the scheduler's persistent hash: every snapshot read
    and decoded (one-shot readers and tests; a reader that asks again and again keeps a
    :class:`PlanStateReader`, which pays only for what changed)."""
    out: dict[int, AdaptationPlan] = {}
    for pid, raw in client.hgetall(keys.plan_state).items():
        pid = _plan_id(pid)
        if pid is None:
            continue
        try:
            plan = decode_json(raw)
        except SchemaError:
            continue
        if isinstance(plan, AdaptationPlan):
            out[pid] = plan
    return out


#: The head of a snapshot as ``AdaptationPlan.to_json`` writes it: its id and state
#: readable without parsing the rest (a 256-GPU plan is ~12 KB of layouts).
_HEAD = re.compile(rb'\A\s*\{\s*"plan_id"\s*:\s*(\d+)\s*,\s*"state"\s*:\s*"([a-z_]+)"')
#: A plan id key in a plans-stream entry.  Inside a JSON string the quotes are escaped,
#: so this matches keys only: one per plan object (``parent_plan_id`` does not match).
_ID_KEY = re.compile(rb'"plan_id"\s*:\s*(\d+)')


def _plan_id(field: bytes | str) -> int | None:
    try:
        return int(field)
    except (TypeError, ValueError):
        return None


def _after(entry_id: bytes | None) -> str:
    """The smallest stream entry id after ``entry_id`` ("-": from the start)."""
    if entry_id is None:
        return "-"
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def peek_state(raw: bytes) -> tuple[int, str] | None:
    """(plan id, state) read from the head of a snapshot, without decoding it; None when
    it does not start the way ``AdaptationPlan.to_json`` writes it (decode it then)."""
    m = _HEAD.match(raw)
    return (int(m.group(1)), m.group(2).decode()) if m else None


@dataclass
class PlanReadStats:
    """What a :class:`PlanStateReader` has cost so far (tests and benches read it)."""

    refreshes: int = 0
    #: full reads of the hash: the first one, and each time the reader could not be sure
    #: it saw every change since the last (stream trimmed past it, Redis lost its data,
    #: the job's data deleted)
    full_loads: int = 0
    #: ``keys.plans`` entries read while tailing
    entries: int = 0
    #: snapshot bytes received (hash values and stream payloads)
    bytes: int = 0
    #: snapshots decoded (schema-checked)
    decodes: int = 0


class PlanStateReader:
    """An incremental mirror of one job's ``keys.plan_state``: reads cost what changed,
    not the job's plan history.

    The first :meth:`refresh` reads the hash once (snapshots kept raw, nothing decoded)
    and notes the newest entry of ``keys.plans``.  The scheduler writes every snapshot to
    both in one transaction, so later refreshes read only the stream entries after that
    one: one round trip (the job's ``keys.epoch`` value, the hash's and the stream's
    lengths, the new entries), which carries no snapshot when nothing changed.  It reads
    the whole hash again (still decoding only snapshots whose bytes changed) when it
    cannot be sure it saw every change: the job's data was deleted (``resihp up
    --fresh``), or entries left the stream's head (its cap, Redis restarted without its
    data) and the one it read last is among them.  A hash whose length differs from the
    mirror's (plans the scheduler's retention deleted, or one written to the hash alone)
    is reconciled by its field names (HKEYS) and the new fields only (HMGET).  Writers
    that change a snapshot in the hash alone, without its stream entry, go unseen until
    the next full read.

    Snapshots are decoded on demand, once per distinct value: :meth:`plans` decodes
    what changed since it was last called; :meth:`states` and :meth:`ids_in` read the
    state from each snapshot's head (:func:`peek_state`). Not thread-safe.
    """

    def __init__(self, client: redis.Redis, keys: JobKeys):
        self.client = client
        self.keys = keys
        self.stats = PlanReadStats()
        self._raw: dict[int, bytes] = {}
        #: plan id -> its state as the snapshot's head says (None: the head does not say)
        self._state: dict[int, str | None] = {}
        #: plan id -> (raw it was decoded from, plan or None when it does not decode)
        self._decoded: dict[int, tuple[bytes, AdaptationPlan | None]] = {}
        self._last_id: bytes | None = None
        #: the stream's length after the entries read so far
        self._xlen = 0
        self._epoch: bytes | None = None
        self._loaded = False

    # ------------------------------------------------------------ reading Redis
    def refresh(self) -> bool:
        """Catch up with Redis; True when a snapshot changed, appeared or went."""
        self.stats.refreshes += 1
        if not self._loaded:
            return self._full_load()
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.keys.epoch)
        pipe.hlen(self.keys.plan_state)
        pipe.xlen(self.keys.plans)
        pipe.xrange(self.keys.plans, min=_after(self._last_id), max="+")
        epoch, hlen, xlen, entries = pipe.execute()
        if epoch != self._epoch:
            return self._full_load()
        if xlen < self._xlen + len(entries) and self._last_id is not None:
            # entries left the stream's head since the last read (its cap, or Redis lost
            # data): only if the one read last is still there did none go unseen
            if not self.client.xrange(self.keys.plans, min=self._last_id, max=self._last_id):
                return self._full_load()
        self._xlen = xlen
        changed = False
        refetch: set[int] = set()
        for eid, fields in entries:
            self._last_id = eid
            self.stats.entries += 1
            payload = fields.get(b"m", fields.get("m")) or b""
            self.stats.bytes += len(payload)
            ids = _ID_KEY.findall(payload)
            if len(ids) == 1 and payload.startswith(b"[") and payload.endswith(b"]"):
                # one snapshot per entry, as the scheduler writes it: its bytes are the
                # hash value's
                changed |= self._put(int(ids[0]), payload[1:-1])
            else:
                refetch.update(int(x) for x in ids)
        if refetch:
            changed |= self._fetch(sorted(refetch))
        if hlen != len(self._raw):
            changed |= self._reconcile()
        return changed

    def _full_load(self) -> bool:
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.keys.epoch)
        pipe.hgetall(self.keys.plan_state)
        pipe.xrevrange(self.keys.plans, count=1)
        pipe.xlen(self.keys.plans)
        epoch, everything, newest, xlen = pipe.execute()
        self.stats.full_loads += 1
        self._epoch = epoch
        self._xlen = xlen
        self._last_id = newest[0][0] if newest else None
        self._loaded = True
        seen: set[int] = set()
        changed = False
        for field_, raw in everything.items():
            pid = _plan_id(field_)
            if pid is None:
                continue
            seen.add(pid)
            self.stats.bytes += len(raw)
            changed |= self._put(pid, raw)
        for pid in [p for p in self._raw if p not in seen]:
            self._drop(pid)
            changed = True
        return changed

    def _fetch(self, pids: list[int]) -> bool:
        """Read ``pids`` from the hash (gone ones are dropped)."""
        changed = False
        for pid, raw in zip(
            pids, self.client.hmget(self.keys.plan_state, [str(p) for p in pids]), strict=True
        ):
            if raw is None:
                if pid in self._raw:
                    self._drop(pid)
                    changed = True
            else:
                self.stats.bytes += len(raw)
                changed |= self._put(pid, raw)
        return changed

    def _reconcile(self) -> bool:
        """Match the hash's fields: drop the plans it no longer has, read the new ones."""
        names = {p for p in map(_plan_id, self.client.hkeys(self.keys.plan_state)) if p is not None}
        changed = False
        for pid in [p for p in self._raw if p not in names]:
            self._drop(pid)
            changed = True
        new = sorted(names - self._raw.keys())
        if new:
            changed |= self._fetch(new)
        return changed

    def _put(self, pid: int, raw: bytes) -> bool:
        raw = bytes(raw)
        if self._raw.get(pid) == raw:
            return False
        self._raw[pid] = raw
        head = peek_state(raw)
        self._state[pid] = head[1] if head is not None and head[0] == pid else None
        return True

    def _drop(self, pid: int) -> None:
        self._raw.pop(pid, None)
        self._state.pop(pid, None)
        self._decoded.pop(pid, None)

    # ------------------------------------------------------------ views
    def get(self, pid: int) -> AdaptationPlan | None:
        """Plan ``pid`` decoded (once per distinct snapshot); None when unknown or it
        does not decode."""
        raw = self._raw.get(pid)
        if raw is None:
            return None
        hit = self._decoded.get(pid)
        if hit is not None and hit[0] is raw:
            return hit[1]
        self.stats.decodes += 1
        try:
            plan = decode_json(raw)
        except SchemaError:
            plan = None
        if not isinstance(plan, AdaptationPlan):
            plan = None
        self._decoded[pid] = (raw, plan)
        return plan

    def state(self, pid: int) -> str | None:
        """Plan ``pid``'s state from its snapshot's head (decoded when the head does not
        say); None when unknown or it does not decode."""
        st = self._state.get(pid)
        if st is not None:
            return st
        plan = self.get(pid)
        return plan.state if plan is not None else None

    def ids(self) -> list[int]:
        return sorted(self._raw)

    def states(self) -> dict[int, str]:
        """plan id -> state, every plan that has one."""
        out = {}
        for pid in self._raw:
            st = self.state(pid)
            if st is not None:
                out[pid] = st
        return out

    def ids_in(self, *states: str) -> list[int]:
        """Plans in one of ``states`` (by their snapshot heads), oldest first."""
        want = set(states)
        return sorted(
            pid
            for pid, st in self._state.items()
            if (st if st is not None else self.state(pid)) in want
        )

    def plans(self) -> dict[int, AdaptationPlan]:
        """plan id -> snapshot, every one that decodes (a new dict; the plans are shared
        with the next calls: read them, do not change them)."""
        out = {}
        for pid in self._raw:
            plan = self.get(pid)
            if plan is not None:
                out[pid] = plan
        return out


@dataclass
class PlanFollower:
    """Finds acknowledged plans to apply; confirms them once applied."""

    client: redis.Redis
    keys: JobKeys
    actor: str = "trainer"
    applied: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.reader = PlanStateReader(self.client, self.keys)

    def poll(self) -> list[AdaptationPlan]:
        """Acknowledged plans not yet applied by anyone, oldest first.

        Only the newest acknowledged plan matters when several queued up: older
        ones are superseded by it, so it alone is returned.  Costs what changed since
        the last poll (:class:`PlanStateReader`), not the job's plan history.
        """
        self.reader.refresh()
        ready = []
        for pid in self.reader.ids_in("acknowledged"):
            if pid in self.applied:
                continue
            plan = self.reader.get(pid)
            if plan is not None and plan.state == "acknowledged":
                ready.append(plan)
        ready.sort(key=lambda p: p.plan_id)
        return ready[-1:]

    def report_not_applied(self, plan: AdaptationPlan, reason: str) -> None:
        """Tell the scheduler this trainer will not run ``plan`` (``failed``, the reason in
        the comment): without it the plan waits as acknowledged until a newer one comes, and
        the job looks as if it waited for the trainer.  Never retried here."""
        self._answer(plan, "failed", reason[:500])

    def confirm_applied(self, plan: AdaptationPlan, layout: Layout, comment: str = "") -> None:
        self.applied.add(plan.plan_id)
        write_layout(self.client, self.keys, layout)
        self._answer(plan, "applied", comment)

    def _answer(self, plan: AdaptationPlan, action: str, comment: str) -> None:
        """The trainer's word on ``plan`` (``applied`` / ``failed``); it is not offered again."""
        self.applied.add(plan.plan_id)
        publish_action(  # sealed where the trainer is a Redis ACL user of its own
            self.client,
            self.keys,
            OperatorAction(
                action=action,
                plan_id=plan.plan_id,
                actor=self.actor,
                at_s=time.time(),
                comment=comment,
            ),
        )

"""Plan reads against a real Redis cost what changed, not the job's plan history.

The trainer polls for acknowledged plans at every iteration boundary and the dashboard
reads every plan on each refresh; both used to read and decode every snapshot the job
ever had (~1.2 ms each on a 256-GPU job: a 2,000-plan history silenced the trainer past
the fail-stop deadline).  Costs are asserted in snapshots decoded and bytes Redis sent,
never in wall time.
"""

from __future__ import annotations

import time

import pytest

import dashboard.data
import resihp.plans
from dashboard.data import DashboardData
from resihp import bus
from resihp.keys import JobKeys
from resihp.plans import PlanFollower, PlanStateReader
from resihp.schemas import AdaptationPlan
from resihp.topology import Layout
from resihp.wire import decode_json as _decode_json

pytestmark = pytest.mark.redis

JOB = "reads"
LAYOUT = Layout.uniform(tp=4, pp=4, dp=4, num_layers=40, num_microbatches=8)


def _plan(pid: int, state: str) -> AdaptationPlan:
    after = LAYOUT.copy()
    after.layout_id = pid
    return AdaptationPlan(
        plan_id=pid,
        state=state,
        created_at_s=time.time(),
        reason=f"test plan {pid}",
        before=LAYOUT.to_dict(),
        after=after.to_dict(),
        predicted_before_s=1.0,
        predicted_after_s=0.9,
        note="superseded by plan 2, acknowledged by bob" if state == "superseded" else "",
    )


def _write(r, keys: JobKeys, *plans: AdaptationPlan) -> None:
    """As the scheduler persists snapshots: the hash and the stream in one transaction."""
    pipe = r.pipeline(transaction=True)
    for p in plans:
        js = p.to_json()
        pipe.hset(keys.plan_state, str(p.plan_id), js)
        pipe.xadd(keys.plans, {b"m": ("[" + js + "]").encode()}, maxlen=100_000, approximate=True)
    pipe.execute()


def _seed(r, keys: JobKeys, n: int, state: str = "superseded", start: int = 1) -> None:
    for a in range(start, start + n, 500):
        _write(r, keys, *(_plan(i, state) for i in range(a, min(start + n, a + 500))))


@pytest.fixture
def decodes(monkeypatch):
    """How many snapshots were decoded, wherever plan readers decode them."""
    calls = []

    def counting(raw, *a, **kw):
        calls.append(1)
        return _decode_json(raw, *a, **kw)

    monkeypatch.setattr(resihp.plans, "decode_json", counting)
    monkeypatch.setattr(dashboard.data, "decode_json", counting, raising=False)
    return calls


def _sent(r) -> int:
    """Bytes Redis has sent to its clients (this INFO reply included)."""
    return int(r.info("stats")["total_net_output_bytes"])


def _cost(r, decodes, fn):
    d0, b0 = len(decodes), _sent(r)
    out = fn()
    return out, len(decodes) - d0, _sent(r) - b0


def test_a_poll_reads_and_decodes_only_what_changed(r, decodes):
    keys = JobKeys(JOB)
    _seed(r, keys, 3000)
    size = len(_plan(3001, "acknowledged").to_json())
    fol = PlanFollower(r, keys)
    ready, n, _ = _cost(r, decodes, fol.poll)
    # the first poll reads the hash once, and decodes no finished plan
    assert ready == [] and n == 0
    # nothing changed: nothing read but the round trip, nothing decoded
    ready, n, sent = _cost(r, decodes, fol.poll)
    assert ready == [] and n == 0 and sent < size
    # one plan acknowledged: that snapshot (and the entry read last, once) and no other
    _write(r, keys, _plan(3001, "acknowledged"))
    ready, n, sent = _cost(r, decodes, fol.poll)
    assert [p.plan_id for p in ready] == [3001] and n == 1
    assert sent < 4 * size + 10_000, sent  # 3,000 snapshots would be ~3000 * size
    # applied, and a new one proposed: read, not decoded (the state is in the head)
    _write(r, keys, _plan(3001, "applied"), _plan(3002, "proposed"))
    ready, n, sent = _cost(r, decodes, fol.poll)
    assert ready == [] and n == 0 and sent < 5 * size + 10_000
    assert fol.reader.stats.full_loads == 1


def test_a_plan_written_to_the_hash_alone_is_seen_and_trimmed_plans_go(r, decodes):
    """Tests and tools write a snapshot to the hash alone; the scheduler's retention
    deletes old finished ones from it: the hash's length tells, its field names say which."""
    keys = JobKeys(JOB)
    _seed(r, keys, 40)
    fol = PlanFollower(r, keys)
    assert fol.poll() == []
    r.hset(keys.plan_state, "41", _plan(41, "acknowledged").to_json())
    ready, n, _ = _cost(r, decodes, fol.poll)
    assert [p.plan_id for p in ready] == [41] and n == 1
    r.hdel(keys.plan_state, *[str(i) for i in range(1, 31)])
    _write(r, keys, _plan(42, "proposed"))
    fol.poll()
    assert fol.reader.ids() == [*range(31, 43)]
    assert fol.reader.stats.full_loads == 1
    _, n, _ = _cost(r, decodes, fol.poll)
    assert n == 0


def test_the_follower_sees_a_plan_acknowledged_after_redis_lost_its_data(r, decodes):
    keys = JobKeys(JOB)
    _seed(r, keys, 30)
    _write(r, keys, _plan(31, "applied"))
    fol = PlanFollower(r, keys)
    assert fol.poll() == []
    r.flushall()  # restarted without its data; a scheduler issues plan ids from 1 again
    _seed(r, keys, 20)
    _write(r, keys, _plan(21, "acknowledged"))
    ready, n, _ = _cost(r, decodes, fol.poll)
    assert [p.plan_id for p in ready] == [21] and n == 1
    assert sorted(fol.reader.ids()) == [*range(1, 22)]  # the lost plans are gone
    assert fol.reader.stats.full_loads == 2
    # and it is incremental again
    _, n, _ = _cost(r, decodes, fol.poll)
    assert n == 0


def test_the_follower_sees_a_change_whose_stream_entry_was_trimmed(r, decodes):
    """The plans stream is capped: a change trimmed away before the reader saw its entry
    is found by reading the hash again, once."""
    keys = JobKeys(JOB)
    _seed(r, keys, 30)
    _write(r, keys, _plan(31, "proposed"), _plan(32, "proposed"))
    fol = PlanFollower(r, keys)
    assert fol.poll() == []
    _write(r, keys, _plan(31, "acknowledged"))
    _write(r, keys, _plan(32, "superseded"))
    r.xtrim(keys.plans, maxlen=1, approximate=False)  # the entry of plan 31's change is gone
    ready, n, _ = _cost(r, decodes, fol.poll)
    assert [p.plan_id for p in ready] == [31] and n == 1
    assert fol.reader.stats.full_loads == 2
    assert fol.reader.state(32) == "superseded"
    _, n, _ = _cost(r, decodes, fol.poll)
    assert n == 0


def test_a_fresh_run_behind_the_same_job_id_is_read_afresh(r):
    keys = JobKeys(JOB)
    _seed(r, keys, 10)
    _write(r, keys, _plan(11, "acknowledged"))
    reader = PlanStateReader(r, keys)
    reader.refresh()
    assert reader.state(11) == "acknowledged"
    bus.clear_job(r, keys)  # resihp up --fresh
    _write(r, keys, _plan(1, "proposed"))
    assert reader.refresh()
    assert reader.states() == {1: "proposed"}


def test_dashboard_plans_follow_state_changes_decoding_only_those(r, decodes):
    keys = JobKeys(JOB)
    _seed(r, keys, 500)
    _write(r, keys, _plan(501, "proposed"))
    d = DashboardData(r)
    plans = d.plans(JOB)
    assert len(plans) == 501 and plans[501].state == "proposed"
    size = len(_plan(501, "acknowledged").to_json())
    # a refresh with nothing new decodes nothing, reads next to nothing
    plans, n, sent = _cost(r, decodes, lambda: d.plans(JOB))
    assert len(plans) == 501 and n == 0 and sent < size
    _write(r, keys, _plan(501, "acknowledged"))
    plans, n, sent = _cost(r, decodes, lambda: d.plans(JOB))
    assert plans[501].state == "acknowledged" and n == 1
    assert sent < 4 * size + 10_000
    _write(r, keys, _plan(501, "applied"), _plan(502, "proposed"))
    plans, n, _ = _cost(r, decodes, lambda: d.plans(JOB))
    assert (plans[501].state, plans[502].state) == ("applied", "proposed") and n == 2
    # a fresh run behind the same id: the old run's plans are not shown
    bus.clear_job(r, keys)
    _write(r, keys, _plan(1, "proposed"))
    assert {p: x.state for p, x in d.plans(JOB).items()} == {1: "proposed"}

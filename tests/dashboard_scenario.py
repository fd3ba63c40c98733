"""Test data for the dashboard tests: a small job whose rank 5 turns fail-slow.

It publishes real schema messages into a real Redis the way the collector,
detector and scheduler do (IterationRecord with columnar chunk timings from a
1F1B list schedule, FailureReport with evidence, device health, node
heartbeats, AdaptationPlan snapshots), so the dashboard can be tested before
those services are running.  Times are wall-clock seconds ending "now".
"""

from __future__ import annotations

import json
import time

from resihp import bus
from resihp.keys import JobKeys
from resihp.schemas import AdaptationPlan, FailureReport, IterationRecord, OperatorAction
from resihp.topology import Layout
from resihp.wire import encode_one

F_S, B_S = 0.010, 0.020  # healthy per-layer-stage chunk times (s) for 8 layers


def one_f_one_b_order(pp: int, m: int, s: int) -> list[tuple[str, int]]:
    warm = min(pp - s - 1, m)
    order = [("F", j) for j in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def simulate(layout: Layout, slow: dict[int, float], t0: float) -> tuple[dict, float]:
    """Columnar chunks of one iteration (1F1B per replica), slow ranks scaled by 1/p."""
    pp, cols = (
        layout.pp,
        {
            k: []
            for k in (
                "dp",
                "stage",
                "src_dp",
                "microbatch",
                "kind",
                "direction",
                "start_s",
                "duration_s",
            )
        },
    )
    end_all = t0
    for d in range(layout.dp):
        m = layout.microbatches[d]
        factor = [
            1.0 / min([slow.get(r, 1.0) for r in layout.groups[d][s]] or [1.0]) for s in range(pp)
        ]
        scale = [layout.layers[s] / 8.0 for s in range(pp)]
        done: dict[tuple[str, int, int], float] = {}
        free = [t0] * pp
        orders = [one_f_one_b_order(pp, m, s) for s in range(pp)]
        pos = [0] * pp
        while any(pos[s] < len(orders[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                if pos[s] >= len(orders[s]):
                    continue
                kind, j = orders[s][pos[s]]
                dep = (
                    (("F", s - 1, j) if s > 0 else None)
                    if kind == "F"
                    else (("B", s + 1, j) if s < pp - 1 else ("F", s, j))
                )
                if dep is not None and dep not in done:
                    continue
                start = max(free[s], done.get(dep, t0) if dep else t0)
                dur = (F_S if kind == "F" else B_S) * scale[s] * factor[s]
                done[(kind, s, j)] = start + dur
                free[s] = start + dur
                for k, v in (
                    ("dp", d),
                    ("stage", s),
                    ("src_dp", d),
                    ("microbatch", j),
                    ("kind", kind),
                    ("direction", 0),
                    ("start_s", start),
                    ("duration_s", dur),
                ):
                    cols[k].append(v)
                pos[s] += 1
                progressed = True
            assert progressed, "1F1B order deadlocked"
        end_all = max(end_all, max(free))
    return cols, end_all - t0


def publish_iteration(
    r, keys: JobKeys, layout: Layout, it: int, t: float, slow: dict, healthy_t: float | None
) -> float:
    """One iteration's record as the collector publishes it (JSON), with its entry id the
    wall time it was "published" (the end of the iteration); returns its duration."""
    cols, dur = simulate(layout, slow, t)
    n = layout.world_size
    rec = IterationRecord(
        iteration=it,
        iteration_time_s=dur,
        start_s=t,
        end_s=t + dur,
        samples=32,
        tokens=32 * 4096,
        num_ranks_reporting=n,
        chunks=cols,
        ranks={
            "rank": list(range(n)),
            "dp": [layout.coords()[k][0] for k in range(n)],
            "stage": [layout.coords()[k][1] for k in range(n)],
        },
    )
    d = rec.to_dict()
    if healthy_t is not None:
        d["predicted_iteration_time_s"] = healthy_t
    r.xadd(
        keys.iterations,
        {b"m": ("[" + json.dumps(d) + "]").encode()},
        id=f"{int((t + dur) * 1000)}-0",
    )
    return dur


def publish_job(
    r,
    job_id: str = "job-a",
    iterations: int = 60,
    slow_from: int = 40,
    slow_rank: int = 5,
    slow_p: float = 0.5,
    plan_state: str = "proposed",
    end_s: float | None = None,
    with_plan: bool = True,
) -> dict:
    """Publish a whole scenario; returns ids and times the tests assert against."""
    keys = JobKeys(job_id)
    bus.register_job(r, keys)
    layout = Layout.uniform(tp=2, pp=4, dp=2, num_layers=32, num_microbatches=8, devices_per_node=8)
    r.set(keys.layout, json.dumps(layout.to_dict()))
    healthy_cols, healthy_t = simulate(layout, {}, 0.0)
    _, slow_t = simulate(layout, {slow_rank: slow_p}, 0.0)
    gap = 0.002
    total = healthy_t * slow_from + slow_t * (iterations - slow_from) + gap * iterations
    t = (end_s or time.time()) - total
    pipe = r.pipeline()
    times = {}
    for it in range(iterations):
        slow = {slow_rank: slow_p} if it >= slow_from else {}
        dur = publish_iteration(pipe, keys, layout, it, t, slow, healthy_t)
        times[it] = (t, t + dur)
        t += dur + gap
    pipe.execute()
    detected = times[min(slow_from + 3, iterations - 1)][1]
    failure = FailureReport(
        report_id="fr-slow-1",
        kind="fail_slow_compute",
        ranks=[slow_rank],
        nodes=[slow_rank // 8],
        detected_at_s=detected,
        iteration=min(slow_from + 3, iterations - 1),
        severity={str(slow_rank): slow_p},
        evidence={
            "observed_s": slow_t,
            "predicted_s": healthy_t,
            "change_point": slow_from,
            "signal": "iteration_time",
            # as the detector writes it: chunk time / predicted, for the slow TP group
            "rank_ratios": {
                str(k): (round(1.0 / slow_p, 4) if k == slow_rank else 1.0)
                for k in (slow_rank - slow_rank % 2, slow_rank - slow_rank % 2 + 1)
            },
        },
    )
    bus.publish(r, keys.failures, failure)
    health = {
        str(k): json.dumps(
            {
                "p": slow_p if k == slow_rank else 1.0,
                "state": "slow" if k == slow_rank else "healthy",
                # as the detector writes it: when the device entered that state
                "since": detected if k == slow_rank else times[0][0],
            }
        )
        for k in range(16)
    }
    r.hset(keys.device_health, mapping=health)
    r.hset(keys.node_heartbeat, mapping={"0": repr(time.time()), "1": repr(time.time() - 0.4)})
    after = layout.copy()
    after.layers = [9, 5, 9, 9]
    after.layout_id = 1
    plan = AdaptationPlan(
        plan_id=1,
        state="proposed",
        created_at_s=detected + 0.05,
        reason=f"fail-slow rank {slow_rank}: move layers off stage 1",
        before=layout.to_dict(),
        after=after.to_dict(),
        predicted_before_s=slow_t,
        predicted_after_s=healthy_t * 1.1,
        failure_ids=[failure.report_id],
        mode="manual",
        moves=[{"what": "layers", "from_stage": 1, "to_stage": 0, "count": 1}],
    )
    if with_plan:
        publish_plan(r, keys, plan)
    if with_plan and plan_state != "proposed":
        plan.state = plan_state
        plan.updated_at_s = detected + 0.5
        publish_plan(r, keys, plan)
    return {
        "keys": keys,
        "layout": layout,
        "failure": failure,
        "plan": plan,
        "healthy_t": healthy_t,
        "slow_t": slow_t,
        "times": times,
        "chunks": healthy_cols,
    }


def publish_plan(r, keys: JobKeys, plan: AdaptationPlan) -> None:
    bus.publish(r, keys.plans, plan)
    r.hset(keys.plan_state, str(plan.plan_id), plan.to_json())


def publish_recovery(r, scenario: dict, applied_at_s: float, iterations: int = 10) -> None:
    """The plan applied at ``applied_at_s`` by the trainer, then healthy iterations."""
    keys, plan, layout = scenario["keys"], scenario["plan"], scenario["layout"]
    bus.publish(
        r,
        keys.actions,
        OperatorAction(
            action="acknowledge", plan_id=plan.plan_id, actor="alice", at_s=applied_at_s - 0.3
        ),
    )
    plan.state, plan.updated_at_s = "acknowledged", applied_at_s - 0.25
    publish_plan(r, keys, plan)
    bus.publish(
        r,
        keys.actions,
        OperatorAction(action="applied", plan_id=plan.plan_id, actor="trainer", at_s=applied_at_s),
    )
    plan.state, plan.updated_at_s = "applied", applied_at_s + 0.01
    publish_plan(r, keys, plan)
    last = max(scenario["times"])
    t = applied_at_s + 0.01
    for i in range(iterations):
        cols, dur = simulate(layout, {}, t)
        rec = IterationRecord(
            iteration=last + 1 + i,
            iteration_time_s=dur,
            start_s=t,
            end_s=t + dur,
            samples=32,
            tokens=32 * 4096,
            num_ranks_reporting=16,
            chunks=cols,
        )
        r.xadd(keys.iterations, encode_one(rec), id=f"{int((t + dur) * 1000)}-0")
        t += dur + 0.002


def publish_big_job(r, job_id: str = "big", slow_rank: int = 12345, dead_rank: int = 777) -> dict:
    """A 16,384-GPU job's layout, device health and node heartbeats (no telemetry streams)."""
    keys = JobKeys(job_id)
    bus.register_job(r, keys)
    layout = Layout.uniform(tp=8, pp=16, dp=128, num_layers=80, num_microbatches=64)
    r.set(keys.layout, json.dumps(layout.to_dict()))
    now = time.time()
    health = {}
    for k in range(layout.world_size):
        p, st = 1.0, "healthy"
        if k == slow_rank:
            p, st = 0.35, "slow"
        elif k == dead_rank:
            p, st = 0.0, "dead"
        health[str(k)] = json.dumps({"p": p, "state": st})
    r.hset(keys.device_health, mapping=health)
    touch_heartbeats(r, keys, layout.num_nodes, dead_node=dead_rank // 8, now=now)
    return {"keys": keys, "layout": layout, "slow_rank": slow_rank, "dead_rank": dead_rank}


def touch_heartbeats(r, keys: JobKeys, num_nodes: int, dead_node: int, now: float | None = None):
    """Every node heard 0.2 s ago, as the collector keeps it, except the dead one (30 s)."""
    now = time.time() if now is None else now
    r.hset(
        keys.node_heartbeat,
        mapping={str(n): repr(now - (30.0 if n == dead_node else 0.2)) for n in range(num_nodes)},
    )


def dash_call(app, output_id: str, values: dict, trigger: str):
    """Drive the Dash callback whose outputs include ``output_id`` through the real
    ``/_dash-update-component`` endpoint, as the browser does.  ``values`` maps
    ``"component.property"`` of its inputs and states to values (missing ones: None);
    returns the response's ``{component: {property: value}}``."""
    key = next(k for k in app.callback_map if f"{output_id}." in k)
    spec = app.callback_map[key]
    multi = key.startswith("..")
    outs = [
        {"id": o.rsplit(".", 1)[0], "property": o.rsplit(".", 1)[1]}
        for o in (key.strip(".").split("...") if multi else [key])
    ]

    def _items(kind):
        return [
            {**x, "value": values.get(f"{x['id']}.{x['property']}")} for x in spec.get(kind, [])
        ]

    req = {
        "output": key,
        "outputs": outs if multi else outs[0],
        "inputs": _items("inputs"),
        "state": _items("state"),
        "changedPropIds": [trigger],
    }
    res = app.server.test_client().post(
        "/_dash-update-component", headers={"Origin": "http://localhost"}, json=req
    )
    assert res.status_code in (200, 204), res.get_data(as_text=True)[:500]
    return res.json["response"] if res.status_code == 200 else {}


def plan_action_request(
    button: str, layers: str = "", drop: str = "", comment: str = "", shown: dict | None = None
) -> dict:
    """The Plans page's action callback request (``/_dash-update-component``) for a click on
    ``button`` with plan 1 of job-a selected; ``shown``: the (job, plan) the
    page has on screen (by default that same plan)."""
    shown = {"job": "job-a", "plan_id": 1} if shown is None else shown
    return {
        "output": "..pl-action-result.children...pl-last-action.data..",
        "outputs": [
            {"id": "pl-action-result", "property": "children"},
            {"id": "pl-last-action", "property": "data"},
        ],
        "inputs": [
            {"id": b, "property": "n_clicks", "value": 1 if b == button else None}
            for b in ("pl-ack", "pl-reject", "pl-override", "pl-hold")
        ],
        "changedPropIds": [f"{button}.n_clicks"],
        "state": [
            {"id": "job", "property": "value", "value": "job-a"},
            {"id": "pl-plan", "property": "value", "value": 1},
            {"id": "pl-ov-layers", "property": "value", "value": layers},
            {"id": "pl-ov-drop", "property": "value", "value": drop},
            {"id": "pl-ov-keep", "property": "value", "value": ""},
            {"id": "pl-ov-migration", "property": "value", "value": []},
            {"id": "pl-comment", "property": "value", "value": comment},
            {"id": "pl-shown", "property": "data", "value": shown},
        ],
    }


def incident_of(r, job: str = "job-a", report_id: str = "fr-slow-1"):
    """The incident ``report_id`` of ``job`` assembled from what Redis holds (no audit)."""
    from dashboard import incidents
    from dashboard.data import DashboardData

    d = DashboardData(r)
    return incidents.build_incident(
        job,
        report_id,
        d.failures(job),
        d.plan_history(job),
        d.actions(job),
        [x.to_dict() for x in d.iterations(job)],
    )

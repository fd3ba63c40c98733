"""Scheduler service: failure reports in, plans out, operator actions applied, all through Redis.

``SchedulerService(config, client)``:

* consumes ``keys.failures`` (FailureReport) and ``keys.actions``
  (OperatorAction) through :class:`resihp.bus.StreamConsumer` (consumer group
  ``resihp-scheduler``; malformed entries are dead-lettered by the consumer);
* reads the running layout from ``keys.layout`` and device speeds from
  ``keys.device_health`` (rank -> {p, state, since}, plus kind on a slow device);
* refuses a report it cannot act on - unknown rank, contradictory content, a
  device already excluded - by writing it to the dead-letter stream with the
  reason *and* counting it in ``scheduler_reports_refused_total``;
* plans with the configured policy (``scheduler.planner`` for ResiHP) and runs
  the plan lifecycle (``scheduler.lifecycle``), persisting every plan snapshot
  to ``keys.plans`` + ``keys.plan_state`` and every action to ``keys.audit``;
  on restart it reloads plans from ``keys.plan_state`` (waiting for Redis when it
  cannot be reached yet); plan ids stay above every plan it knows, also after Redis
  lost its data and ``keys.plan_seq`` with it;
* picks up runtime settings (mode, grace period, delta) from ``keys.scheduler_config``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import threading
import time

import redis

from resihp import bus, entry
from resihp.keys import JobKeys
from resihp.pipeline.models import MODEL_PRESETS
from resihp.plans import first_layout
from resihp.schemas import AdaptationPlan, FailureReport, OperatorAction, SchemaError, decode_json
from resihp.topology import Layout, LayoutError
from scheduler.config import SchedulerConfig
from scheduler.lifecycle import AuditRecord, Changes, OverrideError, PlanBook, PlanDraft
from scheduler.planner import PlanningError, PlanOptions, layout_runnable, override_options, plan
from scheduler.policies import Abort, get_policy
from scheduler.predict import Predictor

log = logging.getLogger(__name__)
SERVICE = "scheduler"


class ReportRefused(ValueError):
    """A well-formed failure report the scheduler cannot act on."""


def check_report(report: FailureReport, layout: Layout) -> None:
    """Raise ReportRefused when ``report`` names unknown ranks, contradicts itself or a known state."""
    ranks = list(report.ranks) + [int(r) for r in report.severity if str(r).lstrip("-").isdigit()]
    bad_keys = [r for r in report.severity if not str(r).lstrip("-").isdigit()]
    if bad_keys:
        raise ReportRefused(f"severity keys {bad_keys} are not rank numbers")
    unknown = sorted({r for r in ranks if not 0 <= r < layout.world_size})
    if unknown:
        raise ReportRefused(f"unknown rank(s) {unknown}: job has {layout.world_size} ranks")
    for a, b in report.links:
        if not (0 <= a < layout.world_size and 0 <= b < layout.world_size):
            raise ReportRefused(f"link [{a}, {b}] names an unknown rank")
    if not report.ranks and report.kind != "fail_slow_comm":
        raise ReportRefused(f"{report.kind} report names no rank")
    nodes_of = {layout.node_of(r) for r in report.ranks}
    if report.nodes and not set(report.nodes) <= set(range(layout.num_nodes)):
        raise ReportRefused(
            f"unknown node(s) {sorted(set(report.nodes) - set(range(layout.num_nodes)))}"
        )
    if report.nodes and report.ranks and not nodes_of <= set(report.nodes):
        raise ReportRefused(
            f"contradictory: ranks {report.ranks} live on nodes {sorted(nodes_of)}, report says {report.nodes}"
        )
    sev = {int(k): float(v) for k, v in report.severity.items()}
    if report.kind == "fail_stop":
        alive = [r for r in report.ranks if sev.get(r, 0.0) > 0]
        if alive:
            raise ReportRefused(
                f"contradictory: fail_stop ranks {alive} have throughput p > 0 in severity"
            )
    elif report.kind.startswith("fail_slow"):
        wrong = [r for r, v in sev.items() if v <= 0 or v >= 1.0]
        if wrong:
            raise ReportRefused(f"contradictory: fail_slow ranks {wrong} have p outside (0, 1)")
    dead = set(layout.dead)
    if report.kind != "recovery":
        gone = sorted(set(report.ranks) & dead)
        if gone:
            raise ReportRefused(
                f"rank(s) {gone} already excluded (dead in layout {layout.layout_id})"
            )


def infer_model(layout: Layout | None) -> str:
    """The first Table 3 preset with the layout's layer count ('' when none matches)."""
    if layout is None:
        return ""
    for name, pre in MODEL_PRESETS.items():
        if pre.num_layers == layout.num_layers:
            return name
    return ""


class SchedulerService:
    def __init__(self, config: SchedulerConfig, client: redis.Redis):
        self.config = config
        self.client = client
        self.keys = JobKeys(config.job_id)
        self._down_log = bus.ThrottledWarning(log)
        self.policy = get_policy(config.policy)
        self._predictor: Predictor | None = (
            Predictor(config.model, config.seq_len, config.device_mem_gb) if config.model else None
        )
        group = self.keys.group(SERVICE)
        self.failures = bus.StreamConsumer(
            client, self.keys, self.keys.failures, group, consumer=config.consumer
        )
        self.actions = bus.StreamConsumer(
            client, self.keys, self.keys.actions, group, consumer=config.consumer
        )
        self.health = bus.Health(client, self.keys, SERVICE)
        self.book = PlanBook(next_id=self._next_plan_id, running=self._running_layout)
        #: rank -> p learned from reports (device_health fills in the rest); kept in Redis
        #: so that a restarted scheduler plans with what its predecessor had learned
        self.p: dict[int, float] = {}
        self._restored = False
        # Redis may not answer yet (started before it, or during an outage): run() then
        # waits for it; a crash here would spend the launcher's restart budget instead
        entry.try_redis(self._restore, SERVICE, client)
        self.refused_total = 0
        self.plans_total = 0
        self._idle = False
        self._state_next = 0.0
        #: id of the report/action being handled, until persist() records it handled
        self._handling: str | None = None
        self.duplicates_total = 0
        self._home: Layout | None = None
        #: whether the runtime settings hash was read once (the start-up read re-times nothing)
        self._settings_read = False

    # ------------------------------------------------------------ state io
    def _restore(self) -> None:
        self.book.load(self._load_plans())
        self.p = self._load_speeds()
        self._restored = True

    def _next_plan_id(self) -> int:
        """The next plan id from ``keys.plan_seq``, always above every plan known here.

        A Redis restarted without its data restarts the sequence at 1; an id issued
        again would be taken by the trainer for a plan it already applied, and skipped."""
        pid = int(self.client.incr(self.keys.plan_seq))
        known = max(self.book.plans, default=0)
        if pid <= known:
            # INCRBY, not SET: still one distinct id per caller if another scheduler races
            pid = int(self.client.incrby(self.keys.plan_seq, known + 1 - pid))
            log.warning(
                "plan ids: %s was behind the plans known here (up to %d), lost with "
                "Redis's data; plan ids go on from %d",
                self.keys.plan_seq,
                known,
                pid,
            )
        return pid

    def _load_plans(self) -> dict[int, AdaptationPlan]:
        out = {}
        for pid, raw in self.client.hgetall(self.keys.plan_state).items():
            try:
                p = decode_json(raw)
            except SchemaError as e:
                log.warning("unreadable plan %s in plan_state: %s", pid, e)
                continue
            if isinstance(p, AdaptationPlan):
                out[p.plan_id] = p
        return out

    def _load_speeds(self) -> dict[int, float]:
        out = {}
        for k, v in self.client.hgetall(self.keys.scheduler_speeds).items():
            try:
                r, x = int(k), float(v)
            except (TypeError, ValueError):
                log.warning("unreadable entry %r=%r in %s", k, v, self.keys.scheduler_speeds)
                continue
            if r >= 0 and math.isfinite(x) and x >= 0:
                out[r] = x
        return out

    @property
    def predictor(self) -> Predictor:
        if self._predictor is None:
            lay = self.layout()
            self._predictor = Predictor(
                infer_model(lay), self.config.seq_len, self.config.device_mem_gb
            )
            log.info(
                "cost model: %s (inferred from the layout)", self._predictor.model or "generic"
            )
        return self._predictor

    def _running_layout(self) -> dict | None:
        """The running layout as a dict (None when there is none or it is unreadable): the
        plan book's reference for stale plans and layout ids."""
        try:
            raw = self.client.get(self.keys.layout)
            d = json.loads(raw) if raw else None
        except (ValueError, TypeError):
            return None
        return d if isinstance(d, dict) else None

    def layout(self) -> Layout | None:
        raw = self.client.get(self.keys.layout)
        if not raw:
            return None
        return Layout.from_json(raw)

    def home_layout(self) -> Layout | None:
        """The run's first layout (``keys.layouts``): the structure a plan may restore
        once devices of dropped stages are back. Read until found, then kept."""
        if self._home is None:
            raw = first_layout(self.client, self.keys)
            try:
                self._home = Layout.from_dict(raw) if raw is not None else None
            except LayoutError as e:
                log.warning("the job's first layout is unreadable, no restore plans: %s", e)
        return self._home

    def speeds(self, layout: Layout) -> dict[int, float]:
        p: dict[int, float] = {}
        for k, v in self.client.hgetall(self.keys.device_health).items():
            try:
                d = json.loads(v)
                r = int(k)
                p[r] = 0.0 if d.get("state") == "dead" else float(d.get("p", 1.0))
            except (ValueError, TypeError, AttributeError):
                continue
        p.update(self.p)
        for r in layout.dead:
            p[r] = 0.0
        return {r: v for r, v in p.items() if 0 <= r < layout.world_size}

    #: How many handled message ids ``keys.scheduler_handled`` keeps (newest).
    HANDLED_KEEP = 100_000

    def _seen(self, mid: str) -> bool:
        return self.client.zscore(self.keys.scheduler_handled, mid) is not None

    def _mark(self, pipe) -> None:
        """Record the message being handled as handled, inside ``pipe``'s transaction."""
        if self._handling is None:
            return
        pipe.zadd(self.keys.scheduler_handled, {self._handling: time.time()})
        pipe.zremrangebyrank(self.keys.scheduler_handled, 0, -self.HANDLED_KEEP - 1)
        self._handling = None

    def persist(self, ch: Changes) -> None:
        """Write plan snapshots and audit records, and mark the message that caused them
        handled, in one transaction: after a crash either all of it is there (and the
        re-delivered message is skipped) or none of it (and it is handled again)."""
        if not ch.plans and not ch.audit:
            return
        pipe = self.client.pipeline(transaction=True)
        self._mark(pipe)
        for plan_ in ch.plans:
            js = plan_.to_json()
            pipe.hset(self.keys.plan_state, str(plan_.plan_id), js)
            pipe.xadd(
                self.keys.plans, {b"m": ("[" + js + "]").encode()}, maxlen=100_000, approximate=True
            )
        for rec in ch.audit:
            pipe.xadd(self.keys.audit, rec.to_fields(), maxlen=100_000, approximate=True)
        pipe.execute()

    # ------------------------------------------------------------ planning
    def _options(self) -> PlanOptions:
        base = copy.deepcopy(getattr(self.policy, "options", None) or PlanOptions())
        base.delta = self.config.delta
        return base

    def make_draft(
        self,
        layout: Layout,
        p: dict[int, float],
        options: PlanOptions | None = None,
        reason: str = "",
    ) -> PlanDraft | None:
        """A plan for ``layout`` under speeds ``p``; None when nothing would improve."""
        if self.config.policy.startswith("resihp"):
            res = plan(
                layout, p, self.predictor, options or self._options(), home=self.home_layout()
            )
            if not res.changed:
                return None
            return res.draft(layout, reason)
        runnable = layout_runnable(layout, p)
        before = self.predictor.iteration_s(layout, p) if runnable else -1.0
        try:
            state = self.policy.adapt(self.policy.initial_state(layout), p, self.predictor)
        except Abort as e:
            raise PlanningError(str(e)) from e
        if len(state) != 1:
            raise PlanningError(
                f"policy {self.config.policy} produced {len(state)} pipeline groups; the service publishes one layout"
            )
        after = state[0]
        after.layout_id = layout.layout_id + 1
        t = self.predictor.iteration_s(after, p)
        if runnable and t >= before:
            return None
        return PlanDraft(layout.to_dict(), after.to_dict(), before, t, [], reason=reason)

    def _replan(self, plan_: AdaptationPlan, override: dict) -> PlanDraft:
        try:
            before = Layout.from_dict(plan_.before)
        except LayoutError as e:
            raise OverrideError(f"plan {plan_.plan_id} has an unreadable layout: {e}") from e
        p = self.speeds(before)
        opt = override_options(self._options(), override)
        try:
            res = plan(before, p, self.predictor, opt)
        except PlanningError as e:
            raise OverrideError(str(e)) from e
        if opt.dp is False and res.after.migrations:
            raise OverrideError(
                "migration off is infeasible: stage(s) "
                f"{sorted({(m.src_dp, m.stage) for m in res.after.migrations})} have no devices and must migrate"
            )
        return res.draft(before, f"override of plan {plan_.plan_id}")

    def refuse(self, report: FailureReport | dict, reason: str) -> None:
        raw = report.to_dict() if isinstance(report, FailureReport) else report
        bus.dead_letter(
            self.client,
            self.keys,
            self.keys.failures,
            self.config.consumer,
            f"refused: {reason}",
            raw,
        )
        bus.incr_counter(self.client, self.keys, "scheduler_reports_refused_total")
        self.refused_total += 1
        log.info("refused report: %s", reason)

    def handle_report(self, report: FailureReport) -> None:
        try:
            layout = self.layout()
        except LayoutError as e:
            self.refuse(report, f"the layout at {self.keys.layout} is unreadable: {e}")
            return
        if layout is None:
            self.refuse(report, "no layout published yet (keys.layout is empty)")
            return
        try:
            check_report(report, layout)
        except ReportRefused as e:
            self.refuse(report, str(e))
            return
        sev = {int(k): float(v) for k, v in report.severity.items()}
        for r in report.ranks:
            if report.kind == "fail_stop":
                self.p[r] = 0.0
            elif report.kind == "recovery":
                self.p[r] = sev.get(r, 1.0)
            else:
                self.p[r] = sev.get(r, 0.5)
        if report.ranks:
            # idempotent: a report re-delivered after a crash writes the same values
            self.client.hset(
                self.keys.scheduler_speeds, mapping={str(r): self.p[r] for r in report.ranks}
            )
        if report.kind == "recovery":
            # every device of the layout's dead list known to be back, not only this
            # report's: two that re-joined together may be worth a group only together
            back = [r for r in layout.dead if r in report.ranks or self.p.get(r, 0.0) > 0.0]
            if back:
                layout = Layout.from_dict(
                    {
                        **layout.to_dict(),
                        "dead": [r for r in layout.dead if r not in back],
                        "standby": sorted(set(layout.standby) | set(back)),
                    }
                )
        p = self.speeds(layout)
        reason = f"{report.kind} on ranks {report.ranks} (report {report.report_id})"
        try:
            draft = self.make_draft(layout, p, reason=reason)
        except PlanningError as e:
            bus.incr_counter(self.client, self.keys, "scheduler_planning_failed_total")
            self.refuse(report, f"no feasible plan: {e}")
            return
        if draft is None:
            bus.incr_counter(self.client, self.keys, "scheduler_plans_skipped_total")
            # what is known now leaves the current layout as the best one: a plan still
            # waiting (e.g. one dropping a device that has just recovered) must not be
            # acknowledged after its grace period
            self.persist(
                self.book.withdraw(
                    f"superseded: after report {report.report_id} ({report.kind} on ranks "
                    f"{report.ranks[:8]}) the current layout needs no change"
                )
            )
            return
        same = self.book.same_as_open(draft)
        if same is not None:
            # the report changes nothing in the open plan (a re-sent or overlapping
            # report): keep it, with the operator's acknowledgement if it has one
            if report.report_id not in same.failure_ids:
                same.failure_ids.append(report.report_id)
                self.persist(Changes(plans=[same]))
            log.info("report %s: plan %d already proposes this", report.report_id, same.plan_id)
            return
        ch = self.book.propose(
            draft,
            mode=self.config.mode,
            grace_s=self.config.grace_period_s,
            policy=self.config.policy,
            failure_ids=[report.report_id],
        )
        self.persist(ch)
        self.plans_total += 1
        new = ch.plans[-1]
        log.info(
            "proposed plan %d (%s): %s, predicted %s -> %.3f s",
            new.plan_id,
            self.config.mode,
            reason,
            "cannot run" if new.predicted_before_s < 0 else f"{new.predicted_before_s:.3f} s",
            new.predicted_after_s,
        )
        bus.incr_counter(self.client, self.keys, "scheduler_plans_total")

    def apply_settings(
        self, d: dict, strict: bool = False, retime: bool = True
    ) -> tuple[list[str], Changes]:
        """Apply runtime settings (``set_mode``, or the ``keys.scheduler_config`` hash) and
        re-time the plans waiting for their grace period: a new grace period counts from
        when each plan's started (created, or auto switched on), and switching to auto
        starts it afresh. Raises ValueError (nothing changed) on a bad field or value."""
        old_mode, old_grace = self.config.mode, self.config.grace_period_s
        changed = self.config.apply_runtime(d, strict=strict)
        ch = Changes()
        restart = old_mode != "auto" and self.config.mode == "auto"
        if retime and (restart or "grace_period_s" in changed):
            ch = self.book.retime(
                grace_s=self.config.grace_period_s, old_grace_s=old_grace, restart=restart
            )
        return changed, ch

    def _replace_stale(self) -> None:
        """A proposed plan made for a layout the job has left (the trainer moved on alone,
        or applied another plan) is replaced by a plan for the running layout answering the
        same reports; when that layout needs no change it is superseded with the reason."""
        stale = [(p, self.book.stale(p)) for p in self.book.open_plans() if p.state == "proposed"]
        stale = [(p, why) for p, why in stale if why]
        if not stale:
            return
        ids = list(dict.fromkeys(f for p, _ in stale for f in p.failure_ids))
        why = "; ".join(w for _, w in stale)
        draft = None
        try:
            layout = self.layout()
            if layout is not None:
                draft = self.make_draft(
                    layout,
                    self.speeds(layout),
                    reason=f"re-planned for layout {layout.layout_id}: {why}",
                )
        except (PlanningError, LayoutError) as e:
            log.warning("no plan replaces stale plan(s): %s", e)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception:  # noqa: BLE001 - the tick still supersedes them; the loop goes on
            log.exception("planning in place of stale plan(s) failed")
        if draft is None:
            # the book's tick supersedes them, saying why
            return
        ch = self.book.propose(
            draft,
            mode=self.config.mode,
            grace_s=self.config.grace_period_s,
            policy=self.config.policy,
            failure_ids=ids,
            why=f"re-planned for the running layout: {why}",
        )
        self.persist(ch)
        self.plans_total += 1
        bus.incr_counter(self.client, self.keys, "scheduler_plans_total")
        log.info("proposed plan %d in place of stale plan(s): %s", ch.plans[-1].plan_id, why)

    def handle_action(self, action: OperatorAction) -> None:
        if action.action == "set_mode":
            now = time.time()
            rec = AuditRecord(
                action.actor,
                "set_mode",
                action.plan_id,
                action.at_s,
                "ok",
                override=dict(action.override),
                comment=action.comment,
                action_id=action.action_id,
                recorded_at_s=now,
            )
            ch = Changes(audit=[rec])
            try:
                changed, retimed = self.apply_settings(
                    {k: str(v) for k, v in action.override.items()}, strict=True
                )
                if changed:
                    self.client.hset(
                        self.keys.scheduler_config,
                        mapping={k: str(getattr(self.config, k)) for k in changed},
                    )
                rec.note = f"changed {changed}"
                if retimed.plans:
                    rec.note += "; " + ", ".join(
                        f"plan {p.plan_id} now applies by itself in "
                        f"{max(0.0, p.apply_after_s - now):.0f} s"
                        if self.config.mode == "auto"
                        else f"plan {p.plan_id} re-timed"
                        for p in retimed.plans
                    )
                ch.plans = retimed.plans
            except ValueError as e:
                rec.result, rec.note = "refused", str(e)
            self.persist(ch)
            return
        ch = self.book.act(action, self._replan, mode=self.config.mode, policy=self.config.policy)
        if any(r.result == "refused" for r in ch.audit):
            bus.incr_counter(self.client, self.keys, "scheduler_actions_refused_total")
        self.persist(ch)

    # ------------------------------------------------------------ loop
    def _runtime_config(self) -> None:
        raw = self.client.hgetall(self.keys.scheduler_config)
        first, self._settings_read = not self._settings_read, True
        if not raw:
            return
        d = {
            (k.decode(errors="replace") if isinstance(k, bytes) else k): (
                v.decode(errors="replace") if isinstance(v, bytes) else v
            )
            for k, v in raw.items()
        }
        try:
            # at start-up the hash holds what was in force when the waiting plans were
            # timed (it wins over the command line): nothing to re-time then
            changed, retimed = self.apply_settings(d, retime=not first)
        except ValueError as e:
            log.warning("ignoring bad runtime config: %s", e)
            return
        self.persist(retimed)
        if changed:
            # also at start-up: an operator's set_mode outlives a scheduler restart (a
            # crash-restarted scheduler must not fall back to auto behind their back),
            # so say plainly when it overrides the command line
            log.warning(
                "runtime settings from %s now in force: %s",
                self.keys.scheduler_config,
                {k: getattr(self.config, k) for k in changed},
            )

    def run_once(self) -> int:
        if not self._restored:
            self._restore()
        self._runtime_config()
        handled = 0
        # Operators' actions and the trainer's confirmations first: they were decided on
        # the plans as they stood, before any report in the same step replaces them.
        for consumer, kind in ((self.actions, OperatorAction), (self.failures, FailureReport)):
            block = self.config.block_ms if consumer is self.failures else 0
            entries = consumer.read(count=100, block_ms=block or None)
            for entry_id, msgs in entries:
                for m in msgs:
                    if isinstance(m, kind):
                        mid = (
                            f"report:{m.report_id}"
                            if kind is FailureReport
                            else (f"action:{m.action_id}" if m.action_id else None)
                        )
                        if mid is not None and self._seen(mid):
                            # re-delivered after a crash, or sent twice: handled once
                            self.duplicates_total += 1
                            bus.incr_counter(self.client, self.keys, "scheduler_duplicates_total")
                            log.info("skipping %s: already handled", mid)
                            continue
                        self._handling = mid
                        try:
                            if kind is FailureReport:
                                self.handle_report(m)
                            else:
                                self.handle_action(m)
                        except (redis.ConnectionError, redis.TimeoutError):
                            raise  # not acked: re-delivered after reconnect
                        except Exception as e:  # noqa: BLE001 - a bad message must not stop the service
                            log.exception("failed to handle %s", type(m).__name__)
                            bus.dead_letter(
                                self.client,
                                self.keys,
                                consumer.stream,
                                self.config.consumer,
                                f"internal error handling {type(m).__name__}: {e!r}",
                                m.to_dict(),
                            )
                            bus.incr_counter(
                                self.client, self.keys, "scheduler_internal_errors_total"
                            )
                        if self._handling is not None:  # handled without a plan change
                            pipe = self.client.pipeline(transaction=True)
                            self._mark(pipe)
                            pipe.execute()
                        handled += 1
                    else:
                        bus.dead_letter(
                            self.client,
                            self.keys,
                            consumer.stream,
                            self.config.consumer,
                            f"unexpected message type {type(m).__name__} on {consumer.stream}",
                            m.to_dict() if hasattr(m, "to_dict") else repr(m),
                        )
                # acked entry by entry: planning takes up to seconds per report, and a
                # crash must not re-deliver a whole batch of handled messages
                consumer.ack([entry_id])
        self._replace_stale()
        self.persist(self.book.tick(self._auto_mode()))
        self.health.beat("ok", mode=self.config.mode, plans_total=self.plans_total)
        return handled

    def _auto_mode(self) -> str:
        """The mode the grace-period tick runs in: ``manual`` while the job is not running.

        Nobody would apply a plan of a job that finished (shown after its run, or its
        trainer ended) or that has been silent since before the collector started (its
        stack was killed): auto-acknowledging it would leave an 'acknowledged' plan that
        was never applied in its history, and hand it to a later relaunch under the same
        job id.  It waits as proposed, for an operator or for the job to run again."""
        if self.config.mode != "auto":
            return self.config.mode
        now = time.monotonic()
        if now >= self._state_next:
            self._state_next = now + 1.0
            idle = bus.job_state(self.client, self.keys) == "finished"
            col = bus.Health.get(self.client, self.keys, "collector")
            idle = idle or bus.liveness_judged(col) is False
            if idle and not self._idle and self.book.open_plans():
                log.info("job %s is not running: open plans wait for an operator", self.keys.job_id)
            self._idle = idle
        return "manual" if self._idle else "auto"

    def run(self, stop: threading.Event) -> None:
        if not self._restored and not entry.wait_for_redis(
            self._restore, SERVICE, self.client, stop
        ):
            return
        while not stop.is_set():
            try:
                self.run_once()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                self._down_log.warning("redis unavailable: %s", e)
                time.sleep(0.5)

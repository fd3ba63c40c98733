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
* handles the reports read in one step as one batch: each is checked (or refused) and
  folded into the known device speeds in order, then one plan answers them all (or open
  plans are withdrawn when the result needs no change); the grace-period tick and the
  health beat run between planning steps, and a thread beats while one computes;
* plans with the configured policy (``scheduler.planner`` for ResiHP) and runs
  the plan lifecycle (``scheduler.lifecycle``), persisting every plan snapshot
  to ``keys.plans`` + ``keys.plan_state`` and every action to ``keys.audit``;
  on restart it reloads plans from ``keys.plan_state`` (waiting for Redis when it
  cannot be reached yet); plan ids stay above every plan it knows, also after Redis
  lost its data and ``keys.plan_seq`` with it;
* picks up runtime settings (mode, grace period, delta) from ``keys.scheduler_config``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import threading
import time

import redis

from resihp import acl, bus, entry
from resihp.keys import JobKeys
from resihp.pipeline.models import MODEL_PRESETS
from resihp.plans import first_layout
from resihp.schemas import AdaptationPlan, FailureReport, OperatorAction, SchemaError
from resihp.topology import Layout, LayoutError
from resihp.wire import decode_json
from scheduler import previews
from scheduler.config import SchedulerConfig
from scheduler.lifecycle import AuditRecord, Changes, OverrideError, PlanBook, PlanDraft
from scheduler.planner import PlanningError, PlanOptions, layout_runnable, override_options, plan
from scheduler.policies import Abort, get_policy
from scheduler.predict import Predictor

log = logging.getLogger(__name__)
SERVICE = "scheduler"


class ReportRefused(ValueError):
    """A well-formed failure report the scheduler cannot act on."""


def check_report(report: FailureReport, layout: Layout, dead: set[int] | None = None) -> None:
    """Raise ReportRefused when ``report`` names unknown ranks, contradicts itself or a known state.

    ``dead``: the devices known dead now (default: the layout's dead list); a device of
    that list a recovery report has since said is back may fail again."""
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
    dead = set(layout.dead) if dead is None else dead
    if report.kind != "recovery":
        gone = sorted(set(report.ranks) & dead)
        if gone:
            raise ReportRefused(
                f"rank(s) {gone} already excluded (dead in layout {layout.layout_id})"
            )


def _ranks_text(ranks: list[int], limit: int = 8) -> str:
    """``[0..7, 16..23, 40]``: runs of consecutive ranks, the first ``limit`` of them."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}..{b}" if b > a else f"{a}" for a, b in runs[:limit]]
    if len(runs) > limit:
        parts.append(f"... ({len(set(ranks))} ranks)")
    return "[" + ", ".join(parts) + "]"


def describe_reports(reports: list[FailureReport]) -> str:
    """What a batch of reports says, in one bounded line (a plan's reason, a note)."""
    if len(reports) == 1:
        (r,) = reports
        return f"{r.kind} on ranks {r.ranks} (report {r.report_id})"
    kinds: dict[str, set[int]] = {}
    for r in reports:
        kinds.setdefault(r.kind, set()).update(r.ranks)
    what = "; ".join(f"{k} on ranks {_ranks_text(sorted(v))}" for k, v in kinds.items())
    ids = [r.report_id for r in reports]
    more = f" and {len(ids) - 6} more" if len(ids) > 6 else ""
    return f"{len(reports)} reports: {what} (reports {', '.join(ids[:6])}{more})"


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
        #: ids of the reports/action being handled, until persist() records them handled
        self._handling: list[str] = []
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

    def _add_handled(self, pipe, mids: list[str]) -> None:
        pipe.zadd(self.keys.scheduler_handled, dict.fromkeys(mids, time.time()))
        pipe.zremrangebyrank(self.keys.scheduler_handled, 0, -self.HANDLED_KEEP - 1)

    def _mark(self, pipe) -> None:
        """Record the messages being handled as handled, inside ``pipe``'s transaction."""
        if not self._handling:
            return
        self._add_handled(pipe, self._handling)
        self._handling = []

    def _mark_now(self, mids: list[str] | None = None) -> None:
        """Record ``mids`` (default: the messages still being handled) handled now: what
        changed no plan (a refusal, a report an open plan already answers)."""
        if mids is None:
            mids, self._handling = self._handling, []
        if not mids:
            return
        pipe = self.client.pipeline(transaction=True)
        self._add_handled(pipe, mids)
        pipe.execute()

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
        if ch.plans:
            self._trim_plan_state(pipe)
        for rec in ch.audit:
            pipe.xadd(self.keys.audit, rec.to_fields(), maxlen=100_000, approximate=True)
        pipe.execute()

    #: Finished plans (superseded, rejected, refused, overridden) ``keys.plan_state`` keeps,
    #: the newest ones; open (proposed, acknowledged) and applied plans are always kept.
    #: Older ones leave the hash and this scheduler's memory; their snapshots stay in
    #: ``keys.plans`` (capped) and the operator actions in ``keys.audit``.  Every reader of
    #: the hash (trainers, dashboard, ``resihp status``, a restarted scheduler) pays for
    #: its size on a full read.
    TERMINAL_PLANS_KEEP = 500

    def _trim_plan_state(self, pipe) -> None:
        """Drop the finished plans past the newest ``TERMINAL_PLANS_KEEP`` from the hash
        (inside ``pipe``'s transaction) and from the plan book."""
        keep = max(1, self.TERMINAL_PLANS_KEEP)  # the newest plan id stays known
        if len(self.book.plans) <= keep:
            return
        done = sorted(
            pid
            for pid, p in self.book.plans.items()
            if p.state not in ("proposed", "acknowledged", "applied")
        )
        old = done[: max(0, len(done) - keep)]
        if old:
            pipe.hdel(self.keys.plan_state, *(str(pid) for pid in old))
            for pid in old:
                del self.book.plans[pid]

    # ------------------------------------------------------------ health
    #: How long one planning computation may keep the health key fresh from its beat
    #: thread: a planner stuck for longer lets the key expire (the scheduler shows DOWN).
    PLANNING_BEAT_MAX_S = 120.0

    def _beat(self, **extra) -> None:
        self.health.beat("ok", mode=self.config.mode, plans_total=self.plans_total, **extra)

    @contextlib.contextmanager
    def _planning(self, what: str):
        """Around one planning computation (seconds on a 16k-GPU layout, more on a loaded
        host, longer than the health key's TTL): a beat before and after it, and from a
        thread every third of the TTL while it runs, so a scheduler busy planning is not
        listed DOWN (``state: planning`` in its health)."""
        busy = {"state": "planning", "planning": what[:200], "planning_since_s": time.time()}
        self._beat(**busy)
        done = threading.Event()

        def keep_alive() -> None:
            end = time.monotonic() + self.PLANNING_BEAT_MAX_S
            while not done.wait(self.health.ttl_s / 3) and time.monotonic() < end:
                self._beat(**busy)

        beat = threading.Thread(target=keep_alive, name="scheduler-planning-beat", daemon=True)
        beat.start()
        try:
            yield
        finally:
            done.set()
            beat.join()
            self._beat()

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
        with self._planning(reason):
            return self._with_healthy(self._make_draft(layout, p, options, reason), layout)

    def _with_healthy(self, draft: PlanDraft | None, layout: Layout) -> PlanDraft | None:
        """``draft`` with the layout's healthy predicted time when the layout cannot run:
        what an incident measures the plan's promise against (a fail-stop's plan promised
        nothing, and every fail-stop costing over 10 % stayed open)."""
        if draft is not None and draft.predicted_before_s <= 0:
            draft.predicted_healthy_s = float(self.predictor.iteration_s(layout, {}))
        return draft

    def _make_draft(
        self, layout: Layout, p: dict[int, float], options: PlanOptions | None, reason: str
    ) -> PlanDraft | None:
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

    def _replan(self, plan_: AdaptationPlan, override: dict, what: str = "override") -> PlanDraft:
        try:
            before = Layout.from_dict(plan_.before)
        except LayoutError as e:
            raise OverrideError(f"plan {plan_.plan_id} has an unreadable layout: {e}") from e
        p = self.speeds(before)
        opt = override_options(self._options(), override)
        try:
            with self._planning(f"{what} of plan {plan_.plan_id}"):
                res = plan(before, p, self.predictor, opt)
        except PlanningError as e:
            raise OverrideError(str(e)) from e
        if opt.dp is False and res.after.migrations:
            raise OverrideError(
                "migration off is infeasible: stage(s) "
                f"{sorted({(m.src_dp, m.stage) for m in res.after.migrations})} have no devices and must migrate"
            )
        return self._with_healthy(res.draft(before, f"override of plan {plan_.plan_id}"), before)

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

    def known_layout(self, layout: Layout) -> Layout:
        """``layout`` as the reports known so far leave it: a device of its dead list that a
        recovery report has since said is back (``p > 0``) is on standby, ready for work.

        Every device known to be back, not only the latest report's: two devices that
        re-joined one after the other may be worth a group only together, and a plan for
        another failure must not forget a device that came back."""
        back = [r for r in layout.dead if self.p.get(r, 0.0) > 0.0]
        if not back:
            return layout
        return Layout.from_dict(
            {
                **layout.to_dict(),
                "dead": [r for r in layout.dead if r not in back],
                "standby": sorted(set(layout.standby) | set(back)),
            }
        )

    def handle_report(self, report: FailureReport) -> None:
        """One report: a batch of one (see :meth:`handle_reports`)."""
        self.handle_reports([report])

    def handle_reports(self, reports: list[FailureReport]) -> None:
        """A batch of reports as one change of what is known, answered by one plan.

        Each report is checked as it comes, against the device states the reports before
        it in the batch left (a device a recovery said is back may fail again), and refused
        (dead-lettered with the reason) or folded into the known speeds, in order: a
        ``fail_stop`` followed by a ``recovery`` of the same ranks leaves them alive, a
        recovery followed by a death leaves them dead. Then ONE plan answers the state
        the accepted reports leave (its ``failure_ids`` list them all), or, when that
        state needs no change, every open plan is withdrawn. A whole-cluster flap (every
        node reported dead, then back, within seconds) is one planning step, not one per
        report, none of them for a death already undone."""
        try:
            layout = self.layout()
        except LayoutError as e:
            for rep in reports:
                self._refuse_report(rep, f"the layout at {self.keys.layout} is unreadable: {e}")
            return
        if layout is None:
            for rep in reports:
                self._refuse_report(rep, "no layout published yet (keys.layout is empty)")
            return
        accepted: list[FailureReport] = []
        learned: set[int] = set()
        for rep in reports:
            try:
                if self._fold_report(rep, layout):
                    accepted.append(rep)
                    learned.update(rep.ranks)
            except (redis.ConnectionError, redis.TimeoutError):
                raise  # not acked: re-delivered after reconnect
            except Exception as e:  # noqa: BLE001 - a bad report must not stop the batch
                self._internal_error(rep, e)
        if learned:
            # idempotent: a batch re-delivered after a crash writes the same values
            self.client.hset(
                self.keys.scheduler_speeds, mapping={str(r): self.p[r] for r in sorted(learned)}
            )
        if not accepted:
            return
        self._handling = [f"report:{r.report_id}" for r in accepted]
        try:
            self._plan_reports(self.known_layout(layout), accepted)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception as e:  # noqa: BLE001 - a bad batch must not stop the service
            self._handling = []
            for rep in accepted:
                self._internal_error(rep, e)
        # what changed no plan (refused, or already answered) is handled all the same
        self._mark_now()

    def _refuse_report(self, report: FailureReport, reason: str) -> None:
        self.refuse(report, reason)
        self._mark_now([f"report:{report.report_id}"])

    def _internal_error(self, report: FailureReport, e: Exception) -> None:
        log.error("failed to handle report %s", report.report_id, exc_info=e)
        bus.dead_letter(
            self.client,
            self.keys,
            self.keys.failures,
            self.config.consumer,
            f"internal error handling FailureReport: {e!r}",
            report.to_dict(),
        )
        bus.incr_counter(self.client, self.keys, "scheduler_internal_errors_total")
        self._mark_now([f"report:{report.report_id}"])

    def _fold_report(self, report: FailureReport, layout: Layout) -> bool:
        """Check ``report`` against what is known now and fold it into the known speeds;
        False when it is refused (dead-lettered, recorded handled)."""
        dead = {r for r in layout.dead if self.p.get(r, 0.0) <= 0.0}
        try:
            check_report(report, layout, dead=dead)
        except ReportRefused as e:
            self._refuse_report(report, str(e))
            return False
        sev = {int(k): float(v) for k, v in report.severity.items()}
        for r in report.ranks:
            if report.kind == "fail_stop":
                self.p[r] = 0.0
            elif report.kind == "recovery":
                self.p[r] = sev.get(r, 1.0)
            else:
                self.p[r] = sev.get(r, 0.5)
        return True

    def _plan_reports(self, layout: Layout, reports: list[FailureReport]) -> None:
        """One plan for ``layout`` (what is known after ``reports``) answering them all."""
        ids = [r.report_id for r in reports]
        reason = describe_reports(reports)
        if len(reports) > 1:
            log.info("planning once for %s", reason)
        p = self.speeds(layout)
        try:
            draft = self.make_draft(layout, p, reason=reason)
        except PlanningError as e:
            batch = f" (for the state after {len(reports)} reports of one step)"
            for rep in reports:
                bus.incr_counter(self.client, self.keys, "scheduler_planning_failed_total")
                self.refuse(rep, f"no feasible plan: {e}" + (batch if len(reports) > 1 else ""))
            return
        if draft is None:
            bus.incr_counter(self.client, self.keys, "scheduler_plans_skipped_total")
            # what is known now leaves the current layout as the best one: a plan still
            # waiting (e.g. one dropping a device that has just recovered) must not be
            # acknowledged after its grace period
            after = (
                f"report {ids[0]} ({reports[0].kind} on ranks {reports[0].ranks[:8]})"
                if len(reports) == 1
                else reason
            )
            self.persist(
                self.book.withdraw(f"superseded: after {after} the current layout needs no change")
            )
            return
        same = self.book.same_as_open(draft)
        if same is not None:
            # the reports change nothing in the open plan (re-sent or overlapping reports):
            # keep it, with the operator's acknowledgement if it has one
            new_ids = [i for i in ids if i not in same.failure_ids]
            if new_ids:
                same.failure_ids.extend(new_ids)
                self.persist(Changes(plans=[same]))
            log.info(
                "report(s) %s: plan %d already proposes this", ", ".join(ids[:8]), same.plan_id
            )
            return
        new = self._propose(draft, ids)
        log.info(
            "proposed plan %d (%s): %s, predicted %s -> %.3f s",
            new.plan_id,
            self.config.mode,
            reason,
            "cannot run" if new.predicted_before_s < 0 else f"{new.predicted_before_s:.3f} s",
            new.predicted_after_s,
        )

    def _propose(self, draft: PlanDraft, ids: list[str], why: str = "") -> AdaptationPlan:
        """``draft`` proposed in the current mode (superseding the open plans), persisted
        and counted; returns the new plan."""
        ch = self.book.propose(
            draft,
            mode=self.config.mode,
            grace_s=self.config.grace_period_s,
            policy=self.config.policy,
            failure_ids=ids,
            why=why,
        )
        self.persist(ch)
        self.plans_total += 1
        bus.incr_counter(self.client, self.keys, "scheduler_plans_total")
        return ch.plans[-1]

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
        new = self._propose(draft, ids, why=f"re-planned for the running layout: {why}")
        log.info("proposed plan %d in place of stale plan(s): %s", new.plan_id, why)

    def handle_action(self, action: OperatorAction) -> None:
        why = acl.refusal(self.client, self.keys, action) if self.config.sealed_actions else ""
        if why:  # a Redis user of the deployment's ACL must vouch for the actor
            rec = AuditRecord.of(action, time.time())
            rec.result, rec.note = "refused", why
            log.warning("refused action %s of %r: %s", action.action_id, action.actor, why)
            bus.incr_counter(self.client, self.keys, "scheduler_actions_refused_total")
            self.persist(Changes(audit=[rec]))
            return
        if action.action == "set_mode":
            now = time.time()
            rec = AuditRecord.of(action, now)
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

    #: How many failure-stream entries one step reads (and plans for at once).
    REPORT_BATCH = 100

    def run_once(self) -> int:
        if not self._restored:
            self._restore()
        self._handling = []  # a step cut short by Redis: its messages are handled again
        self._runtime_config()
        # Operators' actions and the trainer's confirmations first: they were decided on
        # the plans as they stood, before any report in the same step replaces them.
        handled = self._handle_actions()
        previews.handle(self)
        if handled:
            # an override re-plans (seconds at scale): plans due are acknowledged and the
            # health key refreshed before the reports' planning step, not after it
            self._pulse()
        handled += self._handle_failures()
        self._pulse()
        return handled

    def _pulse(self) -> None:
        """Between planning steps: a plan made for a layout the job has left is replaced,
        one whose grace period is over is auto-acknowledged, the health key refreshed."""
        self._replace_stale()
        self.persist(self.book.tick(self._auto_mode()))
        self._beat()

    def _duplicate(self, mid: str) -> bool:
        """Whether message ``mid`` was handled already (re-delivered after a crash, or sent
        twice): it is then skipped, and counted."""
        if not self._seen(mid):
            return False
        self.duplicates_total += 1
        bus.incr_counter(self.client, self.keys, "scheduler_duplicates_total")
        log.info("skipping %s: already handled", mid)
        return True

    def _unexpected(self, consumer: bus.StreamConsumer, m) -> None:
        bus.dead_letter(
            self.client,
            self.keys,
            consumer.stream,
            self.config.consumer,
            f"unexpected message type {type(m).__name__} on {consumer.stream}",
            m.to_dict() if hasattr(m, "to_dict") else repr(m),
        )

    def _handle_actions(self) -> int:
        handled = 0
        for entry_id, msgs in self.actions.read(count=100, block_ms=None):
            for m in msgs:
                if not isinstance(m, OperatorAction):
                    self._unexpected(self.actions, m)
                    continue
                mid = f"action:{m.action_id}" if m.action_id else None
                if mid is not None and self._duplicate(mid):
                    continue
                self._handling = [mid] if mid else []
                try:
                    self.handle_action(m)
                except (redis.ConnectionError, redis.TimeoutError):
                    raise  # not acked: re-delivered after reconnect
                except Exception as e:  # noqa: BLE001 - a bad message must not stop the service
                    log.exception("failed to handle %s", type(m).__name__)
                    bus.dead_letter(
                        self.client,
                        self.keys,
                        self.actions.stream,
                        self.config.consumer,
                        f"internal error handling {type(m).__name__}: {e!r}",
                        m.to_dict(),
                    )
                    bus.incr_counter(self.client, self.keys, "scheduler_internal_errors_total")
                self._mark_now()  # handled without a plan change
                handled += 1
            # acked entry by entry: an override re-plans, a crash must not re-deliver a
            # whole batch of handled actions
            self.actions.ack([entry_id])
        return handled

    def _handle_failures(self) -> int:
        """One batch of failure reports (up to ``REPORT_BATCH`` entries), handled as one
        change of what is known (:meth:`handle_reports`): one planning step, not one per
        report. Its entries are acked once the batch's plan and the reports' handled marks
        are written; a crash before then re-delivers them, and what was already recorded
        handled (a refusal) is skipped."""
        entries = self.failures.read(count=self.REPORT_BATCH, block_ms=self.config.block_ms or None)
        reports: list[FailureReport] = []
        batch: set[str] = set()
        for _entry_id, msgs in entries:
            for m in msgs:
                if not isinstance(m, FailureReport):
                    self._unexpected(self.failures, m)
                    continue
                mid = f"report:{m.report_id}"
                if mid in batch:  # sent twice within the batch: handled once
                    self.duplicates_total += 1
                    bus.incr_counter(self.client, self.keys, "scheduler_duplicates_total")
                    continue
                if self._duplicate(mid):
                    continue
                batch.add(mid)
                reports.append(m)
        if reports:
            try:
                self.handle_reports(reports)
            except (redis.ConnectionError, redis.TimeoutError):
                raise  # not acked: re-delivered after reconnect
            except Exception as e:  # noqa: BLE001 - a bad batch must not stop the service
                self._handling = []
                for rep in reports:
                    if not self._seen(f"report:{rep.report_id}"):
                        self._internal_error(rep, e)
        self.failures.ack([entry_id for entry_id, _ in entries])
        return len(reports)

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
            # a job quiet as a whole for a moment (its verdicts held) still runs
            idle = idle or (bus.liveness_judged(col) is False and bus.job_silent_since(col) is None)
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

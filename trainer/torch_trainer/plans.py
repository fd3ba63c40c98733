"""The torch job's Redis side: the scheduler's plans, the published layout, the trainer's health.

Follows acknowledged plans (``resihp.plans.PlanFollower``), refuses those this trainer
cannot run (``trainer_plans_refused_total``) or confirms them once applied, publishes the
layout once every rank of generation 0 is up, registers the job again when Redis lost
its data, and beats the trainer's health key.  Redis is the monitoring side: every call
here that fails is retried later and never stops training.
"""

from __future__ import annotations

import time

import redis

from resihp import entry
from resihp.bus import Health, incr_counter
from resihp.keys import JobKeys
from resihp.plans import register_running
from resihp.topology import Layout

from .parallel import UnsupportedLayout, check_runnable


class PlanFollowing:
    """Plans, layout and health in Redis (a :class:`~.launcher.JobLauncher` part)."""

    def _connect_redis(self) -> None:
        if not (self.cfg.redis_url and self.cfg.follow_plans):
            return
        from resihp.plans import PlanFollower
        from resihp.redis_client import connect

        self.client = connect(self.cfg.redis_url)
        self.keys = JobKeys(self.cfg.job_id)
        self.follower = PlanFollower(self.client, self.keys)
        self.health = Health(self.client, self.keys, "trainer")
        self.layout_published = False  # published once every rank is up and heart-beating
        # a refused password ends the run with one line (exit 2); an unreachable Redis
        # does not: training starts, and the monitoring catches up when Redis answers
        entry.try_redis(self.client.ping, "trainer torch", self.client)
        # Plans acknowledged before this job started are not ours to apply.
        self._skip_prior_plans = True
        self._poll_plans()

    def _poll_plans(self) -> list:
        """Acknowledged plans not applied yet; none while Redis cannot be read."""
        try:
            plans = self.follower.poll()
        except redis.RedisError as e:
            self._redis_warn.warning("[launcher] cannot read plans (%s); retrying", e)
            return []
        if self._skip_prior_plans:
            self._skip_prior_plans = False
            for p in plans:
                self.follower.applied.add(p.plan_id)
            return []
        return plans

    def _refuse_plan(self, plan, reason: str) -> None:
        """A plan this trainer will not run (never retried: replacing it is the scheduler's
        job): said in the log, counted in ``trainer_plans_refused_total`` (which
        ``resihp status`` shows beside a plan waiting for the trainer)."""
        print(f"[launcher] plan {plan.plan_id} refused: {reason}", flush=True)
        self._event("plan_refused", plan_id=plan.plan_id, reason=reason)
        if self.follower is not None:
            self.follower.applied.add(plan.plan_id)
            self._to_refuse.append((plan, reason))
            self._send_refusals()
        if self.cur_plan is plan:
            self.cur_plan = None
        self.pending_confirm = [e for e in self.pending_confirm if e[1] is not plan]

    def _plan_layout(self, plan) -> Layout | None:
        try:
            lay = Layout.from_dict(plan.after)
            check_runnable(lay)
        except (ValueError, UnsupportedLayout) as e:
            self._refuse_plan(plan, f"not applicable: {e}")
            return None
        if any(r in self.dead for r in lay.active_ranks()):
            self._refuse_plan(plan, "it assigns work to a dead rank")
            return None
        return lay

    def _send_refusals(self) -> None:
        """Tell the scheduler about refused plans (``failed``), in order; what Redis does
        not take now goes at the next tick."""
        while self._to_refuse:
            plan, reason = self._to_refuse[0]
            try:
                self.follower.report_not_applied(plan, reason)
                incr_counter(self.client, self.keys, "trainer_plans_refused_total")
            except redis.RedisError as e:
                self._redis_warn.warning(
                    "[launcher] cannot report refused plan %d yet (%s)", plan.plan_id, e
                )
                return
            self._to_refuse.pop(0)

    def _confirm_plan(self, plan, layout: Layout, comment: str) -> None:
        if self.client is None:
            return
        try:
            self.follower.confirm_applied(plan, layout, comment=comment)
            self.published = layout
        except redis.RedisError as e:
            self._redis_warn.warning("[launcher] cannot confirm plan %d yet (%s)", plan.plan_id, e)
            self._to_confirm.append((plan, layout, comment))

    def _beat(self, state: str, **extra) -> None:
        """The trainer's health key, with whether the job runs or waits on a dead rank."""
        if state != self.state:
            self.state, self.state_since_s = state, time.time()
        if self.client is None:
            return
        try:
            self.health.beat(
                "ok",
                state=state,
                state_since_s=self.state_since_s,
                generation=self.gen,
                layout_id=self.layout.layout_id,
                dead_ranks=sorted(self.dead),
                backend="torch",
                **extra,
            )
        except redis.RedisError:
            pass  # Redis down: the job trains on; the key expires and says so

    def _publish_initial_layout(self) -> None:
        """Write the launch layout to Redis once all ranks of generation 0 built
        their groups: the collector expects heartbeats from every rank in the
        layout, and starting workers (torch import, data scan) send none yet."""
        if self.client is None or self.layout_published:
            return
        members = self._members(0)
        if self.gen == 0 and not all(
            self.store.check([f"timeline/0/groups_rebuilt/{r}"]) for r in members
        ):
            return
        try:
            self._register(self.layout)
        except redis.RedisError as e:
            self._redis_warn.warning("[launcher] cannot publish the layout yet (%s); retrying", e)
            return
        self.published = self.layout
        self._published_ids.add(self.layout.layout_id)
        self.layout_published = True
        self._event("layout_published", layout_id=self.layout.layout_id)

    def _register(self, layout: Layout) -> None:
        register_running(
            self.client,
            self.keys,
            layout,
            trainer="torch",
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
        )

    def _check_registration(self) -> None:
        """Register the job again when Redis lost it (restarted without its data): without
        the layout the scheduler refuses every failure report, without the job set entry
        and state the job drops out of status and metrics.  One EXISTS a second notices."""
        if self.client is None or not self.layout_published:
            return
        now = time.monotonic()
        if now < self._registration_check_s:
            return
        self._registration_check_s = now + 1.0
        try:
            if self.client.exists(self.keys.layout):
                return
            print(
                "[launcher] the job's layout is gone from Redis (restarted without its data?): "
                f"registering the job again with layout {self.published.layout_id}",
                flush=True,
            )
            # the lost plans went with the data and a scheduler restarted empty numbers
            # its plans from 1 again: an id applied before must not hide a new plan
            self.follower.applied.clear()
            self._register(self.published)
        except redis.RedisError:
            pass  # Redis down: checked again in a second

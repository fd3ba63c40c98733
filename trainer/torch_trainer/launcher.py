"""Launcher: a persistent rendezvous store and worker generations.

Plain torchrun tears every worker down when one dies.  This launcher owns a
TCPStore that outlives process groups, starts one worker process per rank and
describes numbered generations in the store (``gen/<g>``: members, layout,
reason).  Workers of generation g build their process group under the store
prefix ``pg/<g>``, so a new generation never meets stale rendezvous keys.

When a worker dies the survivors keep running (their groups fail with an
error or time out; they keep their state and wait), and the launcher writes
generation g+1 without the dead rank:
* with Redis and plan following on, it waits up to ``plan_wait_s`` for the
  scheduler's acknowledged plan (``resihp.plans.PlanFollower``) and uses its
  layout if this trainer can run it;
* otherwise it makes a local plan: drop the dead rank's DP replica and hand
  its micro-batches to the surviving replicas (paper Fig. 8a), or, with a
  single replica, shrink the TP degree of the dead rank's stage.
Acknowledged plans that arrive while training runs are applied the same way at
the next iteration boundary.  A plan is confirmed (``confirm_applied``) once
the first iteration of its generation has completed.  When Redis loses the
job's data (restarted without persistence) the launcher registers the job
again: the job set entry, the layout it last published and the state running.

Failures around that:
* deaths seen within ``DEATH_SETTLE_S`` of each other (ranks killed in the same
  iteration) make one generation; a rank that dies while the next one is being
  decided is a new decision, and a member that dies before the others met it
  only ends that generation (workers meet in a store rendezvous they can leave);
* the launcher refreshes ``launcher/beat`` in the store, also while it waits for
  a plan: the survivors wait for the next generation as long as it does;
* a generation that fails with no rank dying is retried with the same layout up
  to ``MAX_FAILED_GENERATIONS`` times in a row; then a plan's layout is refused
  (counted in ``trainer_plans_refused_total``, said in the log) and the job goes
  back to the last layout that ran (any layout that failed so: the same); when
  that one failed as often too the job ends;
* a death decides every plan whose generation has not completed an iteration:
  confirmed if the workers moved into its (published) layout, refused if they
  never entered it, and the next layout derives from what the workers hold;
* a job that cannot go on is marked finished with the reason, exit 1; the
  trainer's health says finished, failed or stopped when the launcher ends.

Started again on its out dir (a stopped or crashed job, ``resihp up --resume``), the
launcher resumes the newest step whose every rank saved its state
(``resihp.checkpoints.latest_complete_ckpt``), in the layout that step was saved under: ranks that
layout holds dead are not started, generation 0 reads every shard from disk, the loss
rows of later iterations are dropped and trained again.  Checkpoints of another model,
data or world size (``resihp.checkpoints.check_manifest``) are refused, exit 2; ``--fresh`` deletes
them and starts over.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import timedelta

import redis
import torch.distributed as dist

from resihp import entry
from resihp.bus import Health, ThrottledWarning, incr_counter, set_job_state
from resihp.checkpoints import MANIFEST, check_manifest, latest_complete_ckpt
from resihp.keys import JobKeys
from resihp.plans import register_running, write_layout
from resihp.topology import Layout, Migration

from .config import TrainConfig
from .parallel import UnsupportedLayout, check_runnable
from .state import ckpt_manifest, clear_ckpts, write_json
from .worker import worker_entry


def initial_layout(cfg: TrainConfig) -> Layout:
    return Layout.uniform(
        cfg.tp,
        cfg.pp,
        cfg.dp,
        cfg.num_layers,
        cfg.microbatches,
        devices_per_node=cfg.devices_per_node,
        schedule=cfg.schedule,
    )


def restore_plan(current: Layout, launch: Layout, alive: set[int]) -> Layout:
    """After ranks re-join: bring back every launch replica whose ranks are all
    alive and idle again, and spread the global batch over the replicas."""
    new = current.copy()
    new.layout_id = current.layout_id + 1
    new.dead = sorted(set(current.dead) - alive)
    used = set(current.active_ranks())

    def home(rep) -> int:
        """The launch replica ``rep`` comes from (its ranks are among that one's)."""
        held = {r for st in rep for r in st}
        return next(
            (i for i, g in enumerate(launch.groups) if held <= {r for st in g for r in st}),
            len(launch.groups),
        )

    current_groups = [[list(st) for st in rep] for rep in current.groups]
    # A stage a death emptied (its micro-batches migrated to other replicas) gets its
    # launch TP group back once those ranks are alive and idle: with every hole of a
    # replica left open, its migrations were dropped below and the layout was invalid
    # (two deaths under the migrate policy, then their re-join, ended the job).
    for rep in current_groups:
        i = home(rep)
        for s, st in enumerate(rep):
            if not st and i < len(launch.groups):
                want = set(launch.groups[i][s])
                if want <= alive and not want & used:
                    rep[s] = list(launch.groups[i][s])
                    used |= want
    back = []
    for grp in launch.groups:
        ranks = {r for st in grp for r in st}
        if grp not in current_groups and ranks <= alive and not ranks & used:
            back.append(grp)
            used |= ranks
    groups = sorted(current_groups + back, key=home)
    total = current.total_microbatches
    base, extra = divmod(total, len(groups))
    new.groups = groups
    new.microbatches = [base + (1 if i < extra else 0) for i in range(len(groups))]
    new.standby = sorted(r for r in alive if r not in used)
    new.migrations = hole_migrations(new)  # a stage still without devices
    new.validate()
    check_runnable(new)
    return new


def hole_migrations(layout: Layout) -> list[Migration]:
    """Every micro-batch of a (replica, stage) without devices runs that stage on the
    replicas that have it, round-robin."""
    migs = []
    for s in range(layout.pp):
        hosts = [d for d in range(layout.dp) if layout.groups[d][s]]
        if not hosts:
            raise UnsupportedLayout(f"stage {s} has no surviving replica to migrate to")
        k = 0
        for d in range(layout.dp):
            if layout.groups[d][s]:
                continue
            for j in range(layout.microbatches[d]):
                migs.append(Migration(s, d, j, hosts[k % len(hosts)]))
                k += 1
    return migs


def migrate_plan(layout: Layout, dead: set[int]) -> Layout:
    """ReCycle-style: a (replica, stage) that lost its whole TP group keeps its
    other stages; its micro-batches run that stage on other replicas, round-robin."""
    new = layout.copy()
    new.dead = sorted(set(new.dead) | dead)
    new.layout_id = layout.layout_id + 1
    for d in range(layout.dp):
        for s in range(layout.pp):
            grp = layout.groups[d][s]
            if not set(grp) & dead:
                continue
            if set(grp) - dead:
                raise UnsupportedLayout(
                    f"replica {d} stage {s} keeps part of its TP group; migration needs it all gone"
                )
            new.groups[d][s] = []
    new.migrations = hole_migrations(new)
    new.validate()
    check_runnable(new)
    return new


def shrink_tp_plan(layout: Layout, dead: set[int]) -> Layout:
    """§6.1-style: a TP group that lost ranks keeps running on the largest
    power of two of its survivors (its state is resharded on the move)."""
    new = layout.copy()
    new.dead = sorted(set(new.dead) | dead)
    new.layout_id = layout.layout_id + 1
    for d in range(layout.dp):
        for s in range(layout.pp):
            grp = layout.groups[d][s]
            if not set(grp) & dead:
                continue
            alive = [r for r in grp if r not in dead]
            if not alive:
                raise UnsupportedLayout(f"replica {d} stage {s} has no surviving rank")
            k = 1
            while k * 2 <= len(alive):
                k *= 2
            new.groups[d][s] = alive[:k]
            new.standby = sorted(set(new.standby) | set(alive[k:]))
    new.validate()
    check_runnable(new)
    return new


def local_plan(layout: Layout, dead: set[int], policy: str = "exclude_replica") -> Layout:
    """The launcher's own plan when no scheduler plan is available."""
    if policy == "shrink_tp":
        try:
            return shrink_tp_plan(layout, dead)
        except UnsupportedLayout as e:
            print(f"[launcher] TP shrink not possible ({e}); excluding the replica", flush=True)
    if policy == "migrate" and layout.dp > 1:
        try:
            return migrate_plan(layout, dead)
        except UnsupportedLayout as e:
            print(f"[launcher] migration not possible ({e}); excluding the replica", flush=True)
    new = layout.copy()
    new.dead = sorted(set(new.dead) | dead)
    new.layout_id = layout.layout_id + 1
    coords = layout.coords()
    hit = sorted({coords[r][0] for r in dead if r in coords})
    keep = [d for d in range(layout.dp) if d not in hit]
    if keep:
        total = layout.total_microbatches
        new.groups = [layout.groups[d] for d in keep]
        base, extra = divmod(total, len(keep))
        new.microbatches = [base + (1 if i < extra else 0) for i in range(len(keep))]
        lost = [r for d in hit for grp in layout.groups[d] for r in grp if r not in dead]
        new.standby = sorted(set(new.standby) | set(lost))
        new.migrations = []
    else:
        # Every replica lost a rank: shrink the TP degree of each hit stage.
        return shrink_tp_plan(layout, dead)
    new.validate()
    check_runnable(new)
    return new


#: Consecutive generations of one layout that may fail without a rank dying before the
#: launcher stops retrying it (a plan's layout is then refused; the trainer's own gives up).
MAX_FAILED_GENERATIONS = 3
#: After a death, how long more deaths are collected before the next generation is formed
#: (ranks killed in the same iteration die some tens of milliseconds apart).
DEATH_SETTLE_S = 0.1


def _shape(layout: Layout) -> str:
    """A layout without its id: the same groups, layers and work under any id."""
    d = layout.to_dict()
    d.pop("layout_id", None)
    return json.dumps(d, sort_keys=True)


class GiveUp(Exception):
    """The job cannot go on (the message says why)."""


class JobLauncher:
    def __init__(
        self,
        cfg: TrainConfig,
        max_failed_generations: int | None = None,
        settle_s: float = DEATH_SETTLE_S,
    ):
        self.cfg = cfg
        self.ctx = mp.get_context("spawn")
        self.procs: dict[int, mp.Process] = {}
        self.dead: set[int] = set()
        self.gen = 0
        self.layout = initial_layout(cfg)
        self.launch_layout = self.layout.copy()
        self.cursor = None
        if cfg.scenario:
            from resihp.scenario import ScenarioCursor, load_scenario

            self.cursor = ScenarioCursor(load_scenario(cfg.scenario))
        self.t_start = time.time()
        self.store = None
        self.follower = None
        self.client = None
        self.pending_confirm: list[tuple[int, object, Layout]] = []
        self._to_refuse: list[tuple[object, str]] = []  # (plan, reason) the scheduler awaits
        self.events: list[dict] = []
        self.max_layout_id = self.layout.layout_id
        self.state, self.state_since_s = "starting", time.time()
        # what Redis was last told the job runs: a generation of restarted ranks is
        # published only after its first iteration, so self.layout may be ahead of it
        self.published: Layout | None = None
        self._published_ids: set[int] = set()
        self._registration_check_s = 0.0
        # Redis is the monitoring side: its outage must never stop training, so every
        # call to it here is retried later and said at most every 10 s
        self._redis_warn = ThrottledWarning(logging.getLogger("trainer.torch.launcher"))
        self._skip_prior_plans = False
        self._done_gens: set[int] = set()
        self.resume_step: int | None = None  # set by run() when a checkpoint is resumed
        # config field when there is one (the CLI flag), else the argument, else 3
        self.max_failed_generations = max(
            1,
            int(
                max_failed_generations
                or getattr(cfg, "max_failed_generations", 0)
                or MAX_FAILED_GENERATIONS
            ),
        )
        self.settle_s = settle_s
        self.stop: threading.Event | None = None
        self.fail_streak = 0  # generations of self.layout that failed in a row, no death
        self.last_good: Layout | None = None  # the last layout that completed an iteration
        self.cur_plan = None  # the plan whose layout runs now, until confirmed
        self.gen_layouts: dict[int, Layout] = {0: self.layout}
        self.failed_layouts: set[str] = set()  # layouts that failed too often (_shape)
        self._to_confirm: list[tuple[object, Layout, str]] = []  # Redis was down
        self._store_beat_s = 0.0
        self._t0: float | None = None  # the job clock's zero (job/t0)

    def _event(self, what: str, **kw) -> None:
        self.events.append({"what": what, "t": time.time(), "generation": self.gen, **kw})

    def _write_gen(
        self, members: list[int], layout: Layout, reason: str, boundary: bool = False
    ) -> None:
        # boundary=True: members switch after a committed iteration (a plan);
        # False: members abandon the running iteration (a failure).
        # until a generation trained an iteration, every generation (a retry after a
        # failed start too) resumes from the checkpoint: nobody holds state yet
        if self.resume_step is not None and any(
            self.store.check([f"timeline/{g}/first_iteration_done/{r}"])
            for g in range(self.gen)
            for r in self._members(g)
        ):
            self.resume_step = None  # the workers hold the state now
        resuming = self.resume_step is not None
        desc = {
            "members": members,
            "layout": layout.to_dict(),
            "prev_layout": self.layout.to_dict() if self.gen > 0 or resuming else None,
            "reason": reason,
            "boundary": boundary,
        }
        if resuming:
            desc["resume_step"] = self.resume_step
        self.store.set(f"gen/{self.gen}", json.dumps(desc))
        self.gen_layouts[self.gen] = layout
        self._event(
            "generation_written",
            members=members,
            reason=reason,
            layout=layout.summary(),
            **({"resume_step": self.resume_step} if resuming else {}),
        )

    def _store_beat(self) -> None:
        """Tell the workers the launcher is there (they wait for the next generation as long
        as this changes, whatever plan_wait_s is)."""
        now = time.monotonic()
        if now >= self._store_beat_s:
            self._store_beat_s = now + 0.5
            self.store.set("launcher/beat", repr(time.time()))

    def _sleep(self, seconds: float) -> None:
        """Sleep, still beating, and stop early on a signal."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._store_beat()
            if self.stop is not None and self.stop.is_set():
                return
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

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

    def _exited(self) -> set[int]:
        """Ranks not counted dead yet whose process ended with an error."""
        return {
            r
            for r, p in self.procs.items()
            if r not in self.dead and p.exitcode is not None and p.exitcode != 0
        }

    def _alive(self) -> list[int]:
        return sorted(r for r, p in self.procs.items() if p.is_alive() and r not in self.dead)

    def _new_generation(
        self,
        layout: Layout,
        reason: str,
        plan=None,
        boundary: bool = False,
        publish_now: bool = True,
        retry: bool = False,
    ) -> None:
        """Switch the workers to ``layout``.  ``publish_now``: write it to Redis at once (the
        members all run already), so the collector judges the first iteration's telemetry
        under it (written only after that iteration, it was dead-lettered as coming from
        ranks and replicas the old layout did not have); a generation with restarted ranks
        is published once it ran an iteration, as their heartbeats only start then.
        ``retry``: the same layout again after a generation failed without a death (same
        id, nothing new to publish)."""
        members = self._alive()
        if not members:
            raise UnsupportedLayout("no rank is left alive to run it")
        if retry:  # the failed generation will never complete an iteration: its plan moves on
            self.pending_confirm = [e for e in self.pending_confirm if e[0] != self.gen]
        else:
            self.fail_streak = 0
            if layout.layout_id <= self.max_layout_id:
                # every layout the job runs gets its own id: a plan made for an older layout
                # (the trainer moved on alone meanwhile) carries an id already used, and
                # whoever keys on the id (the detector's re-warm) took the switch for none
                layout = layout.copy()
                layout.layout_id = self.max_layout_id + 1
            self.max_layout_id = layout.layout_id
        self.gen += 1
        self._write_gen(members, layout, reason, boundary)
        self.layout = layout
        self.cur_plan = plan
        if plan is not None:
            self.follower.applied.add(plan.plan_id)
        if not retry and publish_now and self.client is not None and self.layout_published:
            try:
                write_layout(self.client, self.keys, layout)
                self.published = layout
                self._published_ids.add(layout.layout_id)
            except redis.RedisError as e:  # confirmed (and written) after its first iteration
                print(
                    f"[launcher] could not publish layout {layout.layout_id} yet: {e}", flush=True
                )
        self.pending_confirm.append((self.gen, plan, layout))

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

    def _settle(self, ranks: set[int]) -> set[int]:
        """``ranks`` plus the ranks that die within the settle window after them (killed in
        the same iteration, they are seen some tens of milliseconds apart)."""
        ranks = set(ranks)
        for _ in range(4):  # at most 4 windows, however the deaths trickle in
            self._sleep(self.settle_s)
            more = self._exited() - ranks
            if not more:
                break
            ranks |= more
        return ranks

    def _started(self, gen: int) -> bool:
        """Some member of ``gen`` moved its state into its layout."""
        return any(
            self.store.check([f"timeline/{gen}/state_moved/{r}"]) for r in self._members(gen)
        )

    def _abandon_pending(self, ranks: set[int]) -> None:
        """A death ends every generation that has not completed an iteration yet.  Their
        plans are decided now, none stays acknowledged for ever: a plan whose layout was
        published and that the workers moved into is confirmed (the next layouts derive
        from it); one they never entered is refused.  Later layouts derive from what the
        workers hold: the layout of the last generation they entered."""
        self._confirm()
        decided: set[int] = set()
        for gen, plan, layout in reversed(self.pending_confirm):  # a plan's latest try decides
            if plan is None or plan.plan_id in decided:
                continue
            decided.add(plan.plan_id)
            if self._started(gen) and layout.layout_id in self._published_ids:
                self._confirm_plan(
                    plan,
                    layout,
                    f"generation {gen}: applied; ranks {sorted(ranks)} died before its first "
                    "iteration completed",
                )
            else:
                self._refuse_plan(
                    plan,
                    f"its generation {gen} was abandoned before it started: ranks "
                    f"{sorted(ranks)} died",
                )
        self.pending_confirm = []
        self.cur_plan = None
        for g in range(self.gen, -1, -1):
            if g == 0 or self._started(g) or g in self._done_gens:
                if self.gen_layouts.get(g) is not None and self.gen_layouts[g] is not self.layout:
                    print(
                        f"[launcher] generation {self.gen} never started: planning from the "
                        f"layout the workers hold ({self.gen_layouts[g].summary()})",
                        flush=True,
                    )
                    self.layout = self.gen_layouts[g]
                break

    def _confirm_plan(self, plan, layout: Layout, comment: str) -> None:
        if self.client is None:
            return
        try:
            self.follower.confirm_applied(plan, layout, comment=comment)
            self.published = layout
        except redis.RedisError as e:
            self._redis_warn.warning("[launcher] cannot confirm plan %d yet (%s)", plan.plan_id, e)
            self._to_confirm.append((plan, layout, comment))

    def _on_death(self, ranks: set[int]) -> None:
        """Ranks died: the next generation runs without them, on the scheduler's plan when
        one comes within plan_wait_s, else on the trainer's own."""
        ranks = self._settle(ranks)
        lost = set(ranks)  # every rank lost since the last generation
        while True:
            self.dead |= ranks
            self._event("death_detected", ranks=sorted(ranks))
            self._abandon_pending(ranks)
            chosen, plan = self._choose(lost)
            if chosen is None:
                return  # stopped by a signal: run() ends
            # the members are the ranks alive now: one that died while this was decided
            # makes it a new decision, not a generation that waits for a dead member
            missing = set(chosen.active_ranks()) - set(self._alive())
            # after _alive(): a rank dying in between is seen here; one the plan counts
            # dead already is no news
            ranks = self._exited() - set(chosen.dead if plan is not None else ())
            if not ranks:
                if missing:
                    raise UnsupportedLayout(
                        f"ranks {sorted(missing)} it gives work to are not running"
                    )
                break
            ranks = self._settle(ranks)
            lost |= ranks
            print(f"[launcher] ranks {sorted(ranks)} died too", flush=True)
            if plan is not None and not ranks <= set(chosen.dead):
                self._refuse_plan(plan, f"ranks {sorted(ranks)} died before it was applied")
        if plan is not None:
            extra = set(chosen.dead) - self.dead
            if extra:
                # the scheduler saw them die too (the same iteration): their exit is no new
                # death to recover from
                print(
                    f"[launcher] plan {plan.plan_id} also counts ranks {sorted(extra)} dead",
                    flush=True,
                )
                self.dead |= extra
        self._event("plan_chosen", plan_id=plan.plan_id if plan else 0, layout=chosen.summary())
        self._new_generation(chosen, f"fail-stop of ranks {sorted(lost)}", plan)

    def _choose(self, ranks: set[int]) -> tuple[Layout | None, object]:
        """(layout, plan) after ``ranks`` died: an acknowledged plan that counts them all
        dead if one comes within plan_wait_s, else (layout, None), the trainer's own.
        (None, None) when a signal stops the wait."""
        chosen = None
        plan = None
        if self.follower is not None:
            deadline = time.time() + self.cfg.plan_wait_s
            print(
                f"[launcher] ranks {sorted(ranks)} died: waiting up to {self.cfg.plan_wait_s:g} s "
                "for an acknowledged plan",
                flush=True,
            )
            next_beat = 0.0
            while time.time() < deadline and chosen is None:
                self._store_beat()  # the survivors wait as long as this goes on
                if self.stop is not None and self.stop.is_set():
                    return None, None
                if time.time() >= next_beat:  # hung, not gone: the key must not expire
                    self._beat("hung")
                    next_beat = time.time() + 1.0
                more = self._exited()
                if more:  # a survivor died meanwhile: the plan must cover it too
                    more = self._settle(more)
                    self.dead |= more
                    ranks |= more
                    self._event("death_detected", ranks=sorted(more))
                    print(
                        f"[launcher] ranks {sorted(more)} died too while waiting for a plan",
                        flush=True,
                    )
                    if not self._alive():
                        raise UnsupportedLayout("every rank died while waiting for a plan")
                # the scheduler plans only for a job whose layout it can read
                self._check_registration()
                for p in self._poll_plans():
                    lay = self._plan_layout(p)
                    if lay is not None and ranks <= set(lay.dead):
                        chosen, plan = lay, p
                time.sleep(0.1)
        if chosen is None:
            chosen = local_plan(self.layout, self.dead, self.cfg.recovery_policy)
            if self.follower is not None:
                print(
                    f"[launcher] no acknowledged plan for ranks {sorted(ranks)} within "
                    f"{self.cfg.plan_wait_s:g} s: applying the trainer's own plan "
                    f"({self.cfg.recovery_policy}): {chosen.summary()}",
                    flush=True,
                )
        return chosen, plan

    def _fallback_layout(self) -> Layout:
        """The last layout that ran (the launch layout before any did), or the trainer's own
        plan from it when it gives work to ranks dead now."""
        base = (self.last_good or self.launch_layout).copy()
        active = set(base.active_ranks())
        if active & self.dead:
            return local_plan(base, self.dead, self.cfg.recovery_policy)
        alive = set(self._alive())
        base.standby = sorted(alive - active)  # a rank re-joined since waits as standby
        base.dead = sorted((set(base.dead) - alive) | self.dead)
        base.validate()
        return base

    def _on_failed_generation(self) -> None:
        """Generation self.gen failed and no rank died: retry its layout a few times; then
        refuse the plan it came from and go back to the last layout that ran; give up when
        that one failed as often too."""
        key = f"failed_why/{self.gen}"
        why = self.store.get(key).decode() if self.store.check([key]) else "no reason given"
        self.fail_streak += 1
        n = self.max_failed_generations
        if self.fail_streak < n:
            print(
                f"[launcher] generation {self.gen} failed without a death ({why}): "
                f"retrying layout {self.layout.layout_id} ({self.fail_streak}/{n})",
                flush=True,
            )
            self._new_generation(
                self.layout, "communication failure without a death", self.cur_plan, retry=True
            )
            return
        what = (
            f"layout {self.layout.layout_id} ({self.layout.summary()}) failed {n} "
            f"generation(s) in a row without a rank dying; last: {why}"
        )
        self.failed_layouts.add(_shape(self.layout))
        plan = self.cur_plan
        if plan is not None:
            self._refuse_plan(plan, f"its layout does not run here: {what}")
        try:
            fallback = self._fallback_layout()
        except (UnsupportedLayout, ValueError) as e:
            raise GiveUp(f"{what}; no layout to fall back to: {e}") from None
        if _shape(fallback) in self.failed_layouts:
            raise GiveUp(what)
        print(f"[launcher] {what}: falling back to {fallback.summary()}", flush=True)
        self._event("fallback", refused_plan=plan.plan_id if plan else 0, layout=fallback.summary())
        self._new_generation(fallback, "back to a layout that ran")

    def _give_up(self, message: str) -> int:
        """End the job: said once, no traceback, its workers stopped and its state marked
        (the collector must not take the silence that follows for new failures)."""
        print(f"[launcher] {message}", flush=True)
        self._event("unrecoverable", reason=message)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        if self.client is not None:
            try:
                set_job_state(
                    self.client, self.keys, "finished", reason=f"trainer gave up: {message}"[:300]
                )
            except redis.RedisError:
                pass
        return 1

    def _resume_point(self) -> tuple[int, Layout] | None | str:
        """The checkpoint a restarted job continues from: (step, layout), None to start
        afresh (``--fresh``, or nothing saved), "refused" when the checkpoints there are
        another job's (said in one line: resuming them would train a different model)."""
        cfg = self.cfg
        if cfg.fresh:
            return None
        found = latest_complete_ckpt(cfg.ckpt)
        if found is None:
            return None
        why = check_manifest(cfg.ckpt, ckpt_manifest(cfg))
        if why is None and found[1].world_size != cfg.world_size:
            why = f"their layout has {found[1].world_size} ranks, this job {cfg.world_size}"
        if why is not None:
            print(
                f"[launcher] will not resume the checkpoints in {cfg.ckpt}: {why}; --fresh "
                "true starts over and deletes them (under `resihp up`: --fresh, which deletes "
                "the job's Redis data too), --ckpt-dir DIR keeps them and uses another folder",
                file=sys.stderr,
                flush=True,
            )
            return "refused"
        return found

    def _spawn(self, rank: int, start_gen: int) -> None:
        p = self.ctx.Process(
            target=worker_entry,
            args=(rank, self.cfg.to_dict(), "127.0.0.1", self.store.port, start_gen),
            name=f"resihp-torch-rank{rank}",
        )
        p.start()
        self.procs[rank] = p

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
        register_running(self.client, self.keys, layout, trainer="torch")

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

    def _progress(self) -> int:
        key = "progress/iteration"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def _job_time(self) -> float:
        """The job clock of scenario ``at_s`` events: seconds since the first generation
        started training (``job/t0``, set by the first worker to get there), 0 before."""
        if self._t0 is None:
            if not self.store.check(["job/t0"]):
                return 0.0
            self._t0 = float(self.store.get("job/t0"))
        return time.time() - self._t0

    def _check_rejoin(self) -> None:
        """Scenario ``rejoin`` events (or --rejoin-at-iteration): restart dead ranks."""
        it = self._progress()
        if it >= self.cfg.iterations:
            return  # trained out: the members are leaving, nobody to re-join
        ranks: set[int] = set()
        if 0 <= self.cfg.rejoin_at_iteration <= it and self.dead:
            ranks |= self.dead
            self.cfg.rejoin_at_iteration = -1
        if self.cursor is not None:
            for ev in self.cursor.due(it, self._job_time()):
                if ev.action == "rejoin":
                    ranks |= set(ev.targets(self.cfg.devices_per_node)) & self.dead
        if not ranks:
            return
        self._event("rejoin", ranks=sorted(ranks), at_iteration=it)
        for r in sorted(ranks):
            self.dead.discard(r)
            self._spawn(r, self.gen + 1)
        alive = {r for r, p in self.procs.items() if r not in self.dead}
        lay = restore_plan(self.layout, self.launch_layout, alive)
        self._new_generation(
            lay, f"ranks {sorted(ranks)} re-joined", boundary=True, publish_now=False
        )

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

    def _confirm(self) -> None:
        if self._to_refuse:
            self._send_refusals()
        still = []
        for plan, layout, comment in self._to_confirm:
            try:
                self.follower.confirm_applied(plan, layout, comment=comment)
            except redis.RedisError:
                still.append((plan, layout, comment))
        self._to_confirm = still
        still = []
        for gen, plan, layout in self.pending_confirm:
            members = self._members(gen)
            done = any(
                self.store.check([f"timeline/{gen}/first_iteration_done/{r}"]) for r in members
            )
            if not done:
                still.append((gen, plan, layout))
                continue
            if gen not in self._done_gens:  # when it happened, whenever Redis hears of it
                self._done_gens.add(gen)
                self._event("first_iteration_done", of_generation=gen)
                self.last_good = layout
                if gen == self.gen:
                    self.fail_streak = 0
                if plan is not None and self.cur_plan is plan:
                    self.cur_plan = None
            if self.client is not None:
                try:
                    if plan is not None:
                        self.follower.confirm_applied(plan, layout, comment=f"generation {gen}")
                    else:
                        write_layout(self.client, self.keys, layout)
                except redis.RedisError as e:
                    self._redis_warn.warning(
                        "[launcher] cannot confirm generation %d yet (%s); retrying", gen, e
                    )
                    still.append((gen, plan, layout))  # trains on; told once Redis answers
                    continue
                self.published = layout
                self._published_ids.add(layout.layout_id)
        self.pending_confirm = still

    def _members(self, gen: int) -> list[int]:
        key = f"gen/{gen}"
        if not self.store.check([key]):
            return []
        return json.loads(self.store.get(key))["members"]

    def run(self) -> int:
        cfg = self.cfg
        os.makedirs(cfg.out_dir, exist_ok=True)
        resume = self._resume_point()
        if resume == "refused":
            return 2
        metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
        _keep_metrics_before(metrics, resume[0] if resume else 0)
        if resume is None:
            clear_ckpts(cfg.ckpt)
        write_json(os.path.join(cfg.ckpt, MANIFEST), ckpt_manifest(cfg))
        if resume is not None:
            step, layout = resume
            if step >= cfg.iterations:
                print(
                    f"[launcher] the checkpoint in {cfg.ckpt} is at step {step}, which already "
                    f"reaches --iterations {cfg.iterations}: nothing to train (raise "
                    "--iterations to train on, or pass --fresh to start over)",
                    flush=True,
                )
                return 0
            self.layout, self.resume_step = layout, step
            self.max_layout_id = max(self.max_layout_id, layout.layout_id)
            self.dead = set(layout.dead)
            print(
                f"[launcher] resuming from the checkpoint of step {step} in {cfg.ckpt} "
                f"(layout {layout.layout_id}: {layout.summary()}"
                + (f"; ranks {sorted(self.dead)} stay out, dead" if self.dead else "")
                + "); --fresh starts over",
                flush=True,
            )
            if self.cursor is not None:  # the events before the restart are history
                self.cursor.due(step - 1, 0.0)
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            timeout=timedelta(seconds=cfg.store_timeout_s),
            wait_for_workers=False,
        )
        self._connect_redis()
        self._store_beat()
        members = [r for r in range(cfg.world_size) if r not in self.dead]
        self._write_gen(members, self.layout, "launch" if resume is None else "resume")
        for r in members:
            self._spawn(r, 0)
        last_poll = 0.0
        return_code = 0
        self.stop = (
            entry.stop_on_signals()
            if threading.current_thread() is threading.main_thread()
            else None
        )
        try:
            while True:
                self._store_beat()
                if self.stop is not None and self.stop.is_set():
                    # stopped from outside (resihp up, or the stack that started us died):
                    # an interruption, not the end of the job, so it is not marked finished
                    print("[launcher] stopping on a signal", flush=True)
                    for p in self.procs.values():
                        if p.is_alive():
                            p.terminate()
                    return_code = 143
                    break
                newly_dead = self._exited()
                if newly_dead and self._progress() >= cfg.iterations:
                    # every iteration is trained: nothing left to recover for
                    print(
                        f"[launcher] ranks {sorted(newly_dead)} died after the last iteration",
                        flush=True,
                    )
                    self.dead |= newly_dead
                    continue
                if newly_dead:
                    try:
                        self._on_death(newly_dead)
                    except (UnsupportedLayout, ValueError) as e:
                        return_code = self._give_up(
                            f"cannot continue after losing {sorted(self.dead)}: {e}"
                        )
                        break
                    continue
                if all(p.exitcode is not None for r, p in self.procs.items() if r not in self.dead):
                    break
                # Workers that failed without any death (e.g. a timeout): retry the layout,
                # a bounded number of times.
                if int(self.store.add(f"failed/{self.gen}", 0)) > 0:
                    self._sleep(1.0)  # give a dying process time to be reaped first
                    if not self._exited() and not (self.stop is not None and self.stop.is_set()):
                        try:
                            self._on_failed_generation()
                        except GiveUp as e:
                            return_code = self._give_up(f"giving up: {e}")
                            break
                        except (UnsupportedLayout, ValueError) as e:
                            return_code = self._give_up(
                                f"cannot continue after losing {sorted(self.dead)}: {e}"
                            )
                            break
                    continue
                self._confirm()
                self._publish_initial_layout()
                self._check_registration()
                try:
                    self._check_rejoin()
                    self._beat("running")
                    if (
                        self.follower is not None
                        and time.time() - last_poll > 0.2
                        and self._progress() < cfg.iterations
                    ):
                        last_poll = time.time()
                        for plan in self._poll_plans():
                            lay = self._plan_layout(plan)
                            if lay is not None:
                                self._new_generation(
                                    lay, f"plan {plan.plan_id}", plan, boundary=True
                                )
                except (UnsupportedLayout, ValueError) as e:
                    return_code = self._give_up(f"cannot go on: {e}")
                    break
                time.sleep(0.05)
            self._confirm()
        finally:
            try:
                self.store.set("launcher/shutdown", "1")  # workers still waiting: leave
            except Exception:  # noqa: BLE001 - best effort; exit_with_parent ends them anyway
                pass
            for p in self.procs.values():
                if p.is_alive():
                    p.join(timeout=5)
                if p.is_alive():
                    p.kill()
            self._write_timeline()
        if return_code:
            self._beat({143: "stopped"}.get(return_code, "failed"))
            return return_code
        bad = [r for r, p in self.procs.items() if r not in self.dead and p.exitcode != 0]
        if bad:
            print(f"[launcher] workers {bad} exited abnormally", flush=True)
            self._beat("failed")
            return 1
        # the last word on the health key: not "running" until the key expires
        self._beat("finished")
        if self.client is not None:
            try:  # ended on purpose: the collector must not read the silence as a failure
                set_job_state(self.client, self.keys, "finished")
            except redis.RedisError:
                pass
        return 0

    def _write_timeline(self) -> None:
        out = {"events": self.events, "workers": {}}
        try:
            if self.store.check(["timeline/kill"]):
                out["kill_t"] = float(self.store.get("timeline/kill"))
            if self.store.check(["job/t0"]):
                out["job_t0"] = float(self.store.get("job/t0"))
            for g in range(self.gen + 1):
                members = self._members(g)
                for ev in ("groups_rebuilt", "state_moved", "first_iteration_done"):
                    ts = [
                        float(self.store.get(f"timeline/{g}/{ev}/{r}"))
                        for r in members
                        if self.store.check([f"timeline/{g}/{ev}/{r}"])
                    ]
                    if ts:
                        out["workers"].setdefault(str(g), {})[ev] = max(ts)
                moved = [
                    json.loads(self.store.get(f"moved/{g}/{r}"))
                    for r in members
                    if self.store.check([f"moved/{g}/{r}"])
                ]
                if moved:
                    out["workers"].setdefault(str(g), {})["moved"] = {
                        **{k: moved[0][k] for k in ("kept", "from_replica", "from_disk")},
                        "bytes_sent": sum(m["bytes_sent"] for m in moved),
                    }
        except Exception as e:  # noqa: BLE001 - the timeline is a report; never fail the job for it
            out["error"] = repr(e)
        with open(os.path.join(self.cfg.out_dir, "timeline.json"), "w") as f:
            json.dump(out, f, indent=1)


def _keep_metrics_before(path: str, step: int) -> None:
    """Keep the loss rows of the iterations before ``step`` (a resumed job trains the
    rest again; 0: a fresh job, none kept)."""
    if not os.path.exists(path):
        return
    kept = []
    if step > 0:
        with open(path) as f:
            for line in f:
                try:
                    if int(json.loads(line)["iteration"]) < step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue
    with open(path, "w") as f:
        f.writelines(kept)


def launch(cfg: TrainConfig, **kw) -> int:
    """Run a job; ``kw`` go to :class:`JobLauncher` (``max_failed_generations``, ``settle_s``)."""
    return JobLauncher(cfg.validate(), **kw).run()

"""Recovery: the layout the torch job runs after ranks die, fail to start or re-join.

The trainer's own plans (pure functions of a layout and the dead ranks: drop the dead
rank's replica and hand its micro-batches on, migrate its stage, shrink its TP group,
give re-joined ranks their work back), and what the launcher does with a failure: gather
the deaths, decide the plans still pending, wait up to ``plan_wait_s`` for the
scheduler's plan or apply its own, retry a generation that failed without a death and
fall back to the last layout that ran, or give the job up.
"""

from __future__ import annotations

import json
import time

import redis

from resihp.bus import set_job_state
from resihp.topology import Layout, Migration

from .parallel import UnsupportedLayout, check_runnable


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


class Recovery:
    """React to deaths, failed generations and re-joins (a :class:`~.launcher.JobLauncher` part)."""

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
        self._stop_workers(kill=True)
        if self.client is not None:
            try:
                set_job_state(
                    self.client, self.keys, "finished", reason=f"trainer gave up: {message}"[:300]
                )
            except redis.RedisError:
                pass
        return 1

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

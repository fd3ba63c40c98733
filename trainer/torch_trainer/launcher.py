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
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import threading
import time
from datetime import timedelta

import redis
import torch.distributed as dist

from resihp import entry
from resihp.bus import Health, ThrottledWarning, set_job_state
from resihp.keys import JobKeys
from resihp.plans import register_running, write_layout
from resihp.topology import Layout, Migration

from .config import TrainConfig
from .parallel import UnsupportedLayout, check_runnable
from .state import clear_ckpts
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
    active = set(current.active_ranks())
    back = []
    for grp in launch.groups:
        ranks = {r for st in grp for r in st}
        if grp not in current.groups and ranks <= alive and not ranks & active:
            back.append(grp)
    order = {json.dumps(g): i for i, g in enumerate(launch.groups)}
    groups = sorted(current.groups + back, key=lambda g: order.get(json.dumps(g), len(order)))
    total = current.total_microbatches
    base, extra = divmod(total, len(groups))
    new.groups = groups
    new.microbatches = [base + (1 if i < extra else 0) for i in range(len(groups))]
    used = {r for g in groups for st in g for r in st}
    new.standby = sorted(r for r in alive if r not in used)
    new.migrations = []
    new.validate()
    check_runnable(new)
    return new


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
    migs = []
    for s in range(layout.pp):
        hosts = [d for d in range(new.dp) if new.groups[d][s]]
        if not hosts:
            raise UnsupportedLayout(f"stage {s} has no surviving replica to migrate to")
        k = 0
        for d in range(new.dp):
            if new.groups[d][s]:
                continue
            for j in range(new.microbatches[d]):
                migs.append(Migration(s, d, j, hosts[k % len(hosts)]))
                k += 1
    new.migrations = migs
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


class JobLauncher:
    def __init__(self, cfg: TrainConfig):
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
        self.events: list[dict] = []
        self.max_layout_id = self.layout.layout_id
        self.state, self.state_since_s = "starting", time.time()
        # what Redis was last told the job runs: a generation of restarted ranks is
        # published only after its first iteration, so self.layout may be ahead of it
        self.published: Layout | None = None
        self._registration_check_s = 0.0
        # Redis is the monitoring side: its outage must never stop training, so every
        # call to it here is retried later and said at most every 10 s
        self._redis_warn = ThrottledWarning(logging.getLogger("trainer.torch.launcher"))
        self._skip_prior_plans = False
        self._done_gens: set[int] = set()

    def _event(self, what: str, **kw) -> None:
        self.events.append({"what": what, "t": time.time(), "generation": self.gen, **kw})

    def _write_gen(
        self, members: list[int], layout: Layout, reason: str, boundary: bool = False
    ) -> None:
        # boundary=True: members switch after a committed iteration (a plan);
        # False: members abandon the running iteration (a failure).
        desc = {
            "members": members,
            "layout": layout.to_dict(),
            "prev_layout": self.layout.to_dict() if self.gen > 0 else None,
            "reason": reason,
            "boundary": boundary,
        }
        self.store.set(f"gen/{self.gen}", json.dumps(desc))
        self._event("generation_written", members=members, reason=reason, layout=layout.summary())

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

    def _plan_layout(self, plan) -> Layout | None:
        try:
            lay = Layout.from_dict(plan.after)
            check_runnable(lay)
        except (ValueError, UnsupportedLayout) as e:
            print(f"[launcher] plan {plan.plan_id} not applicable: {e}", flush=True)
            self.follower.applied.add(plan.plan_id)
            return None
        if any(r in self.dead for r in lay.active_ranks()):
            print(
                f"[launcher] plan {plan.plan_id} assigns work to a dead rank; ignored", flush=True
            )
            self.follower.applied.add(plan.plan_id)
            return None
        return lay

    def _new_generation(
        self,
        layout: Layout,
        reason: str,
        plan=None,
        boundary: bool = False,
        publish_now: bool = True,
    ) -> None:
        """Switch the workers to ``layout``.  ``publish_now``: write it to Redis at once (the
        members all run already), so the collector judges the first iteration's telemetry
        under it (written only after that iteration, it was dead-lettered as coming from
        ranks and replicas the old layout did not have); a generation with restarted ranks
        is published once it ran an iteration, as their heartbeats only start then."""
        if layout.layout_id <= self.max_layout_id:
            # every layout the job runs gets its own id: a plan made for an older layout
            # (the trainer moved on alone meanwhile) carries an id already used, and
            # whoever keys on the id (the detector's re-warm) took the switch for none
            layout = layout.copy()
            layout.layout_id = self.max_layout_id + 1
        self.max_layout_id = layout.layout_id
        self.gen += 1
        members = sorted(r for r, p in self.procs.items() if p.is_alive() and r not in self.dead)
        self._write_gen(members, layout, reason, boundary)
        self.layout = layout
        if plan is not None:
            self.follower.applied.add(plan.plan_id)
        if publish_now and self.client is not None and self.layout_published:
            try:
                write_layout(self.client, self.keys, layout)
                self.published = layout
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

    def _on_death(self, ranks: set[int]) -> None:
        self.dead |= ranks
        self._event("death_detected", ranks=sorted(ranks))
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
                if time.time() >= next_beat:  # hung, not gone: the key must not expire
                    self._beat("hung")
                    next_beat = time.time() + 1.0
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
        self._event("plan_chosen", plan_id=plan.plan_id if plan else 0, layout=chosen.summary())
        self._new_generation(chosen, f"fail-stop of ranks {sorted(ranks)}", plan)

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
        self.layout_published = True
        self._event("layout_published", layout_id=self.layout.layout_id)

    def _register(self, layout: Layout) -> None:
        register_running(self.client, self.keys, layout)

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

    def _check_rejoin(self) -> None:
        """Scenario ``rejoin`` events (or --rejoin-at-iteration): restart dead ranks."""
        it = self._progress()
        ranks: set[int] = set()
        if 0 <= self.cfg.rejoin_at_iteration <= it and self.dead:
            ranks |= self.dead
            self.cfg.rejoin_at_iteration = -1
        if self.cursor is not None:
            for ev in self.cursor.due(it, time.time() - self.t_start):
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

    def _confirm(self) -> None:
        still = []
        for gen, plan, layout in self.pending_confirm:
            done = self.store.check(
                [f"timeline/{gen}/first_iteration_done/{min(self._members(gen))}"]
            )
            if not done:
                still.append((gen, plan, layout))
                continue
            if gen not in self._done_gens:  # when it happened, whenever Redis hears of it
                self._done_gens.add(gen)
                self._event("first_iteration_done", of_generation=gen)
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
        self.pending_confirm = still

    def _members(self, gen: int) -> list[int]:
        return json.loads(self.store.get(f"gen/{gen}"))["members"]

    def run(self) -> int:
        cfg = self.cfg
        os.makedirs(cfg.out_dir, exist_ok=True)
        metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        clear_ckpts(cfg.ckpt)
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            timeout=timedelta(seconds=cfg.store_timeout_s),
            wait_for_workers=False,
        )
        self._connect_redis()
        self._write_gen(list(range(cfg.world_size)), self.layout, "launch")
        for r in range(cfg.world_size):
            self._spawn(r, 0)
        last_poll = 0.0
        failed_seen = 0
        return_code = 0
        stop = (
            entry.stop_on_signals()
            if threading.current_thread() is threading.main_thread()
            else None
        )
        try:
            while True:
                if stop is not None and stop.is_set():
                    # stopped from outside (resihp up, or the stack that started us died):
                    # an interruption, not the end of the job, so it is not marked finished
                    print("[launcher] stopping on a signal", flush=True)
                    for p in self.procs.values():
                        if p.is_alive():
                            p.terminate()
                    return_code = 143
                    break
                newly_dead = {
                    r
                    for r, p in self.procs.items()
                    if r not in self.dead and p.exitcode is not None and p.exitcode != 0
                }
                if newly_dead:
                    try:
                        self._on_death(newly_dead)
                    except (UnsupportedLayout, ValueError) as e:
                        print(
                            f"[launcher] cannot continue after losing {sorted(self.dead)}: {e}",
                            flush=True,
                        )
                        self._event("unrecoverable", reason=str(e))
                        for p in self.procs.values():
                            if p.is_alive():
                                p.kill()
                        return_code = 1
                        break
                    continue
                if all(p.exitcode is not None for r, p in self.procs.items() if r not in self.dead):
                    break
                # Workers that failed without any death (e.g. a timeout): retry same layout.
                nfail = int(self.store.add(f"failed/{self.gen}", 0))
                if nfail > failed_seen and not self.store.check([f"gen/{self.gen + 1}"]):
                    time.sleep(1.0)  # give a dying process time to be reaped first
                    if not any(
                        p.exitcode not in (None, 0)
                        for r, p in self.procs.items()
                        if r not in self.dead
                    ):
                        failed_seen = 0
                        self._new_generation(self.layout, "communication failure without a death")
                        continue
                self._confirm()
                self._publish_initial_layout()
                self._check_registration()
                self._check_rejoin()
                self._beat("running")
                if self.follower is not None and time.time() - last_poll > 0.2:
                    last_poll = time.time()
                    for plan in self._poll_plans():
                        lay = self._plan_layout(plan)
                        if lay is not None:
                            self._new_generation(lay, f"plan {plan.plan_id}", plan, boundary=True)
                time.sleep(0.05)
            self._confirm()
        finally:
            for p in self.procs.values():
                if p.is_alive():
                    p.join(timeout=5)
                if p.is_alive():
                    p.kill()
            self._write_timeline()
        if return_code:
            return return_code
        bad = [r for r, p in self.procs.items() if r not in self.dead and p.exitcode != 0]
        if bad:
            print(f"[launcher] workers {bad} exited abnormally", flush=True)
            return 1
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


def launch(cfg: TrainConfig) -> int:
    return JobLauncher(cfg.validate()).run()

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

This module holds the job's main loop; its parts, one concern each: worker processes
(``processes``), generations (``generations``), recovery and the trainer's own plans
(``recovery``), and the Redis side: plans, layout, health (``plans``).
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
from resihp.bus import ThrottledWarning, set_job_state
from resihp.checkpoints import MANIFEST, check_manifest, latest_complete_ckpt
from resihp.topology import Layout

from .config import TrainConfig
from .generations import Generations, initial_layout
from .parallel import UnsupportedLayout
from .plans import PlanFollowing
from .processes import WorkerProcesses, worker_context
from .recovery import DEATH_SETTLE_S, MAX_FAILED_GENERATIONS, GiveUp, Recovery
from .state import ckpt_manifest, clear_ckpts, write_json


class JobLauncher(WorkerProcesses, Generations, Recovery, PlanFollowing):
    """One torch job: its rendezvous store, its worker generations and their recovery
    (see the module doc; each concern lives in its own module)."""

    def __init__(
        self,
        cfg: TrainConfig,
        max_failed_generations: int | None = None,
        settle_s: float = DEATH_SETTLE_S,
    ):
        self.cfg = cfg
        self.ctx = worker_context()
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
                    self._stop_workers(kill=False)
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

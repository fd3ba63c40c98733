"""The simulated trainer as a service: paces a ClusterSim in (scaled) real time, emits its telemetry
through the trainer-side producer and follows adaptation plans.

At start it registers the job, writes the initial layout and starts the
producer; it writes them again when Redis loses them (restarted without its
data), and marks the job finished when it stops on purpose (all iterations run,
or a stop signal), so that its silence is not taken for a failure.
``run_once()`` does one step of the simulated cluster: at the iteration
boundary it first applies the newest acknowledged plan (if any), then advances
the simulation and replays the step's heartbeats at their simulated times
divided by ``speed``; chunk rows and micro-batch stats are handed over when the
iteration ends, as a real trainer does.

A job whose history is already in Redis (the trainer restarted: a crash, a container
restarted by compose) is resumed, as a real trainer resumes from its checkpoint: after
the newest iteration the job published, on the layout it ran, with the scenario's events
up to then taken as having happened (:meth:`SimTrainer._resume`).  Started from 0 instead,
its first minute of iterations repeated numbers the collector had published and was
dropped as late, unseen.

Heartbeats do not wait for the main loop: while it emits none (a slow plan poll, a
slow step, a wait for the producer), a thread of its own (:class:`_BeatKeeper`) beats for
the live ranks, as a real trainer's heartbeat thread does, so that one slow step is
not taken for every node failing at once.

Node agents (:mod:`resihp.liveness_agent`): for a job of up to ``node_agents_max_nodes``
nodes the simulator holds one named Redis connection per node with a live device and
closes it when the scenario kills the node's every device (at the step the kill falls in,
when that node's heartbeats stop), so the collector reports the node dead within its
CLIENT LIST poll instead of after missed beats; a node that re-joins gets a new one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref

import numpy as np
import redis

from resihp import entry
from resihp.bus import (
    Health,
    ThrottledWarning,
    incr_counter,
    job_state,
    set_job_state,
)
from resihp.keys import JobKeys
from resihp.liveness_agent import NodeAgent
from resihp.plans import PlanFollower, read_layout, register_running
from resihp.producer import TelemetryProducer
from resihp.progress import last_iteration_entry
from resihp.redis_client import is_cluster
from resihp.scenario import Scenario, load_scenario
from resihp.schemas import HEARTBEAT_DTYPE, IterationRecord, SchemaError
from resihp.topology import Layout, LayoutError
from resihp.wire import decode_entry

from .config import SimConfig
from .core import ClusterSim, SimStep, mb_stats_messages

log = logging.getLogger(__name__)


class SimTrainer:
    """Simulated TP x PP x DP trainer bound to one job in Redis."""

    def __init__(
        self,
        config: SimConfig,
        client: redis.Redis,
        scenario: Scenario | None = None,
        producer: TelemetryProducer | None = None,
    ):
        self.cfg = config.validate()
        self.client = client
        self.keys = JobKeys(config.job_id)
        self._down_log = ThrottledWarning(log)
        if scenario is None and config.scenario:
            scenario = load_scenario(config.scenario)
        self.wall0 = time.time()
        self.sim = ClusterSim(config, scenario, epoch_s=self.wall0)
        if producer is None:
            # Room for a few iterations of rows and beats: a 16k-rank job hands over
            # ~10^6 rows at once, far past the producer's default queue bound.
            per_iter = len(self.sim.ctx().template) + 8 * self.sim.layout.world_size
            producer = TelemetryProducer(
                None, self.keys, client=client, max_queue=max(100_000, 4 * per_iter)
            )
        self.producer = producer
        self.follower = PlanFollower(client, self.keys, actor="trainer")
        self.health = Health(client, self.keys, "trainer", ttl_s=config.health_ttl_s)
        self.started = False
        self._registered = False
        # (plan, layout, comment) applied, or (plan, None, reason) refused, the scheduler not told yet
        self._unconfirmed: list[tuple] = []
        self.redis_errors_total = 0
        self.steps_total = 0
        self.iterations_total = 0
        self.plans_applied_total = 0
        self.plans_refused_total = 0
        self.last_step: SimStep | None = None
        #: heartbeats the keeper thread sent while the main loop sent none
        self.keepalive_beats_total = 0
        self._keeper = _BeatKeeper(self)
        #: node -> its agent connection (nodes with a live device, jobs of up to
        #: ``node_agents_max_nodes`` nodes); rebuilt after a Redis error
        self.agents: dict[int, NodeAgent] = {}
        self._agents_errors = 0
        self._truth = open(config.truth_out, "a") if config.truth_out else None  # noqa: SIM115

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the producer and register the job (retried each step while Redis is down;
        a Redis that refuses the password raises ``resihp.entry.RedisRefused``)."""
        if not self.started:
            try:
                self._resume()
            except redis.RedisError as e:  # down now: a fresh run, as before Redis had one
                log.warning("cannot tell whether the job ran before (%s): starting at 0", e)
            self.producer.start()
            self.started = True
            self._keeper.start()
        self._register()

    def _resume(self) -> None:
        """Continue the job Redis holds a history of (see the module doc); nothing to do
        for a new job (no record, no trainer health)."""
        if self.sim.iteration or self.sim.t_s:
            return
        last, _ = last_iteration_entry(self.client, self.keys)
        beat = Health.all(self.client, self.keys).get("trainer:0") or {}
        beat_it = beat.get("iteration")
        newest = max(
            last.iteration if last is not None else -1,
            # the trainer's own last word: it may be ahead of what the collector published
            int(beat_it) - 1 if isinstance(beat_it, int) else -1,
        )
        if newest < 0:
            return
        first = self.client.xrange(self.keys.iterations, count=1)
        first_rec = None
        if first:
            try:
                good, _ = decode_entry(first[0][1])
            except SchemaError:
                good = []
            first_rec = next((m for m in good if isinstance(m, IterationRecord)), None)
        # training time the job had run: scenario times are on it
        prev_t = (
            max(0.0, last.end_s - first_rec.start_s)
            if last is not None and first_rec is not None
            else 0.0
        )
        sim = self.sim
        try:
            layout = read_layout(self.client, self.keys)
        except (LayoutError, ValueError) as e:
            log.warning("the job's layout in Redis is unreadable (%s): resuming on our own", e)
            layout = None
        now = time.time()
        # the trainer's clock goes on from the first run's (never back before its last
        # record); the wall pacing from now
        problem = sim.resume(
            newest + 1,
            prev_t,
            epoch_s=max(now, last.end_s if last is not None else now) - prev_t,
            layout=layout,
        )
        if problem:
            log.warning("not resuming on the job's layout in Redis: %s", problem)
        self.wall0 = now - prev_t / self.cfg.speed if self.cfg.speed > 0 else now
        log.warning(
            "job %s already ran to iteration %d (its history is in Redis: a restart): resuming "
            "at iteration %d on layout %d%s%s (a new --job-id, or `resihp up --fresh`, starts "
            "over)",
            self.keys.job_id,
            newest,
            sim.iteration,
            sim.layout.layout_id,
            f", ranks {sorted(layout.dead)} dead as it holds them"
            if layout and layout.dead
            else "",
            ", scenario events up to then taken as happened" if self.cfg.scenario else "",
        )

    def _register(self) -> bool:
        if self._registered:
            return True
        try:
            # a Redis that refuses our password (down when the CLI tried it) raises
            # RedisRefused: one line and exit 2, as the other services do, instead of
            # a warning every step for ever
            reached = entry.try_redis(self._write_registration, "trainer sim", self.client)
        except redis.RedisError as e:
            reached, why = False, str(e)
        else:
            why = f"Redis at {entry.redis_where(self.client)} cannot be reached"
        if not reached:
            self.redis_errors_total += 1
            # retried every step: an outage must not be a line per simulated iteration
            self._down_log.warning(
                "cannot register the job yet (%s); training goes on, telemetry is queued", why
            )
            return False
        self._registered = True
        self.health.beat("ok", layout_id=self.sim.layout.layout_id)
        return True

    def _write_registration(self) -> None:
        # what the collector must know to judge this job: the wall period its ranks are
        # heard at (the keeper's: the main loop beats at least as often), never shorter
        # than the configured period (a sped-up run beats more often in wall time, but
        # its loop stalls like any: judged at 0.5 s, the CI suite's speed-10 stacks had
        # a 3.75 s job-silence hold, where a 16k soak saw 4.1 s stalls) and that only
        # TP rank 0 of each group sends chunk rows above ``max_rank_report`` ranks
        register_running(
            self.client,
            self.keys,
            self.sim.layout,
            trainer="sim",
            heartbeat_interval_s=max(self._keeper.period_s, self.cfg.heartbeat_interval_s),
            reports_tp0_only=self.cfg.report_tp0_only,
        )

    def _check_registration(self) -> None:
        """Register the job again when Redis lost it (restarted without its data).

        Without the layout the scheduler refuses every failure report, and without the
        job set entry and state the job drops out of status and metrics.  One EXISTS per
        iteration boundary notices it; the layout is written only once it is gone."""
        if not self._registered:
            return
        try:
            if self.client.exists(self.keys.layout):
                return
        except redis.RedisError as e:
            self.redis_errors_total += 1
            log.warning("cannot check the job's registration (%s); retrying next boundary", e)
            return
        log.warning(
            "the job's layout is gone from Redis (restarted without its data?): "
            "registering the job again with layout %d",
            self.sim.layout.layout_id,
        )
        # plans of the lost data are gone with it, and the scheduler's plan ids may
        # start again at 1: an id applied before must not hide a new plan
        self.follower.applied.clear()
        self._registered = False
        self._register()

    def _sync_agents(self) -> None:
        """An agent for each node with a live device; the agents of nodes the scenario
        killed whole are closed (see the module doc)."""
        if self.redis_errors_total != self._agents_errors:  # Redis dropped them, maybe
            self._agents_errors = self.redis_errors_total
            self._close_agents()
        lay = self.sim.layout
        dpn = lay.devices_per_node
        cap = self.cfg.node_agents_max_nodes
        if not cap or -(-len(self.sim.alive) // dpn) > cap or is_cluster(self.client):
            # on a Redis Cluster a connection lives on one master and the collector's
            # CLIENT LIST reads another: liveness there is heartbeats only
            return
        live = set((np.flatnonzero(self.sim.alive) // dpn).tolist())
        for node in [n for n in self.agents if n not in live]:
            self.agents.pop(node).close()
        for node in sorted(live - self.agents.keys()):
            try:
                self.agents[node] = NodeAgent(None, self.cfg.job_id, node, like=self.client)
            except (redis.RedisError, OSError) as e:
                self._down_log.warning("node agents: cannot connect (%s); retrying", e)
                return

    def _close_agents(self) -> None:
        for agent in self.agents.values():
            agent.close()
        self.agents.clear()

    def close(self, stopped: bool = False) -> None:
        """``stopped``: the run was ended on purpose (a stop signal), not by a crash."""
        self._keeper.stop()
        self.producer.close()
        if self.done or stopped:
            try:  # ended on purpose: silence is not a failure
                if self.done:
                    set_job_state(self.client, self.keys, "finished", iterations=self.sim.iteration)
                elif job_state(self.client, self.keys) != "finished":
                    # `resihp up` marks it before it stops us: its reason is kept
                    set_job_state(
                        self.client,
                        self.keys,
                        "finished",
                        iterations=self.sim.iteration,
                        reason="trainer stopped",
                    )
            except redis.RedisError as e:
                log.warning("could not mark the job finished (%s)", e)
        if self._truth is not None:
            self._truth.close()
            self._truth = None
        self._close_agents()  # after the job state: the collector knows it ended

    def _record_truth(self, step: SimStep) -> None:
        if self._truth is not None:
            self._truth.write(json.dumps(step.true_state.to_dict(step.iteration)) + "\n")
            self._truth.flush()

    @property
    def done(self) -> bool:
        return self.cfg.iterations > 0 and self.sim.iteration >= self.cfg.iterations

    # ------------------------------------------------------------ pacing
    def _wall_at(self, t_s: float) -> float:
        return self.wall0 + t_s / self.cfg.speed

    def _sleep_until_sim(self, t_s: float, stop: threading.Event | None) -> None:
        if self.cfg.speed <= 0:
            return
        delay = self._wall_at(t_s) - time.time()
        if delay > 0:
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)

    def _backpressure(self, incoming: int) -> None:
        """Unpaced runs outpace any Redis: wait until the producer has room instead of dropping."""
        if self.cfg.speed > 0:
            return  # paced: an overloaded producer drops and counts, as a real trainer's would
        limit = self.producer.max_queue - incoming
        deadline = time.monotonic() + 60.0
        while self.producer.queued > max(0, limit) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _emit(self, step: SimStep, stop: threading.Event | None) -> int:
        """Replay the step: heartbeats at their times, then rows and stats at its end."""
        sent = 0
        self._record_truth(step)
        self._backpressure(len(step.heartbeats) + len(step.chunk_rows) + len(step.mb_stats))
        hb = step.heartbeats
        if len(hb):
            times = hb["wall_time_s"] - self.sim.epoch_s
            cuts = [0, *(np.flatnonzero(np.diff(times)) + 1).tolist(), len(hb)]
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                self._sleep_until_sim(float(times[a]), stop)
                self.producer.heartbeat_rows(hb[a:b])
                self._keeper.sent(hb[b - 1])
                sent += b - a
        self._sleep_until_sim(step.true_state.t_end_s, stop)
        if len(step.chunk_rows):
            self.producer.chunk_rows(step.chunk_rows)
            sent += len(step.chunk_rows)
        for m in mb_stats_messages(step.mb_stats):
            self.producer.mb_stats(m)
            sent += 1
        for p in step.probes:
            self.producer.send(p)
            sent += 1
        return sent

    # ------------------------------------------------------------ plans
    def _follow_plans(self, stop: threading.Event | None) -> int:
        """Apply the newest acknowledged plan; Redis trouble only postpones it."""
        try:
            self._confirm_pending()
            plans = self.follower.poll()
        except redis.RedisError as e:
            self.redis_errors_total += 1
            self._down_log.warning("plan poll failed (%s); retrying at the next boundary", e)
            return 0
        sent = 0
        for plan in plans:
            try:
                new = Layout.from_dict(plan.after)
            except (LayoutError, TypeError, ValueError) as e:
                problem = f"malformed layout: {e}"
            else:
                problem = self.sim.check_layout(new)
            if problem:
                # Never retried: a plan that cannot run is the scheduler's to replace.
                self.follower.applied.add(plan.plan_id)
                self.plans_refused_total += 1
                log.warning("plan %s refused: %s", plan.plan_id, problem)
                self._unconfirmed.append((plan, None, problem))
                try:
                    self._confirm_pending()
                except redis.RedisError:
                    self.redis_errors_total += 1
                continue
            step = self.sim.apply_layout(new, base_s=_pause_hint(plan))
            self._keeper.follow(self.sim)
            self.follower.applied.add(plan.plan_id)
            self._unconfirmed.append(
                (plan, new, f"sim reconfiguration {step.true_state.reconfig_s:.2f}s")
            )
            sent += self._emit(step, stop)
            self.plans_applied_total += 1
            log.info("applied plan %s (%s)", plan.plan_id, new.summary())
            self.last_step = step
            try:
                self._confirm_pending()
            except redis.RedisError as e:
                self.redis_errors_total += 1
                log.warning("plan %s applied, confirmation postponed (%s)", plan.plan_id, e)
        return sent

    def _confirm_pending(self) -> None:
        """Tell the scheduler, in order, what became of the plans taken up while Redis was
        away: applied (the layout and the ``applied`` action) or refused (``failed``)."""
        while self._unconfirmed:
            plan, layout, comment = self._unconfirmed[0]
            if layout is None:
                self.follower.report_not_applied(plan, comment)
                incr_counter(self.client, self.keys, "trainer_plans_refused_total")
            else:
                self.follower.confirm_applied(plan, layout, comment=comment)
                incr_counter(self.client, self.keys, "trainer_plans_applied_total")
            self._unconfirmed.pop(0)

    # ------------------------------------------------------------ loop
    def run_once(self, stop: threading.Event | None = None) -> int:
        """One step: plans at the boundary, then one iteration (or one hung interval)."""
        if not self.started or not self._registered:
            self.start()
        else:
            self._check_registration()
        sent = self._follow_plans(stop) if self._registered else 0
        step = self.sim.step()
        self._keeper.follow(self.sim)
        self._sync_agents()
        sent += self._emit(step, stop)
        self.steps_total += 1
        if step.true_state.status == "ok":
            self.iterations_total += 1
        elif step.true_state.status == "hung" and self.cfg.speed <= 0:
            # Unpaced and hung: give the scheduler wall time to answer.
            time.sleep(self.cfg.plan_poll_s)
        self.last_step = step
        self.health.beat(
            "ok",
            iteration=self.sim.iteration,
            state=step.true_state.status,
            layout_id=self.sim.layout.layout_id,
            dropped_total=self.producer.dropped_total,
        )
        return sent

    def run(self, stop: threading.Event | None = None) -> int:
        stop = stop or threading.Event()
        parent = os.getppid()
        self.start()
        ended = False
        try:
            while not stop.is_set() and not self.done:
                self.run_once(stop)
            ended = True
        finally:
            # Stopped by a signal (docker compose stop) is as much on purpose as finished:
            # a job left 'running' would be judged dead on every node and planned for.  A
            # crash stays 'running', its silence is a failure; so does a stop because the
            # process that started us died (`resihp up` killed with -9: the kernel's
            # parent-death signal), which is its crash, not an operator's stop.
            self.close(stopped=ended and os.getppid() == parent)
        return 0


class _BeatKeeper:
    """Heartbeats of the live ranks while the main loop sends none.

    The main loop replays each step's heartbeats at their simulated times; whatever
    holds it up (a plan poll, applying a plan, computing a big step, the producer's
    backpressure) would otherwise silence every rank at once, and the collector declare
    every node dead.  This thread beats for the ranks alive after the last step once the
    main loop has sent none for ``max(1.5 x the beat period, MIN_SILENCE_S)`` wall
    seconds, then once per period, until the main loop beats again.  Its beats carry the
    last beat's clock reading (the simulated clock stands while the loop is held up),
    sequence number and iteration, so that they add no tick the simulation did not make.
    They go through the producer like every beat: its bounded queue and counted drops.
    """

    #: Silence (wall seconds) the keeper lets pass before it beats: well inside the
    #: collector's fail-stop deadline (2.5 x ``period_s``, which the trainer announces
    #: in its job state), long enough that a paced run on schedule never needs it.
    MIN_SILENCE_S = 0.75
    #: Its beat period is the trainer's, but no shorter than this.
    MIN_PERIOD_S = 0.5
    #: It looks at the main loop's silence at least this often (wall seconds), however long
    #: the period: a long wait must stay within what ``Event.wait`` takes.
    MAX_WAIT_S = 60.0

    def __init__(self, trainer: SimTrainer):
        cfg = trainer.cfg
        iv = cfg.heartbeat_interval_s / cfg.speed if cfg.speed > 0 else cfg.heartbeat_interval_s
        self.period_s = max(iv, self.MIN_PERIOD_S)
        self.silence_s = max(1.5 * iv, self.MIN_SILENCE_S)
        self._trainer = weakref.ref(trainer)  # a trainer dropped unclosed stops it too
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_sent = time.monotonic()
        #: (ranks, nodes, generations, iteration): who beats, as of the last step
        self._live: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None
        #: (wall_time_s, seq) of the last beat the main loop sent
        self._clock: tuple[float, int] = (trainer.sim.epoch_s + trainer.sim.t_s, 0)
        self.follow(trainer.sim)

    def start(self) -> None:
        if self._thread is None:
            self._last_sent = time.monotonic()
            self._thread = threading.Thread(
                target=_BeatKeeper._run, args=(self,), name="sim-heartbeats", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def follow(self, sim: ClusterSim) -> None:
        """Take the live ranks from the simulation (main loop, after each step)."""
        live = np.flatnonzero(sim.alive)
        self._live = (
            live,
            live // sim.layout.devices_per_node,
            np.asarray(sim.generation)[live].copy(),
            int(sim.iteration),
        )

    def sent(self, last_row) -> None:
        """The main loop beat (``last_row``: its newest beat)."""
        self._clock = (float(last_row["wall_time_s"]), int(last_row["seq"]))
        self._last_sent = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(min(self.period_s / 4, self.silence_s / 4, self.MAX_WAIT_S)):
            if time.monotonic() - self._last_sent < self.silence_s:
                continue
            trainer = self._trainer()
            if trainer is None:
                return
            try:
                n = self._beat(trainer)
            except Exception:  # noqa: BLE001 - the keeper must outlive a bad beat
                log.exception("heartbeat keeper: beat failed")
                n = 0
            del trainer
            # once per period from now on, until the main loop beats again
            self._last_sent = time.monotonic() - self.silence_s + self.period_s
            if n:
                log.debug("heartbeat keeper: %d beats while the main loop was held up", n)

    def _beat(self, trainer: SimTrainer) -> int:
        live = self._live
        if live is None or not len(live[0]):
            return 0
        ranks, nodes, gens, iteration = live
        wall_s, seq = self._clock
        rows = np.zeros(len(ranks), dtype=HEARTBEAT_DTYPE)
        rows["rank"] = ranks
        rows["node"] = nodes
        rows["iteration"] = iteration
        rows["generation"] = gens
        rows["wall_time_s"] = wall_s
        rows["seq"] = seq
        n = trainer.producer.heartbeat_rows(rows)
        trainer.keepalive_beats_total += n
        return n


def _pause_hint(plan) -> float | None:
    """A plan may name its own rebuild pause: a move ``{"what": "reconfig", "pause_s": X}``."""
    for mv in plan.moves or []:
        if isinstance(mv, dict) and mv.get("what") == "reconfig":
            v = mv.get("pause_s")
            if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 3600:
                return float(v)
    return None

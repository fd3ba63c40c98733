"""One worker process: joins generation after generation of the job and trains.

A generation is a description the launcher writes to the persistent TCPStore
under ``gen/<g>`` (members, layout, reason).  The worker builds the default
process group from a store prefix fresh to that generation, creates every TP
and DP subgroup with an explicit timeout, agrees with the other members on
the last step all of them completed, moves state to the new layout
(:func:`state.redistribute`) and trains from there.

It leaves a generation in two ways:
* a communication error or timeout (a peer died): it keeps its in-memory
  state (parameters are only changed by an optimizer step, which runs after
  the iteration's commit all-reduce succeeded), reports the failure to the
  store and waits for the launcher's next generation;
* the commit all-reduce at the end of an iteration says a next generation is
  ready (a plan to apply): everyone switches after the same iteration.

Before building a generation's process group every member waits for the others
in a store barrier it can leave: a generation the launcher already replaced (a
member died before arriving) is given up at once instead of blocking in
``init_process_group``, and a rendezvous that fails or times out is a failed
generation, not a dead rank.  Between generations a worker waits as long as the
launcher is alive and says so (``launcher/beat`` changes; ``launcher/shutdown``
ends the wait), however long the launcher waits for a plan.

Scenario ``at_s`` events run on one job clock: ``job/t0``, the moment the first
generation started training, every member ready (set once, read by later ranks).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from resihp.keys import JobKeys
from resihp.lifetime import exit_with_parent, pid_alive
from resihp.topology import Layout

from .comm import ABORT, GenerationAborted, wait_work
from .config import TrainConfig
from .engine import StageEngine
from .model import ModelConfig, StageModule, WeightGradStore
from .parallel import abandon_process_groups, build_groups
from .state import (
    active_coords,
    clip_grads,
    grad_sq_partial,
    load_ckpt,
    load_state,
    local_state,
    make_optimizer,
    redistribute,
    save_ckpt,
    stage_layers,
    write_ckpt_layout,
)
from .telemetry import RankTelemetry, probe_seconds

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def model_config(cfg: TrainConfig) -> ModelConfig:
    return ModelConfig(
        hidden=cfg.hidden,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        ffn_hidden=cfg.ffn_hidden,
        seed=cfg.seed,
    )


def make_corpus(cfg: TrainConfig):
    from trainer.data.corpus import PackedCorpus

    return PackedCorpus(
        cfg.data_dir or None,
        cfg.token_budget,
        cfg.seed,
        cfg.data_pattern,
        token_budgets=cfg.budgets,
        repeat_index=cfg.repeat_microbatch,
    )


def _timeline(store, gen: int, event: str, rank: int) -> None:
    store.set(f"timeline/{gen}/{event}/{rank}", repr(time.time()))


#: Tests only: ``KIND:RANK@WHERE`` makes RANK fail in the generations WHERE names: ``gN``
#: (generation N) or ``L0,L1,...`` (every generation whose layout has that layer split, so
#: a plan's layout can fail while the others run).  KIND: ``raise`` (a RuntimeError before
#: the first iteration), ``die`` (SIGKILL there) or ``die-early`` (SIGKILL before meeting
#: the other members).  Several specs are separated by ``;``.
INJECT_ENV = "RESIHP_TORCH_INJECT"


def _injected(rank: int, gen: int, layout: Layout) -> set[str]:
    kinds = set()
    for spec in filter(None, os.environ.get(INJECT_ENV, "").split(";")):
        kind, _, rest = spec.partition(":")
        who, _, where = rest.partition("@")
        if int(who) != rank:
            continue
        if where.startswith("g"):
            hit = int(where[1:]) == gen
        else:
            hit = [int(x) for x in where.split(",")] == list(layout.layers)
        if hit:
            kinds.add(kind)
    return kinds


class LauncherWatch:
    """Is the launcher still there?  It refreshes ``launcher/beat`` while it runs (also
    while it waits for a plan, however long) and sets ``launcher/shutdown`` when it ends.
    A beat that has not changed for ``limit_s`` of this process's own time means the
    launcher is stuck or gone (its death alone also ends the workers: exit_with_parent)."""

    def __init__(self, store, limit_s: float):
        self.store = store
        self.limit_s = limit_s
        self.seen: bytes | None = None
        self.seen_at = time.monotonic()
        self.next_check = 0.0
        self.gone = False

    def check(self) -> bool:
        """True once the launcher ended or stopped beating (checked twice a second)."""
        now = time.monotonic()
        if self.gone or now < self.next_check:
            return self.gone
        self.next_check = now + 0.5
        if self.store.check(["launcher/shutdown"]):
            self.gone = True
            return True
        beat = self.store.get("launcher/beat") if self.store.check(["launcher/beat"]) else b""
        if beat != self.seen:
            self.seen, self.seen_at = beat, now
        elif now - self.seen_at > self.limit_s:
            self.gone = True
        return self.gone


class Worker:
    def __init__(self, rank: int, cfg: TrainConfig, store, watch_store=None, start_gen: int = 0):
        self.rank = rank
        self.start_gen = start_gen
        # A re-joined rank starts with no state; it gets all of it from its peers.
        self.fresh = start_gen > 0
        self.watch_store = watch_store
        self.cfg = cfg
        self.store = store
        self.mcfg = model_config(cfg)
        self.dtype = DTYPES[cfg.dtype]
        self.cuda = cfg.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )
        self.backend = cfg.backend if cfg.backend != "auto" else ("nccl" if self.cuda else "gloo")
        # gloo moves host tensors: with GPU compute, communication stages through the host
        # (lets several ranks share one GPU, which NCCL refuses).
        self.comm_device = self.device if self.backend == "nccl" else torch.device("cpu")
        if self.backend == "nccl":
            from . import comm

            comm.DIRECT_WAIT = True
        self.corpus = make_corpus(cfg)
        self.producer = None
        if cfg.redis_url and cfg.telemetry:
            from resihp.producer import TelemetryProducer

            self.producer = TelemetryProducer(cfg.redis_url, JobKeys(cfg.job_id)).start()
        self.agent = self._start_agent()
        self.tel = RankTelemetry(
            self.producer,
            rank,
            rank // cfg.devices_per_node,
            self.cuda,
            keep_rows=cfg.dump_telemetry,
        )
        self.tel.start_heartbeats(cfg.heartbeat_interval_s)
        self.steps_done = 0
        self.state: dict[str, torch.Tensor] = {}
        self.layout: Layout | None = None
        self.module = None
        self.opt = None
        self.cursor = None
        if cfg.scenario:
            from resihp.scenario import ScenarioCursor, load_scenario

            self.cursor = ScenarioCursor(load_scenario(cfg.scenario))
        self.t0: float | None = None  # the job clock's zero (job/t0), once training started
        # never shorter than 10 s: a launcher busy for a moment is not a launcher gone
        self.launcher = LauncherWatch(store, max(cfg.store_timeout_s, 10.0))
        self.tel_cost_prev_s = 0.0  # telemetry calls' cost in the previous iteration
        self.scn_compute_stretch = 1.0  # from slow_device events
        self.scn_link_delay_s = 0.0  # from slow_link events
        self.probe_ref_s: float | None = None  # this device's probe time while healthy
        # a restarted job's generation 0: the checkpointed step it continues from
        self.resume_step: int | None = None

    def _start_agent(self):
        """This rank's agent connection (resihp/liveness_agent.py), or None: its close when
        the process dies is the collector's sub-second fail-stop signal.  Never fatal:
        without it the rank is judged on its heartbeats."""
        cfg = self.cfg
        if not (cfg.redis_url and cfg.node_agents):
            return None
        import redis

        from resihp.liveness_agent import NodeAgent

        try:
            return NodeAgent(
                cfg.redis_url, cfg.job_id, self.rank // cfg.devices_per_node, rank=self.rank
            )
        except (redis.RedisError, OSError) as e:
            print(f"[rank {self.rank}] node agent: cannot connect ({e}); heartbeats only")
            return None

    # ---------------------------------------------------------------- main
    def run(self) -> int:
        gen = self.start_gen
        while True:
            desc = self._wait_gen(gen)
            if desc is None:
                return 3
            members = desc["members"]
            if self.rank not in members:
                return 0
            layout = Layout.from_dict(desc["layout"])
            # where the state lies: a rank that holds state knows its layout (the launcher's
            # prev_layout may name a generation this rank never entered); a fresh one
            # learns it from the launcher
            if desc.get("prev_layout") and self.layout is None:
                self.layout = Layout.from_dict(desc["prev_layout"])
            self.resume_step = desc.get("resume_step")
            if self.resume_step is not None:  # the checkpoint's layout, whatever was tried
                self.layout = Layout.from_dict(desc["prev_layout"])
            status = self._run_generation(gen, members, layout)
            if status == "done":
                self.tel.drain()
                if self.cfg.dump_telemetry and self.tel.kept:
                    np.save(
                        os.path.join(self.cfg.out_dir, f"chunks_rank{self.rank}.npy"),
                        np.concatenate(self.tel.kept),
                    )
                return 0
            gen += 1

    def _wait_gen(self, gen: int) -> dict | None:
        """Generation ``gen``'s description, as soon as the launcher wrote it; None when the
        launcher ended or stopped beating first.  No deadline of its own: the launcher may
        wait minutes for an operator's plan, and its survivors must still be there."""
        key = f"gen/{gen}"
        while True:
            if self.store.check([key]):
                return json.loads(self.store.get(key))
            if self.launcher.check():
                print(f"[rank {self.rank}] the launcher is gone or silent; stopping", flush=True)
                return None
            time.sleep(0.05)

    def _superseded(self, gen: int) -> bool:
        """A member failed in ``gen`` or the launcher replaced it (not at a boundary)."""
        if ABORT.is_set():
            return True
        if self.watch_store is not None:  # the watchdog thread checks the store
            return False
        if self.store.add(f"failed/{gen}", 0) > 0:
            return True
        nxt = f"gen/{gen + 1}"
        return self.store.check([nxt]) and not json.loads(self.store.get(nxt)).get("boundary")

    def _fail(self, gen: int, why: str) -> None:
        """Tell the launcher this generation failed without a death, and why."""
        self.store.set(f"failed_why/{gen}", f"rank {self.rank}: {why}"[:300])
        self.store.add(f"failed/{gen}", 1)

    def _rendezvous(self, gen: int, members: list[int]) -> bool:
        """Wait until every member of ``gen`` arrived; False (leave the generation) when it
        was abandoned meanwhile or the others did not come in time (then it failed)."""
        self.store.set(f"arrived/{gen}/{self.rank}", "1")
        keys = [f"arrived/{gen}/{r}" for r in members]
        limit_s = max(self.cfg.pg_timeout_s, self.cfg.store_timeout_s)
        deadline = time.monotonic() + limit_s
        while not self.store.check(keys):
            if self._superseded(gen) or self.launcher.check():
                print(
                    f"[rank {self.rank}] generation {gen} abandoned before it started", flush=True
                )
                return False
            if time.monotonic() > deadline:
                late = [r for r in members if not self.store.check([f"arrived/{gen}/{r}"])]
                why = f"rendezvous timeout: ranks {late} did not arrive within {limit_s:g} s"
                print(f"[rank {self.rank}] generation {gen} failed: {why}", flush=True)
                self._fail(gen, why)
                return False
            time.sleep(0.02)
        return True

    def _job_time(self) -> float:
        """Seconds of training since the job's first generation started training (0 before)."""
        if self.t0 is None and self.store.check(["job/t0"]):
            self.t0 = float(self.store.get("job/t0"))
        return 0.0 if self.t0 is None else time.time() - self.t0

    def _start_job_clock(self) -> None:
        """Every member is ready to train: the first generation that gets here starts the
        job clock (a member still building its stage must not find it running already)."""
        t = torch.tensor([time.time()], dtype=torch.float64, device=self.comm_device)
        wait_work(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
        if self.t0 is None:  # all propose the same moment; the first generation's stays
            self.t0 = float(self.store.compare_set("job/t0", "", repr(float(t.item()))))

    def _watch(self, gen: int, stop: threading.Event) -> None:
        """Abandon generation ``gen`` as soon as a member failed or the launcher
        wrote a failure generation (boundary switches wait for the commit)."""
        st = self.watch_store
        while not stop.wait(0.05):
            try:
                if st.add(f"failed/{gen}", 0) > 0:
                    ABORT.set()
                    return
                if st.check([f"gen/{gen + 1}"]):
                    if not json.loads(st.get(f"gen/{gen + 1}")).get("boundary"):
                        ABORT.set()
                        return
            except Exception as e:  # noqa: BLE001 - store gone: the launcher died; main loop will see it
                print(f"[rank {self.rank}] watchdog stopped: {e!r}", flush=True)
                return

    def _run_generation(self, gen: int, members: list[int], layout: Layout) -> str:
        ABORT.clear()
        stop = threading.Event()
        watchdog = None
        if self.watch_store is not None:
            watchdog = threading.Thread(target=self._watch, args=(gen, stop), daemon=True)
            watchdog.start()
        try:
            return self._generation(gen, members, layout)
        finally:
            stop.set()
            if watchdog is not None:
                watchdog.join(timeout=1)

    def _generation(self, gen: int, members: list[int], layout: Layout) -> str:
        cfg = self.cfg
        self.tel.generation = gen
        if "die-early" in _injected(self.rank, gen, layout):
            self._die()
        if not self._rendezvous(gen, members):
            return "failed"
        pg_store = dist.PrefixStore(f"pg/{gen}", self.store)
        timeout = timedelta(seconds=cfg.pg_timeout_s)
        try:
            # inside the try: a member that died after the rendezvous makes this time out,
            # which fails the generation; the survivors live on to the next one
            dist.init_process_group(
                self.backend,
                store=pg_store,
                rank=members.index(self.rank),
                world_size=len(members),
                timeout=timeout,
            )
            groups = build_groups(
                layout, members, self.rank, cfg.pg_timeout_s, stage_cpu=self.backend == "gloo"
            )
            _timeline(self.store, gen, "groups_rebuilt", self.rank)
            self._move_state(gen, members, layout, groups)
            _timeline(self.store, gen, "state_moved", self.rank)
            status = self._train(gen, members, layout, groups)
        except Exception as e:  # noqa: BLE001 - whatever it was, the launcher decides
            # A peer died or timed out: keep the last committed state, go to the next
            # generation.  Any other error fails the generation too (it is said, with its
            # reason, and the launcher retries a layout only a few times): a worker that
            # dies of it would be reported as a dead rank.
            if not isinstance(e, GenerationAborted):
                self._fail(gen, f"{type(e).__name__}: {str(e)[:200]}")
            print(
                f"[rank {self.rank}] generation {gen} failed: {type(e).__name__}: {str(e)[:200]}",
                flush=True,
            )
            if os.environ.get("RESIHP_TRAINER_DEBUG"):
                traceback.print_exc()
            if self.module is not None:
                self.state = local_state(self.module, self.opt)
            abandon_process_groups()
            return "failed"
        dist.destroy_process_group()
        return status

    # --------------------------------------------------------------- state
    def _move_state(self, gen: int, members: list[int], layout: Layout, groups) -> None:
        cfg = self.cfg
        coords = active_coords(layout)
        mine = float(2**40) if self.fresh else float(self.steps_done)
        t = torch.tensor([mine], device=self.comm_device)
        wait_work(dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True))
        step = int(t.item())
        if gen == 0 and self.resume_step is None:
            self.steps_done = step
        else:
            holders = None  # every member holds its old state
            if self.resume_step is not None:
                # A restarted job: nobody holds state; every shard comes from the checkpoint
                # of ``resume_step``, saved under the layout ``self.layout`` (prev_layout)
                step, self.state, holders = int(self.resume_step), {}, set()
            elif self.fresh:
                self.state = {}
            elif self.steps_done > step:  # committed one step more than a peer: roll back
                self.state = load_ckpt(cfg.ckpt, step, self.rank)
                self.steps_done = step
            elif self.module is not None:
                self.state = local_state(self.module, self.opt)
            if (self.resume_step is not None or self.fresh) and self.cursor is not None:
                # events before the restart, or before this rank re-joined, are history
                self.cursor.due(step - 1, self._job_time())
            new_state, info = redistribute(
                self.mcfg,
                self.layout,
                layout,
                members,
                self.rank,
                self.state,
                cfg.ckpt,
                step,
                self.dtype,
                self.comm_device,
                holders=holders,
            )
            self.store.set(f"moved/{gen}/{self.rank}", json.dumps(info))
            self.state = new_state
            self.fresh = False
        self.layout = layout
        self.module = self.opt = None
        # a standby member runs the commit of every iteration too: it must count from the
        # fleet's step (a re-joined rank parked as standby counted from 0, and at the next
        # generation the minimum over members rolled everyone back to a step 6 long gone)
        self.steps_done = step
        if self.rank not in coords:
            return
        d, s, j = coords[self.rank]
        self.store_wg = WeightGradStore()
        self.module = StageModule(
            self.mcfg,
            stage_layers(layout, s),
            first=s == 0,
            last=s == layout.pp - 1,
            tp=groups.tp,
            store=self.store_wg,
            dtype=self.dtype,
            init=not self.state,
        ).to(self.device)
        self.opt = make_optimizer(self.module, cfg.lr, cfg.weight_decay)
        if self.state:
            load_state(self.module, self.opt, self.state, step)
        self.steps_done = step
        self.tel.dp, self.tel.stage = d, s

    def _compute_stretch(self, it: int) -> float:
        """Injected compute slowdown of this rank at iteration ``it`` (1.0 = healthy)."""
        cfg = self.cfg
        flag = (
            cfg.slow_factor if self.rank == cfg.slow_rank and it >= cfg.slow_at_iteration else 1.0
        )
        return max(flag, self.scn_compute_stretch)

    def _probe(self, it: int) -> None:
        """Time the compute probe on this idle rank and report it (DeviceProbe)."""
        # injected slowdowns are emulated (the engine sleeps in proportion to compute),
        # so the probe is stretched the same way
        t = probe_seconds(self.device)
        # A GPU is compared with its own probe at launch.  CPU ranks share cores, so
        # their absolute probe times follow the other ranks' load (measured: a healthy
        # idle rank at 0.7x its launch time while the others train): there the
        # reference is this same measurement and only injected slowdowns show.
        ref = self.probe_ref_s if self.probe_ref_s is not None else t
        self.tel.probe(it, t * self._compute_stretch(it), ref)

    # ------------------------------------------------------------ failures
    def _die(self) -> None:
        self.store.set("timeline/kill", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def _apply_scenario(self, it: int) -> None:
        """Fire this rank's due scenario events (resihp/scenario.py format)."""
        from resihp.scenario import default_factor

        for ev in self.cursor.due(it, self._job_time()):
            if self.rank not in ev.targets(self.cfg.devices_per_node):
                continue
            print(f"[rank {self.rank}] scenario: {ev.describe()}", flush=True)
            f = (
                ev.factor
                if ev.factor is not None
                else (default_factor(ev.severity) if ev.severity else 1.0)
            )
            if ev.action in ("kill_device", "kill_node"):
                self._die()
            elif ev.action == "slow_device":
                self.scn_compute_stretch = 1.0 / f
            elif ev.action == "slow_link":
                self.scn_link_delay_s = (1.0 / f - 1.0) * self.cfg.link_base_delay_s
            elif ev.action == "recover":
                if ev.what in ("all", "compute"):
                    self.scn_compute_stretch = 1.0
                if ev.what in ("all", "link"):
                    self.scn_link_delay_s = 0.0
            else:  # rejoin: a dead process does not come back in this trainer
                print(f"[rank {self.rank}] scenario action {ev.action!r} not supported", flush=True)

    # --------------------------------------------------------------- train
    def _train(self, gen: int, members: list[int], layout: Layout, groups) -> str:
        cfg = self.cfg
        engine = None
        if self.module is not None:
            slow = cfg.slow_factor if self.rank == cfg.slow_rank else 1.0
            slow_comm = cfg.slow_comm_s if self.rank == cfg.slow_comm_rank else 0.0
            engine = StageEngine(
                groups,
                self.module,
                self.store_wg,
                self.corpus,
                self.tel,
                layout.schedule,
                self.device,
                slow,
                slow_comm,
                self.comm_device,
            )
        pg0 = members.index(self.rank) == 0
        first_done = False
        if cfg.probe_interval_iters and self.probe_ref_s is None and self.device.type == "cuda":
            self.probe_ref_s = probe_seconds(self.device)  # at launch, before any slowdown
        inject = _injected(self.rank, gen, layout)
        if "die" in inject:
            self._die()
        if "raise" in inject:
            raise RuntimeError(f"injected failure ({INJECT_ENV})")
        self._start_job_clock()
        for it in range(self.steps_done, cfg.iterations):
            self.tel.iteration = it
            if self.rank == cfg.kill_rank and it == cfg.kill_at_iteration:
                self._die()
            if self.cursor is not None:
                self._apply_scenario(it)
            self.tel.paused = cfg.telemetry_ab and it % 2 == 1
            tel_c0 = self.tel.cost_s
            if engine is not None:
                engine.slow_factor = self._compute_stretch(it)
                engine.slow_comm_s = slow_comm + self.scn_link_delay_s
                res = engine.run_iteration(it)
                engine.allreduce_grads()
                if cfg.dump_grads_dir and it == 0:
                    self._dump_grads(groups)
                contrib = res.loss_sum if (self.module.last and groups.tp_index == 0) else 0.0
                it_time = res.iteration_time_s
            else:
                contrib, it_time = 0.0, 0.0
                if cfg.probe_interval_iters and it % cfg.probe_interval_iters == 0:
                    self._probe(it)
            switch = 1.0 if pg0 and self.store.check([f"gen/{gen + 1}"]) else 0.0
            # Global gradient norm for clipping, riding on the commit all-reduce.  After
            # the DP all-reduce every replica that runs a stage holds that stage's whole
            # gradient (a replica may have lost a stage to migration): each counts 1/dp_size.
            gsq = (
                grad_sq_partial(self.module, groups.tp_index) / groups.dp_size
                if engine is not None and cfg.grad_clip_norm > 0
                else 0.0
            )
            # Commit point: once this succeeds every member has finished the iteration.
            t = torch.tensor(
                [contrib, switch, gsq, it_time], dtype=torch.float64, device=self.comm_device
            )
            t2 = torch.tensor(
                [it_time, self.tel_cost_prev_s], dtype=torch.float64, device=self.comm_device
            )
            w1 = dist.all_reduce(t[:3], async_op=True)
            w2 = dist.all_reduce(t2, op=dist.ReduceOp.MAX, async_op=True)
            wait_work(w1)
            wait_work(w2)
            if self.opt is not None:
                if cfg.grad_clip_norm > 0:
                    clip_grads(self.module, float(t[2]), cfg.grad_clip_norm)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                save_ckpt(cfg.ckpt, it + 1, self.rank, local_state(self.module, self.opt))
            if pg0:
                # the layout those files follow: what a restarted job resumes from
                write_ckpt_layout(cfg.ckpt, it + 1, layout)
            self.steps_done = it + 1
            if engine is not None:
                self.tel.flush()
                # Telemetry cost of this iteration (reported with the next commit).
                self.tel_cost_prev_s = self.tel.cost_s - tel_c0
            if pg0:
                with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "iteration": it,
                                "loss": float(t[0]),
                                "iteration_time_s": float(t2[0]),
                                "telemetry_cost_prev_s": float(t2[1]),
                                "generation": gen,
                                "layout_id": layout.layout_id,
                                "wall_time_s": time.time(),
                            }
                        )
                        + "\n"
                    )
            if pg0:
                self.store.set("progress/iteration", str(it + 1))
            if not first_done:
                _timeline(self.store, gen, "first_iteration_done", self.rank)
                first_done = True
            if t[1] > 0:
                self.state = local_state(self.module, self.opt) if self.module is not None else {}
                return "switch"
        return "done"

    def _dump_grads(self, groups) -> None:
        out = {n: p.grad.detach().cpu().clone() for n, p in self.module.named_parameters()}
        meta = {
            "tp_size": groups.tp.size,
            "tp_rank": groups.tp.rank,
            "dp": groups.dp,
            "stage": groups.stage,
        }
        os.makedirs(self.cfg.dump_grads_dir, exist_ok=True)
        torch.save(
            {"grads": out, "meta": meta},
            os.path.join(self.cfg.dump_grads_dir, f"rank_{self.rank}.pt"),
        )

    def close(self, left: bool = False) -> None:
        """Stop telemetry; ``left``: the rank ends on purpose (its agent says so)."""
        self.tel.stop()
        if self.producer is not None:
            self.producer.close()
        if self.agent is not None:
            self.agent.close(left=left)


def worker_entry(
    rank: int,
    cfg_dict: dict,
    host: str,
    port: int,
    start_gen: int = 0,
    env: dict | None = None,
    cwd: str | None = None,
    launcher_pid: int | None = None,
) -> None:
    """A rank's process (processes.py starts it from the launcher's forkserver, with the
    launcher's ``env`` and ``cwd`` of the moment)."""
    # a worker whose launcher is gone (killed -9 with its stack) has nobody to report to:
    # the kernel kills it when its parent dies (the forkserver, which ends with the
    # launcher); a launcher gone before that was set up is seen here
    if launcher_pid is None:  # started by hand: its parent is its launcher
        parent = mp.parent_process()
        launcher_pid = parent.pid if parent is not None else None
    exit_with_parent(None, signal.SIGKILL)
    if launcher_pid is not None and not pid_alive(launcher_pid):
        os.kill(os.getpid(), signal.SIGKILL)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    cfg = TrainConfig.from_dict(cfg_dict)
    torch.set_num_threads(cfg.threads_per_worker)
    to = timedelta(seconds=cfg.store_timeout_s)
    store = dist.TCPStore(host, port, is_master=False, timeout=to)
    # The watchdog thread gets its own connection.
    watch_store = dist.TCPStore(host, port, is_master=False, timeout=to)
    w = Worker(rank, cfg, store, watch_store, start_gen)
    code = None
    try:
        code = w.run()
    finally:
        # an exception is no leaving on purpose: the collector reports the rank dead
        w.close(left=code is not None)
    os._exit(code)

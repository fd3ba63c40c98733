"""Configuration of a torch-trainer job: a validated dataclass built from CLI args.

It travels to every worker process as a plain dict (``to_dict``), so every
field is a JSON-able scalar.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass, fields

from resihp.topology import Layout, LayoutError

from .schedule import SCHEDULES


@dataclass
class TrainConfig:
    """One job. Degrees give the launch layout; a plan may change it later."""

    redis_url: str = ""  # empty: no telemetry, no plan following
    job_id: str = "default"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    microbatches: int = 4  # per DP replica per iteration
    schedule: str = "1f1b"
    iterations: int = 20
    num_layers: int = 4
    hidden: int = 64
    num_heads: int = 4
    ffn_hidden: int = 192
    token_budget: int = 512  # N tokens per packed micro-batch
    token_budgets: str = ""  # comma list: draw N per micro-batch from these (predictor bench)
    repeat_microbatch: int = -1  # >= 0: every micro-batch is this one (timing noise floor)
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0  # global gradient-norm clipping (LLaMA's 1.0); 0 = off
    seed: int = 0
    data_dir: str = ""  # empty: the Python standard library sources
    data_pattern: str = "*.py"
    dtype: str = "float32"
    device: str = "cpu"  # cpu | cuda
    backend: str = "auto"  # auto (nccl on cuda, gloo on cpu) | gloo | nccl
    devices_per_node: int = 8
    pg_timeout_s: float = 30.0
    store_timeout_s: float = 120.0
    ckpt_dir: str = ""  # empty: <out_dir>/ckpt
    # a job restarted on its own checkpoints resumes from the newest complete step, in the
    # layout it was saved under; True deletes them and starts over
    fresh: bool = False
    out_dir: str = "runs/torch"
    telemetry: bool = True
    heartbeat_interval_s: float = 0.5
    # each rank process holds a named Redis connection (resihp/liveness_agent.py): killed,
    # its socket closes and the collector reports it within ~0.1 s, not after K beats
    node_agents: bool = True
    follow_plans: bool = True
    # after a death: wait this long for a scheduler plan before applying the local one.
    # Longer than the scheduler's default auto grace period (10 s) plus detection and
    # planning, so its plan arrives in time; `resihp up` passes its own from --mode and
    # --grace-period-s (manual mode: minutes, an operator decides)
    plan_wait_s: float = 30.0
    kill_rank: int = -1
    kill_at_iteration: int = -1
    # local plan on a death (no scheduler plan): exclude_replica | migrate | shrink_tp
    recovery_policy: str = "exclude_replica"
    rejoin_at_iteration: int = -1  # restart the dead ranks once training reaches it
    slow_rank: int = -1
    slow_factor: float = 1.0
    slow_at_iteration: int = 0
    slow_comm_rank: int = -1
    slow_comm_s: float = 0.0
    scenario: str = (
        ""  # resihp/scenario.py file (kill_device/kill_node/slow_device/slow_link/recover)
    )
    link_base_delay_s: float = 0.005  # slow_link factor f adds (1/f - 1) x this per P2P transfer
    dump_grads_dir: str = ""  # tests: dump gradients of iteration 0 before the step
    dump_telemetry: bool = False  # benches: each rank saves its chunk rows to out_dir
    telemetry_ab: bool = False  # benches: record chunks on even iterations only (A/B overhead)
    # standby ranks time a small matmul every N iterations (DeviceProbe), so the detector
    # sees a slow rank the scheduler set aside recover; 0 = never
    probe_interval_iters: int = 5
    threads_per_worker: int = 1

    def validate(self) -> TrainConfig:
        """Refuse, with one line naming the field, anything a worker would only trip over
        later (its crash reads as a rank failure) or that would be silently ignored."""
        for name in ("tp", "pp", "dp", "microbatches", "iterations", "num_layers", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_heads", "ffn_hidden", "threads_per_worker", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp & (self.tp - 1):
            raise ValueError(f"tp must be a power of two, got {self.tp}")
        if self.num_layers < self.pp:
            raise ValueError(f"num_layers ({self.num_layers}) must be >= pp ({self.pp})")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})"
            )
        if (self.hidden // self.num_heads) % 2:
            raise ValueError(
                f"head dimension hidden/num_heads = {self.hidden // self.num_heads} must be "
                "even (rotary embeddings)"
            )
        if self.num_heads % self.tp or self.ffn_hidden % self.tp:
            raise ValueError(f"tp={self.tp} must divide num_heads and ffn_hidden")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dtype not in ("float32", "float64", "bfloat16"):
            raise ValueError(f"dtype must be float32|float64|bfloat16, got {self.dtype!r}")
        if self.recovery_policy not in ("exclude_replica", "migrate", "shrink_tp"):
            raise ValueError(
                "recovery_policy must be exclude_replica, migrate or shrink_tp, "
                f"got {self.recovery_policy!r}"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("backend nccl needs device cuda")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        for n in [self.token_budget, *self.budgets]:
            if n < 2 or (n * self.hidden) % 8:
                raise ValueError(f"token budget {n}: must be >= 2 and N*hidden divisible by 8")
        if self.repeat_microbatch < -1:
            raise ValueError(
                f"repeat_microbatch must be -1 (off) or >= 0, got {self.repeat_microbatch}"
            )
        if self.data_dir and not os.path.isdir(self.data_dir):
            raise ValueError(f"data_dir {self.data_dir!r} is not a directory")
        for name in ("lr", "weight_decay", "grad_clip_norm", "link_base_delay_s"):
            _finite(self, name, lo=0.0)
        for name in ("pg_timeout_s", "store_timeout_s", "heartbeat_interval_s"):
            _finite(self, name, lo=0.0, strict=True)
        if not 0 <= self.plan_wait_s < float("inf"):
            raise ValueError(f"plan_wait_s must be a finite number >= 0, got {self.plan_wait_s}")
        if self.probe_interval_iters < 0:
            raise ValueError(f"probe_interval_iters must be >= 0, got {self.probe_interval_iters}")
        try:  # the launch layout itself (TP groups must fit in a node, sizes in range)
            Layout.uniform(
                self.tp,
                self.pp,
                self.dp,
                self.num_layers,
                self.microbatches,
                devices_per_node=self.devices_per_node,
                schedule=self.schedule,
            )
        except LayoutError as e:
            raise ValueError(
                f"no launch layout for tp={self.tp} pp={self.pp} dp={self.dp} "
                f"devices_per_node={self.devices_per_node}: {e}"
            ) from None
        # failure injection: -1 is off; anything else must name a rank of this job, and a
        # value without the flag that makes it act would be silently ignored
        for name in ("kill_rank", "slow_rank", "slow_comm_rank"):
            r = getattr(self, name)
            if r != -1 and not 0 <= r < self.world_size:
                raise ValueError(f"{name} {r} outside world of {self.world_size} (-1 turns it off)")
        for name in ("kill_at_iteration", "rejoin_at_iteration"):
            if getattr(self, name) < -1:
                raise ValueError(f"{name} must be -1 (off) or >= 0, got {getattr(self, name)}")
        if (self.kill_rank == -1) != (self.kill_at_iteration == -1):
            raise ValueError("kill_rank and kill_at_iteration go together: give both or neither")
        if self.kill_at_iteration >= self.iterations:
            raise ValueError(
                f"kill_at_iteration {self.kill_at_iteration} is past the last iteration "
                f"({self.iterations - 1})"
            )
        if not 1.0 <= self.slow_factor < float("inf"):
            raise ValueError(f"slow_factor must be a finite number >= 1, got {self.slow_factor}")
        _finite(self, "slow_comm_s", lo=0.0)
        if self.slow_at_iteration < 0:
            raise ValueError(f"slow_at_iteration must be >= 0, got {self.slow_at_iteration}")
        if self.slow_factor != 1.0 and self.slow_rank == -1:
            raise ValueError("slow_factor needs slow_rank (the rank to slow down)")
        if self.slow_comm_s and self.slow_comm_rank == -1:
            raise ValueError("slow_comm_s needs slow_comm_rank (the rank whose links to slow)")
        return self

    @property
    def budgets(self) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in self.token_budgets.split(",") if x.strip())
        except ValueError:
            raise ValueError(
                f"token_budgets must be a comma list of integers: {self.token_budgets!r}"
            ) from None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ckpt(self) -> str:
        return self.ckpt_dir or os.path.join(self.out_dir, "ckpt")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        return cls(**d)


def _finite(cfg: TrainConfig, name: str, lo: float, strict: bool = False) -> None:
    v = getattr(cfg, name)
    if not (math.isfinite(v) and (v > lo if strict else v >= lo)):
        raise ValueError(
            f"{name} must be a finite number {'>' if strict else '>='} {lo:g}, got {v}"
        )


HELP = {
    "tp": "tensor-parallel degree (power of two)",
    "pp": "pipeline stages",
    "dp": "data-parallel replicas",
    "microbatches": "micro-batches per replica per iteration",
    "grad_clip_norm": "clip the global gradient norm to this (0 = off)",
    "probe_interval_iters": "standby ranks time the compute probe every N iterations (0 = never)",
    "schedule": "pipeline schedule: gpipe | 1f1b | zbh1",
    "token_budget": "tokens N per packed micro-batch",
    "token_budgets": "comma list: draw each micro-batch's N from these",
    "data_dir": "directory of text files (default: the Python standard library sources)",
    "data_pattern": "file glob inside --data-dir",
    "device": "cpu | cuda",
    "backend": "auto (nccl on cuda, gloo on cpu) | gloo | nccl",
    "pg_timeout_s": "timeout of every process group, subgroups included",
    "out_dir": "metrics.jsonl, timeline.json and checkpoints go here",
    "ckpt_dir": "per-iteration checkpoints (default <out-dir>/ckpt); a restarted job resumes "
    "from the newest complete one, in the layout it was saved under",
    "fresh": "delete the checkpoints and start over instead of resuming them",
    "node_agents": "each rank holds a named Redis connection, so a killed rank is seen "
    "when it closes (needs --redis-url)",
    "follow_plans": "apply acknowledged scheduler plans (needs --redis-url)",
    "plan_wait_s": "after a rank dies, wait this long for the scheduler's plan before "
    "applying the local one (default 30 s: past the scheduler's 10 s grace period)",
    "kill_rank": "failure injection: SIGKILL this rank ...",
    "kill_at_iteration": "... at the start of this iteration",
    "recovery_policy": "own plan on a death: exclude_replica | migrate | shrink_tp",
    "rejoin_at_iteration": "restart the dead ranks once training reaches this iteration",
    "slow_rank": "failure injection: stretch this rank's compute ...",
    "slow_factor": "... by this factor (>= 1)",
    "slow_comm_rank": "failure injection: delay this rank's communication ...",
    "slow_comm_s": "... by this many seconds per operation",
    "scenario": "failure scenario file (resihp/scenario.py format)",
}


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer torch",
        description="Hybrid-parallel (TP x PP x DP) LLaMA-style trainer with ResiHP telemetry "
        "and online plan application.",
    )
    d = TrainConfig()
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    p.add_argument("--job-id", default=os.environ.get("RESIHP_JOB_ID", "default"))
    for f in fields(TrainConfig):
        if f.name in ("redis_url", "job_id"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        if isinstance(default, bool):
            p.add_argument(
                flag,
                type=_bool,
                nargs="?",
                const=True,  # a bare --fresh is --fresh true
                default=default,
                metavar="BOOL",
                help=HELP.get(f.name),
            )
        else:
            p.add_argument(flag, type=type(default), default=default, help=HELP.get(f.name))
    return p


def config_from_args(argv: list[str]) -> TrainConfig:
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns)).validate()

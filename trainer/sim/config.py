"""Cluster-simulator settings: a validated dataclass built from CLI arguments and the environment.

Every field is documented where it is declared; :meth:`SimConfig.validate`
raises ``ValueError`` naming the field on a bad value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass

from resihp.keys import validate_job_id
from resihp.pipeline.models import (
    MODEL_PRESETS,
    TABLE6_SAMPLES_PER_S,
    get_preset,
    table6_efficiency,
)
from resihp.pipeline.schedule import SCHEDULE_KINDS
from resihp.redis_client import check_url
from resihp.topology import Layout


@dataclass
class SimConfig:
    """All simulator settings.  Units are in the names."""

    # --- service plumbing -------------------------------------------------------
    #: Redis URL (default $REDIS_URL; None = the library default).
    redis_url: str | None = None
    #: Job the simulated trainer reports as.
    job_id: str = "default"
    #: TTL of the trainer's health key (seconds).
    health_ttl_s: float = 10.0

    # --- the job ------------------------------------------------------------------
    #: Model preset (resihp.pipeline.models.MODEL_PRESETS): layers, hidden, FLOPs.
    model: str = "llama2-7b"
    #: Parallel degrees; 0 takes the model's Table 3 setting.
    tp: int = 0
    pp: int = 0
    dp: int = 0
    #: Micro-batches per DP replica per iteration.
    microbatches: int = 8
    #: Token budget N of one packed micro-batch (4K-32K).
    seq_len: int = 4096
    #: Pipeline schedule: gpipe, 1f1b or zbh1.
    schedule: str = "1f1b"
    devices_per_node: int = 8
    #: Extra idle devices after the job's ranks (available to the scheduler as spares).
    spare_devices: int = 0
    #: Scales the calibrated FLOP rate (1.0 = A100 at ~50 % MFU); 0 = choose it so the
    #: Table 3 layout's fault-free throughput matches the paper's Table 6.
    efficiency: float = 1.0

    # --- running ----------------------------------------------------------------
    #: Time scale: 10 runs ten times faster than real time; 0 runs unpaced.
    speed: float = 1.0
    #: Stop after this many completed iterations (0 = run until stopped).
    iterations: int = 0
    #: Heartbeat period of every live rank, in training time (wall period = this / speed,
    #: at least 0.5 s: the heartbeat keeper's); announced in the job state, so the
    #: collector reports a silent host 2.5 wall periods after its last beat.  1 s, not
    #: the torch trainer's 0.5 s: at 16,384 GPUs beside 4 hogs (load ~20) the simulator's
    #: telemetry stalled 4.1 s, past the job-silence hold of 0.5 s beats (3 deadlines,
    #: 3.75 s), and all 2,048 nodes were declared dead (docs/operations.md, i24 third session).
    heartbeat_interval_s: float = 1.0
    #: Sigma of the lognormal noise on every chunk and transfer time.
    noise: float = 0.03
    seed: int = 0
    #: Failure scenario file (docs/scenario.md); empty = none.
    scenario: str = ""
    #: Append the hidden ground truth of every step here as JSON lines (empty = off).
    truth_out: str = ""
    #: Jobs with more ranks than this report chunk rows from TP rank 0 of each group only.
    max_rank_report: int = 4096
    #: Communication rows: "all" (RECV per P2P transfer + ALLREDUCE), "allreduce", "none".
    comm_rows: str = "all"
    #: What a RECV / ALLREDUCE row's start and end mean (docs/trace-format.md):
    #: "blocking" (posted until done, waiting for the peer included: what the torch
    #: trainer writes) or "transfer" (from the sender's end: the transfer alone).
    comm_timing: str = "blocking"

    # --- adaptation -------------------------------------------------------------
    #: Communicator rebuild when groups, layers or exclusions change (seconds, §8.3: < 2 s).
    reconfig_base_s: float = 1.5
    #: Cost of a plan that only changes micro-batch routing (seconds).
    reconfig_migration_s: float = 0.05
    #: Bytes of parameter + optimizer state moved per parameter (bf16 weights, fp32 master, Adam).
    state_bytes_per_param: float = 16.0
    #: What a fail-stop does when no plan comes: "wait" for the scheduler (the real
    #: behaviour, a hung job) or "drop_replica" (offline traces: restart without
    #: the replicas that lost a device, paying reconfig_base_s).
    fail_stop_policy: str = "wait"
    #: How often plans are polled while the job is hung (wall seconds).
    plan_poll_s: float = 0.25
    #: Every this many iterations each standby device times the compute probe
    #: (a DeviceProbe message), so a device set aside for being slow can be seen
    #: to recover; 0 = never.
    probe_interval_iters: int = 5
    #: The probe's duration on a healthy device (training-time seconds).
    probe_reference_s: float = 0.05
    #: Node agents (:mod:`resihp.liveness_agent`): the simulator holds one named Redis
    #: connection per node of a job of up to this many nodes, and closes it when the
    #: scenario kills the node's every device, so the collector reports it at once
    #: (sub-second) instead of after missed heartbeats.  Larger jobs run on heartbeats
    #: alone: the collector's CLIENT LIST (every ``agent_poll_s``, 0.1 s) grows with every
    #: client (1.3 ms at 128 agents, 130 ms at 2,048: longer than the poll period, on this
    #: 2-core box at load ~10), and one process holding 2,048 sockets passes the common
    #: open-file limit of 1,024.  0: none.
    node_agents_max_nodes: int = 256

    # ------------------------------------------------------------ checks
    def validate(self) -> SimConfig:
        try:
            validate_job_id(self.job_id)
        except ValueError as e:
            raise ValueError(f"job_id: {e}") from None
        if self.redis_url is not None:
            try:  # the client factory's own parse, so that `connect` cannot fail on it later
                check_url(self.redis_url)
            except ValueError as e:
                raise ValueError(f"redis_url: {e}") from None
        try:
            pre = get_preset(self.model)
        except ValueError as e:
            raise ValueError(f"model: {e}") from None
        self.model = pre.name
        for name in (
            "tp",
            "pp",
            "dp",
            "spare_devices",
            "iterations",
            "seed",
            "probe_interval_iters",
            "node_agents_max_nodes",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {v!r}")
        if self.tp and self.tp & (self.tp - 1):
            raise ValueError(f"tp: must be a power of two, got {self.tp}")
        if self.tp > self.devices_per_node:
            raise ValueError(f"tp: {self.tp} exceeds devices_per_node {self.devices_per_node}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches: must be an integer >= 1, got {self.microbatches!r}")
        if not isinstance(self.seq_len, int) or not 1024 <= self.seq_len <= 131072:
            raise ValueError(f"seq_len: must be an integer in [1024, 131072], got {self.seq_len!r}")
        kind = self.schedule.lower().replace("-", "").replace("_", "")
        if kind not in SCHEDULE_KINDS or kind == "interleaved":
            raise ValueError(f"schedule: must be gpipe, 1f1b or zbh1, got {self.schedule!r}")
        self.schedule = kind
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(f"devices_per_node: must be >= 1, got {self.devices_per_node!r}")
        if not 0 <= self.efficiency < math.inf:
            raise ValueError(
                f"efficiency: must be a finite number > 0, or 0 for Table 6, got {self.efficiency!r}"
            )
        if self.efficiency == 0 and pre.name not in TABLE6_SAMPLES_PER_S:
            raise ValueError(f"efficiency: 0 (Table 6) is not available for {pre.name}")
        # finite: an infinite heartbeat period crashed the heartbeat thread (the run went
        # on without heartbeats), an infinite speed or cost is no simulation
        for name in ("heartbeat_interval_s", "health_ttl_s", "plan_poll_s", "probe_reference_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(
                    f"{name}: must be a finite number > 0, got {getattr(self, name)!r}"
                )
        if not 0 <= self.speed < math.inf:
            raise ValueError(
                f"speed: must be a finite number >= 0 (0 = unpaced), got {self.speed!r}"
            )
        if not 0 <= self.noise <= 1:
            raise ValueError(f"noise: must be in [0, 1], got {self.noise!r}")
        if not isinstance(self.max_rank_report, int) or self.max_rank_report < 0:
            raise ValueError(
                f"max_rank_report: must be an integer >= 0, got {self.max_rank_report!r}"
            )
        if self.comm_timing not in ("blocking", "transfer"):
            raise ValueError(f"comm_timing: must be blocking or transfer, got {self.comm_timing!r}")
        if self.comm_rows not in ("all", "allreduce", "none"):
            raise ValueError(f"comm_rows: must be all, allreduce or none, got {self.comm_rows!r}")
        if self.fail_stop_policy not in ("wait", "drop_replica"):
            raise ValueError(
                f"fail_stop_policy: must be wait or drop_replica, got {self.fail_stop_policy!r}"
            )
        for name in ("reconfig_base_s", "reconfig_migration_s", "state_bytes_per_param"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(
                    f"{name}: must be a finite number >= 0, got {getattr(self, name)!r}"
                )
        if self.truth_out:
            why = _unwritable(self.truth_out)
            if why:
                raise ValueError(f"truth_out: cannot write {self.truth_out}: {why}")
        tp, dp, pp = self.parallel()
        if pp > pre.num_layers:
            raise ValueError(f"pp: {pp} stages exceed the {pre.num_layers} layers of {pre.name}")
        if tp * dp * pp > 1 << 20:
            raise ValueError(f"tp*dp*pp: {tp * dp * pp} ranks is more than the simulator supports")
        return self

    def parallel(self) -> tuple[int, int, int]:
        """(TP, DP, PP), Table 3 defaults filled in."""
        t, d, p = get_preset(self.model).table3_parallel
        return (self.tp or t, self.dp or d, self.pp or p)

    def initial_layout(self) -> Layout:
        tp, dp, pp = self.parallel()
        pre = get_preset(self.model)
        lay = Layout.uniform(
            tp, pp, dp, pre.num_layers, self.microbatches, self.devices_per_node, self.schedule
        )
        if self.spare_devices:
            lay.world_size += self.spare_devices
            lay.standby = list(range(tp * pp * dp, lay.world_size))
            lay.validate()
        return lay

    def flops_scale(self) -> float:
        """The efficiency factor, resolving 0 to the Table 6 calibration."""
        if self.efficiency > 0:
            return self.efficiency
        return table6_efficiency(self.model, self.seq_len, self.microbatches, self.schedule)

    @property
    def report_tp0_only(self) -> bool:
        tp, dp, pp = self.parallel()
        return tp * dp * pp > self.max_rank_report

    # ------------------------------------------------------------ CLI
    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        d = cls()
        p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
        p.add_argument("--job-id", default=os.environ.get("RESIHP_JOB_ID", "default"))
        p.add_argument("--model", default=d.model, help=f"one of {sorted(MODEL_PRESETS)}")
        for name in ("tp", "pp", "dp"):
            p.add_argument(f"--{name}", type=int, default=0, help="0 = the model's Table 3 setting")
        p.add_argument("--microbatches", type=int, default=d.microbatches)
        p.add_argument(
            "--seq-len",
            type=int,
            default=d.seq_len,
            help="token budget N, 1024-131072 (the paper uses 4096-32768)",
        )
        p.add_argument("--schedule", default=d.schedule, help="gpipe, 1f1b or zbh1")
        p.add_argument("--devices-per-node", type=int, default=d.devices_per_node)
        p.add_argument("--spare-devices", type=int, default=0)
        p.add_argument(
            "--efficiency",
            type=float,
            default=d.efficiency,
            help="FLOP-rate scale; 0 = match Table 6",
        )
        p.add_argument("--speed", type=float, default=d.speed, help="time scale (0 = unpaced)")
        p.add_argument("--iterations", type=int, default=0, help="0 = until stopped")
        p.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s)
        p.add_argument("--noise", type=float, default=d.noise)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--scenario", default="")
        p.add_argument("--max-rank-report", type=int, default=d.max_rank_report)
        p.add_argument(
            "--truth-out",
            default="",
            help="write each step's hidden ground truth here (JSON lines)",
        )
        p.add_argument("--comm-rows", default=d.comm_rows, choices=["all", "allreduce", "none"])
        p.add_argument(
            "--comm-timing",
            default=d.comm_timing,
            choices=["blocking", "transfer"],
            help="RECV/ALLREDUCE rows: blocking (wait included, as the torch trainer) or transfer",
        )
        p.add_argument("--reconfig-base-s", type=float, default=d.reconfig_base_s)
        p.add_argument("--reconfig-migration-s", type=float, default=d.reconfig_migration_s)
        p.add_argument(
            "--fail-stop-policy", default=d.fail_stop_policy, choices=["wait", "drop_replica"]
        )
        p.add_argument(
            "--probe-interval-iters",
            type=int,
            default=d.probe_interval_iters,
            help="standby devices time the compute probe every N iterations (0 = never)",
        )
        p.add_argument("--probe-reference-s", type=float, default=d.probe_reference_s)
        p.add_argument(
            "--node-agents-max-nodes",
            type=int,
            default=d.node_agents_max_nodes,
            help="hold a node agent connection per node for jobs of up to this many nodes "
            f"(sub-second fail-stop; {d.node_agents_max_nodes}; 0 = none)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimConfig:
        """From the CLI's arguments; a run (not ``--check-health``, which answers
        'unhealthy' itself) needs a Redis URL."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in vars(args).items() if k in names}
        if not kwargs.get("redis_url") and not getattr(args, "check_health", False):
            raise ValueError("redis_url: no Redis URL: pass --redis-url or set REDIS_URL")
        return cls(**kwargs).validate()


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be opened for appending (None: it can), without creating it."""
    if os.path.isdir(path):
        return "it is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "permission denied"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"no directory {parent}"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"permission denied in {parent}"

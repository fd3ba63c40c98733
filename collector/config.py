"""Collector settings: a validated dataclass built from CLI arguments and the environment.

Every field is documented where it is declared; :meth:`CollectorConfig.validate`
raises ``ValueError`` naming the field on a bad value.  The liveness rule's K
can also be changed on a running collector through field ``heartbeat_k`` of
the job's ``detector_config`` hash (the detector owns and seeds that hash);
the collector re-reads it on every liveness check and keeps its own value when
the field is absent or invalid.  ``--heartbeat-k`` given on the command line is
written to that field at start, so the flag is not overridden by a value an
earlier run left there.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass

from resihp.assembly import ASSEMBLY
from resihp.entry import parse_bool
from resihp.keys import DEFAULT_STREAM_MAXLEN, validate_job_id
from resihp.liveness import (
    DEADLINE_STRETCH_MAX,
    FIRST_BEAT_DEADLINES,
    JOB_SILENCE_HOLD_DEADLINES,
    MASS_LOSS_FRACTION,
)

#: The largest K the collector follows.  The detector validates field ``heartbeat_k``
#: of the detector_config hash and refuses more (detector/config.py keeps the same
#: bound: services do not import each other, and tests/test_detector_units.py holds
#: the two rules equal).  The collector is the service that acts on K, so a value the
#: detector refuses must not reach it: K=5000 at a 1 s interval reports a dead rank
#: after 83 minutes, while ``config show`` says the old K is in force.
MAX_HEARTBEAT_K = 1000

# ASCII digits only: int() also takes "+5", "1_000" and non-ASCII digits ("٣")
_K_RE = re.compile(r"[0-9]+")


def parse_heartbeat_k(raw: str | bytes) -> int:
    """K from the detector_config hash's string; ValueError for anything the detector
    refuses (not ASCII digits, below 1 or above :data:`MAX_HEARTBEAT_K`)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    text = text.strip()
    neg = text.startswith("-")
    if not _K_RE.fullmatch(text[neg:]):
        raise ValueError(f"not an integer: {text!r}")
    # past the bound by its length alone (and int() refuses more than 4300 digits)
    k = int(text) if not neg and len(text.lstrip("0")) <= len(str(MAX_HEARTBEAT_K)) else None
    if k is None or not 1 <= k <= MAX_HEARTBEAT_K:
        got = text if len(text) <= 12 else text[:12] + "..."
        raise ValueError(f"must be an integer in [1, {MAX_HEARTBEAT_K}] (got {got})")
    return k


@dataclass
class CollectorConfig:
    """All collector settings.  Units are in the names."""

    # --- service plumbing -------------------------------------------------------
    #: Redis URL (default $REDIS_URL).
    redis_url: str | None = None
    #: Job whose telemetry is collected.
    job_id: str = "default"
    #: Instance name; the consumer name in the group is ``collector-<instance>`` so
    #: a restarted collector re-reads its own unacknowledged entries at once.
    instance: str = "0"
    #: Telemetry stream entries read per loop (each entry packs many events).
    read_count: int = 256
    #: How long one read blocks when nothing is pending (milliseconds).
    block_ms: int = 50
    #: Entries pending this long on a consumer are taken over (XAUTOCLAIM).  It
    #: must exceed the time an entry waits for its iteration to be published,
    #: because entries are acknowledged only then.
    claim_idle_ms: int = 120_000
    #: TTL of the collector's health key (seconds).
    health_ttl_s: float = 10.0
    #: How often the layout key is re-read (seconds); a change is only parsed.
    layout_poll_s: float = 0.5

    # --- liveness (§5.1) -----------------------------------------------------------
    #: Heartbeat period of the trainer ranks (seconds): until the trainer announces its
    #: own in the job state (``follow_trainer_interval``), or always.
    heartbeat_interval_s: float = 1.0
    #: Follow the heartbeat period the trainer announces in its job state (the torch
    #: trainer says 0.5 s: a silent rank is reported after 1.25 s, not 2.5 s); False:
    #: ``heartbeat_interval_s`` always.  ``--heartbeat-interval-s`` given on the command
    #: line sets this False (the operator's period is kept).
    follow_trainer_interval: bool = True
    #: Consecutive missed beats that make a rank (or, for a silent node monitor,
    #: a whole node) fail-stopped.
    heartbeat_k: int = 2
    #: Slack, in beats, before a late beat counts as missed.
    jitter_beats: float = 0.5
    #: How often liveness is judged (seconds); default a quarter interval.
    check_interval_s: float | None = None
    #: When every node still alive goes quiet together (a stall of the trainer process,
    #: its host or the path to Redis), the node verdicts wait this many more fail-stop
    #: deadlines, and the job is said to be silent meanwhile; a silence that outlasts
    #: them makes the nodes dead as usual.  With the defaults a whole job that dies is
    #: reported 3 deadlines (7.5 s) after its last beat; a node or a subset of nodes
    #: dying while another node talks keeps the one-deadline (2.5 s) latency.  0: no hold.
    job_silence_hold_deadlines: float = JOB_SILENCE_HOLD_DEADLINES
    #: Nodes dying within one deadline of each other that make up at least this fraction
    #: of the nodes alive (and at least ``MASS_LOSS_MIN_NODES``) are a suspect mass loss:
    #: their verdicts wait the same hold, and are confirmed only if still silent after
    #: it with this collector caught up on the stream (:mod:`resihp.liveness`).
    mass_loss_fraction: float = MASS_LOSS_FRACTION
    #: A rank (or node) not heard once since the layout expected it gets this many
    #: fail-stop deadlines for its first beat (ranks start seconds apart under load;
    #: :data:`resihp.liveness.FIRST_BEAT_DEADLINES`); heard once, the deadline alone.
    first_beat_deadlines: float = FIRST_BEAT_DEADLINES
    #: The fail-stop deadline stretches with the jitter the job's beats show (1.5 x the
    #: longest gap of a live node over the last minute) up to this many times the static
    #: deadline; 1 keeps it static (:mod:`resihp.liveness`, "Late or silent").
    deadline_stretch_max: float = DEADLINE_STRETCH_MAX
    #: How often the node agents' named connections are looked up (CLIENT LIST): a node
    #: whose agent connection closed is dead at once (:mod:`resihp.liveness_agent`);
    #: 0 turns it off (seconds).
    agent_poll_s: float = 0.1

    # --- telemetry retention ---------------------------------------------------------
    #: The telemetry stream is trimmed behind its slowest consumer group (nothing any
    #: group has not acknowledged, or not yet read, is removed), keeping this many
    #: seconds of entries before the newest one the collector read, for a
    #: ``resihp record`` (plain XREAD/XRANGE, no group) started a moment later (seconds).
    telemetry_keep_s: float = 60.0
    #: ...and at most about this many MB of them: the window shrinks to
    #: ``telemetry_keep_mb`` / the stream's byte rate as the collector reads it.  A
    #: 16k-GPU trainer that sends every rank's chunk rows (3.1M rows of 44 B per iteration)
    #: writes ~15 MB/s at 9 s iterations, so 60 s alone would keep ~1 GB in Redis (MB).
    telemetry_keep_mb: float = 256.0
    #: How often the collector trims the telemetry stream (seconds).
    telemetry_trim_every_s: float = 5.0
    #: Per-producer quota at the collector's boundary (``bus.ProducerQuota``; a producer
    #: is one lane of a trainer process, its ``s`` field): entries per second of Redis
    #: arrival time beyond it are refused unread, counted (``telemetry_refused_total``)
    #: and summed in one dead letter per producer and second.  The 16,384-GPU simulator's
    #: bulk lane sends 16 entries/s (3.1 MB/s) on average, at most 64 entries in a second
    #: and 240 (46 MB) in 10 s (``bench/soak.py``'s stream); 0 turns the quota off.
    producer_quota_entries_per_s: float = 500.0
    #: ...and bytes per second of one producer (MB/s; 0: no byte budget).
    producer_quota_mb_per_s: float = 64.0
    #: The quota's buckets hold this many seconds of it: a burst after a pause (seconds).
    producer_quota_burst_s: float = 10.0

    # --- iteration assembly -------------------------------------------------------
    #: After every expected rank has started a later iteration, wait this long for
    #: missing rows before publishing the iteration as incomplete (seconds).
    grace_s: float = ASSEMBLY.grace_s
    #: Publish an iteration as incomplete when none of its rows arrived for this
    #: long (a dead rank stalls its peers) (seconds).
    stale_s: float = ASSEMBLY.stale_s
    #: At most this many iterations are assembled at once; the oldest is
    #: published incomplete beyond it.
    max_open_iterations: int = ASSEMBLY.max_open
    #: When the layout changes, an open iteration that got no row for this long is
    #: the attempt a fail-stop abandoned: it is published incomplete at once, and
    #: its re-run under the new layout is assembled afresh (seconds).
    stall_s: float = ASSEMBLY.stall_s
    #: Once every expected rank has reported all its compute chunks of an iteration,
    #: wait at most this long for the communication rows (RECV, ALLREDUCE, ...) its
    #: ranks sent for the previous iteration before publishing it complete anyway (a
    #: rank that stopped sending them must not hold records back); 0 publishes at
    #: compute-complete and leaves most communication rows late (seconds).
    comm_wait_s: float = ASSEMBLY.comm_wait_s
    #: A rank whose clock is off Redis's by more than this (estimated from its
    #: heartbeats: send time vs arrival) has its chunk timestamps shifted onto Redis's
    #: clock, so that one skewed node does not stretch every iteration's span
    #: (seconds; smaller offsets are left, they are within network and batching delay).
    clock_skew_correct_s: float = 0.25
    #: Drop chunk rows of non-zero TP indices on arrival (less work, but no
    #: per-rank view inside a TP group).
    tp_dedup: bool = False

    # --- outputs -----------------------------------------------------------------
    #: Approximate MAXLEN of the iterations stream.
    iterations_maxlen: int = 2_000
    #: ...and at most about this many MB of records in it: a 16,384-GPU job's record is
    #: ~13 MB, so its stream keeps ~80 iterations instead of 2,000 (26 GB).
    iterations_budget_mb: float = 1024.0
    #: Approximate MAXLEN of the liveness stream.
    liveness_maxlen: int = DEFAULT_STREAM_MAXLEN

    def __post_init__(self) -> None:
        self.validate()

    @property
    def check_every_s(self) -> float:
        return (
            self.check_interval_s
            if self.check_interval_s is not None
            else self.heartbeat_interval_s / 4
        )

    def validate(self) -> None:
        try:
            validate_job_id(self.job_id)
        except ValueError as e:
            raise ValueError(f"job_id: {e}") from e
        positive = (
            "heartbeat_interval_s",
            "health_ttl_s",
            "layout_poll_s",
            "grace_s",
            "stale_s",
            "stall_s",
            "clock_skew_correct_s",
            "iterations_budget_mb",
            "telemetry_trim_every_s",
            "telemetry_keep_mb",
            "producer_quota_burst_s",
        )
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v < math.inf:
                raise ValueError(f"{name}: must be a finite number > 0, got {v!r}")
        ints_min = {
            "heartbeat_k": 1,
            "read_count": 1,
            "block_ms": 0,
            "claim_idle_ms": 1,
            "max_open_iterations": 1,
            "iterations_maxlen": 1,
            "liveness_maxlen": 1,
        }
        for name, lo in ints_min.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name}: must be an integer >= {lo}, got {v!r}")
        if self.heartbeat_k > MAX_HEARTBEAT_K:
            # written to the detector_config hash at start, where the detector refuses it
            raise ValueError(
                f"heartbeat_k: must be an integer <= {MAX_HEARTBEAT_K}, got {self.heartbeat_k!r}"
            )
        for name in (
            "comm_wait_s",
            "job_silence_hold_deadlines",
            "telemetry_keep_s",
            "producer_quota_entries_per_s",
            "producer_quota_mb_per_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < math.inf:
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
        for name in ("first_beat_deadlines", "deadline_stretch_max"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 1 <= v < math.inf:
                raise ValueError(f"{name}: must be a finite number >= 1, got {v!r}")
        v = self.agent_poll_s
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < math.inf:
            raise ValueError(f"agent_poll_s: must be a finite number >= 0, got {v!r}")
        v = self.mass_loss_fraction
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v <= 1:
            raise ValueError(f"mass_loss_fraction: must be in (0, 1], got {v!r}")
        if not isinstance(self.jitter_beats, int | float) or not 0 <= self.jitter_beats < 1:
            raise ValueError(f"jitter_beats: must be in [0, 1), got {self.jitter_beats!r}")
        if self.check_interval_s is not None and not (
            0 < self.check_interval_s <= self.heartbeat_interval_s
        ):
            raise ValueError(
                f"check_interval_s: must be in (0, heartbeat_interval_s], got {self.check_interval_s!r}"
            )
        if not isinstance(self.follow_trainer_interval, bool):
            raise ValueError(
                f"follow_trainer_interval: must be a bool, got {self.follow_trainer_interval!r}"
            )
        if not isinstance(self.tp_dedup, bool):
            raise ValueError(f"tp_dedup: must be a bool, got {self.tp_dedup!r}")
        if not isinstance(self.instance, str) or not self.instance:
            raise ValueError(f"instance: must be a non-empty string, got {self.instance!r}")

    # ------------------------------------------------------------ construction
    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
        p.add_argument("--job-id", default=os.environ.get("RESIHP_JOB_ID", "default"))
        p.add_argument("--instance", default=os.environ.get("RESIHP_COLLECTOR_INSTANCE", "0"))
        p.add_argument(
            "--heartbeat-interval-s",
            type=float,
            default=None,
            help=f"the ranks' heartbeat period, kept whatever the trainer announces (not given: "
            f"{cls.heartbeat_interval_s:g} s until the trainer announces its own)",
        )
        p.add_argument(
            "--heartbeat-k",
            type=int,
            default=None,
            help=f"missed beats before fail-stop ({cls.heartbeat_k}); given, it is also "
            "written to the job's detector_config hash, which the collector follows",
        )
        p.add_argument("--grace-s", type=float, default=cls.grace_s)
        p.add_argument("--stale-s", type=float, default=cls.stale_s)
        p.add_argument(
            "--comm-wait-s",
            type=float,
            default=cls.comm_wait_s,
            help="after an iteration's compute chunks are all in, wait at most this long for "
            f"its communication rows ({cls.comm_wait_s})",
        )
        p.add_argument("--max-open-iterations", type=int, default=cls.max_open_iterations)
        p.add_argument(
            "--tp-dedup",
            action="store_true",
            default=None,  # not given: $RESIHP_COLLECTOR_TP_DEDUP, read by from_args
            help="drop chunk rows of non-zero TP indices on arrival "
            "(default $RESIHP_COLLECTOR_TP_DEDUP: 1/true/yes/on or 0/false/no/off)",
        )
        p.add_argument(
            "--job-silence-hold-deadlines",
            type=float,
            default=cls.job_silence_hold_deadlines,
            help="when every node goes quiet together, hold the node verdicts this many more "
            f"fail-stop deadlines ({cls.job_silence_hold_deadlines:g}; 0: no hold)",
        )
        p.add_argument(
            "--agent-poll-s",
            type=float,
            default=cls.agent_poll_s,
            help="how often node agents' connections are looked up; a node whose agent "
            f"disconnected is dead at once ({cls.agent_poll_s:g} s; 0: off)",
        )
        p.add_argument(
            "--telemetry-keep-s",
            type=float,
            default=cls.telemetry_keep_s,
            help="keep at least this many seconds of telemetry when trimming the stream "
            f"behind its consumer groups ({cls.telemetry_keep_s:g})",
        )
        p.add_argument(
            "--telemetry-keep-mb",
            type=float,
            default=cls.telemetry_keep_mb,
            help="...and at most about this many MB of it (the window shrinks to this over "
            f"the stream's byte rate; {cls.telemetry_keep_mb:g})",
        )
        p.add_argument(
            "--producer-quota-entries-per-s",
            type=float,
            default=cls.producer_quota_entries_per_s,
            help="entries per second one producer may send; the excess is refused unread, "
            f"counted and dead-lettered in summary ({cls.producer_quota_entries_per_s:g}; 0: off)",
        )
        p.add_argument(
            "--producer-quota-mb-per-s",
            type=float,
            default=cls.producer_quota_mb_per_s,
            help=f"...and MB per second ({cls.producer_quota_mb_per_s:g}; 0: no byte budget)",
        )
        p.add_argument(
            "--producer-quota-burst-s",
            type=float,
            default=cls.producer_quota_burst_s,
            help=f"seconds of the quota a producer may spend at once ({cls.producer_quota_burst_s:g})",
        )
        p.add_argument("--read-count", type=int, default=cls.read_count)
        p.add_argument("--iterations-maxlen", type=int, default=cls.iterations_maxlen)
        p.add_argument("--iterations-budget-mb", type=float, default=cls.iterations_budget_mb)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> CollectorConfig:
        tp_dedup = a.tp_dedup
        if tp_dedup is None:
            env = os.environ.get("RESIHP_COLLECTOR_TP_DEDUP", "")
            tp_dedup = parse_bool(env, "tp_dedup (RESIHP_COLLECTOR_TP_DEDUP)")
        return cls(
            redis_url=a.redis_url,
            job_id=a.job_id,
            instance=a.instance,
            heartbeat_interval_s=cls.heartbeat_interval_s
            if a.heartbeat_interval_s is None
            else a.heartbeat_interval_s,
            follow_trainer_interval=a.heartbeat_interval_s is None,
            heartbeat_k=cls.heartbeat_k if a.heartbeat_k is None else a.heartbeat_k,
            grace_s=a.grace_s,
            stale_s=a.stale_s,
            comm_wait_s=a.comm_wait_s,
            max_open_iterations=a.max_open_iterations,
            tp_dedup=tp_dedup,
            job_silence_hold_deadlines=a.job_silence_hold_deadlines,
            agent_poll_s=a.agent_poll_s,
            telemetry_keep_s=a.telemetry_keep_s,
            telemetry_keep_mb=a.telemetry_keep_mb,
            producer_quota_entries_per_s=a.producer_quota_entries_per_s,
            producer_quota_mb_per_s=a.producer_quota_mb_per_s,
            producer_quota_burst_s=a.producer_quota_burst_s,
            read_count=a.read_count,
            iterations_maxlen=a.iterations_maxlen,
            iterations_budget_mb=a.iterations_budget_mb,
        )

    def replace(self, **changes) -> CollectorConfig:
        return dataclasses.replace(self, **changes)

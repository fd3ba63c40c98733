"""Every Redis stream and key name used by the stack, in one place.

All names are namespaced by a job id so that one Redis, one set of services and
one dashboard can watch several training jobs at once.  Services never build a
key string themselves; they ask a :class:`JobKeys` for it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from redis.crc import REDIS_CLUSTER_HASH_SLOTS as SLOTS
from redis.crc import key_slot

PREFIX = "resihp"
#: Set of every job id that has ever reported into this Redis.
JOBS_SET = f"{PREFIX}:jobs"


def dashboard_session(session_id: str) -> str:
    """A dashboard operator's server-side session (a hash with a TTL; logout deletes it)."""
    return f"{PREFIX}:dashboard:session:{session_id}"


def watcher_health(service: str, host: str, pid: int) -> str:
    """Health key of one process serving every job (``--all-jobs``, ``resihp.stack.jobwatch``);
    the only per-service keys outside a job's namespace."""
    return f"{PREFIX}:watchers:{service}:{host}:{pid}"


def watcher_health_pattern(service: str = "*", host: str = "*") -> str:
    return f"{PREFIX}:watchers:{service}:{host}:*"


def health_pattern(service: str) -> str:
    """Every job's health keys of ``service`` (any instance)."""
    return f"{PREFIX}:{{*}}:health:{service}:*"


def job_of_key(key: bytes | str) -> str:
    """The job id of a key under a job's namespace (``resihp:{JOB}:...``)."""
    text = key.decode() if isinstance(key, bytes) else key
    return text[len(PREFIX) + 2 : text.index("}:")]


_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

#: Default approximate cap on stream lengths (XADD MAXLEN ~).
DEFAULT_STREAM_MAXLEN = 100_000


def validate_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id):
        raise ValueError(
            f"invalid job id {job_id!r}: use 1-64 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return job_id


@dataclass(frozen=True)
class JobKeys:
    """Stream and key names of one training job."""

    job_id: str

    def __post_init__(self) -> None:
        validate_job_id(self.job_id)

    @property
    def base(self) -> str:
        return f"{PREFIX}:{{{self.job_id}}}"

    # --- streams written by trainer ranks (through the producer) ---
    @property
    def telemetry(self) -> str:
        """Heartbeats, packed chunk timings and micro-batch stats from trainer ranks."""
        return f"{self.base}:telemetry"

    # --- streams written by services ---
    @property
    def iterations(self) -> str:
        """IterationRecord messages assembled by the collector."""
        return f"{self.base}:iterations"

    @property
    def liveness(self) -> str:
        """LivenessEvent messages: the collector's fail-stop / re-join decisions."""
        return f"{self.base}:liveness"

    @property
    def failures(self) -> str:
        """FailureReport messages from the detector."""
        return f"{self.base}:failures"

    @property
    def plans(self) -> str:
        """AdaptationPlan messages (every state change is a new entry)."""
        return f"{self.base}:plans"

    @property
    def actions(self) -> str:
        """OperatorAction messages: acknowledge / override / reject, and trainer confirmations."""
        return f"{self.base}:actions"

    @property
    def deadletter(self) -> str:
        """Entries that failed validation, with the reason and the consumer that refused them."""
        return f"{self.base}:deadletter"

    @property
    def audit(self) -> str:
        """Append-only audit log of operator actions (who, when, what)."""
        return f"{self.base}:audit"

    @property
    def layouts(self) -> str:
        """Every layout the trainer wrote to ``layout``, in order (field ``layout``, JSON):
        which layout was in force when, for traces recorded after the fact."""
        return f"{self.base}:layouts"

    @property
    def override_previews(self) -> str:
        """List of OverridePreviewRequest JSON (RPUSH by the dashboard, LPOP by the
        scheduler): "what would this override do?", answered without changing a plan."""
        return f"{self.base}:override_previews"

    def override_preview(self, request_id: str) -> str:
        """The scheduler's OverridePreviewReply to request ``request_id`` (JSON, with a TTL)."""
        return f"{self.base}:override_preview:{request_id}"

    @property
    def layout_predictions(self) -> str:
        """Hash layout_id -> JSON {predicted_healthy_s, iteration, at_s}: the DAG-predicted
        healthy iteration time of each layout the job ran, written by the collector once per
        layout, so charts draw the prediction for iterations of layouts long replaced."""
        return f"{self.base}:layout_predictions"

    # --- plain keys ---
    @property
    def layout(self) -> str:
        """Current topology layout (JSON), written by the trainer (``plans.write_layout``: at
        start and after applying a plan); the scheduler only reads it."""
        return f"{self.base}:layout"

    @property
    def plan_state(self) -> str:
        """Hash plan_id -> latest AdaptationPlan JSON (survives scheduler restarts)."""
        return f"{self.base}:plan_state"

    @property
    def plan_seq(self) -> str:
        """Monotonic plan id counter (INCR)."""
        return f"{self.base}:plan_seq"

    @property
    def reconfig_seq(self) -> str:
        """Monotonic reconfiguration id counter (INCR), one per applied plan."""
        return f"{self.base}:reconfig_seq"

    @property
    def detector_config(self) -> str:
        """Hash of runtime-tunable detector settings (changed without restart)."""
        return f"{self.base}:detector_config"

    @property
    def scheduler_handled(self) -> str:
        """Sorted set of the report and action ids the scheduler has handled (score: when),
        written in the same transaction as their plans, so that a message re-delivered
        after a crash is not handled twice."""
        return f"{self.base}:scheduler_handled"

    @property
    def scheduler_speeds(self) -> str:
        """Hash rank -> normalized throughput p the scheduler learned from failure reports
        (0 dead, <1 slow, a recovery's p): it outranks device_health and survives a restart."""
        return f"{self.base}:scheduler_speeds"

    @property
    def scheduler_config(self) -> str:
        """Hash of runtime-tunable scheduler settings (mode, grace period)."""
        return f"{self.base}:scheduler_config"

    @property
    def device_health(self) -> str:
        """Hash rank -> JSON {p, state, since[, kind]} maintained by the detector; ``kind``
        (fail_slow_compute | fail_slow_comm) is present on slow devices and is read back
        by a restarted detector."""
        return f"{self.base}:device_health"

    @property
    def node_heartbeat(self) -> str:
        """Hash node -> last heartbeat wall time, maintained by the collector."""
        return f"{self.base}:node_heartbeat"

    @property
    def agents_left(self) -> str:
        """Set of node-agent connection names whose process ended on purpose
        (:mod:`resihp.liveness_agent`), read by the collector; expires after a minute."""
        return f"{self.base}:agents_left"

    @property
    def job_state(self) -> str:
        """JSON {"state": "running"|"finished", "at_s": ...} written by the trainer, so that
        a job that ends on purpose is not mistaken for every rank failing at once."""
        return f"{self.base}:job_state"

    @property
    def counters(self) -> str:
        """Hash of monotonically increasing *_total counters for this job."""
        return f"{self.base}:counters"

    def health(self, service: str, instance: str = "0") -> str:
        """Per-service health key, refreshed with a TTL; absent means unhealthy."""
        return f"{self.base}:health:{service}:{instance}"

    def lease(self, service: str, instance: str = "0") -> str:
        """Which ``--all-jobs`` watcher serves this job's ``service`` (``resihp.stack.jobwatch``)."""
        return f"{self.base}:lease:{service}:{instance}"

    @property
    def stack_claim(self) -> str:
        """Held by a ``resihp up`` stack running this job's services itself: watchers stay
        off the job while it lives (TTL, refreshed by the stack)."""
        return f"{self.base}:stack_claim"

    def health_pattern(self) -> str:
        return f"{self.base}:health:*"

    def action_seal(self, user: str, action_id: str) -> str:
        """Digest of an action, written with it by the Redis ACL user that sent it
        (``resihp.acl``): only that user's ACL key pattern reaches it, so a scheduler
        that requires seals knows which user sent the action."""
        return f"{self.base}:seal:{user}:{action_id}"

    def telemetry_shard(self, shard: int, shards: int) -> str:
        """Telemetry stream of node group ``shard`` of ``shards`` of a job spread over
        several streams (collector/shard.py), under its own hash tag ``{JOB/sK.N}``: N is
        the first suffix that puts the slot in the middle of the K-th of ``shards`` equal
        slot ranges, so on a cluster whose slots are split evenly over its masters (as
        ``redis-cli --cluster create`` does) up to one shard per master land apart."""
        return f"{PREFIX}:{{{_shard_tag(self.job_id, int(shard), int(shards))}}}:telemetry"

    def shard_pattern(self) -> str:
        """Every key of the job's telemetry shards (for deleting the job)."""
        return f"{PREFIX}:{{{self.job_id}/s*}}:*"

    def partials(self, shard: int) -> str:
        """Partial iteration records of node group ``shard`` of a sharded job, from its
        shard collector; in the job's slot, so one merger reads every shard's in one
        XREADGROUP and publishes the job's records on ``iterations``."""
        return f"{self.base}:partials:{int(shard)}"

    @property
    def epoch(self) -> str:
        """Counter: how many times the job's data was deleted (``resihp up --fresh``), so
        that a reader holding cached history (the dashboard) notices a new run behind the
        same id.  Outside ``base:*`` (deleting the job's keys keeps it) yet in the job's
        hash slot (tag ``{JOB}``), so a transaction may read it with the job's keys on a
        Redis Cluster."""
        return f"{PREFIX}:epoch:{{{self.job_id}}}"

    def group(self, service: str) -> str:
        """Consumer-group name a service uses on this job's streams."""
        return f"{PREFIX}-{service}"


@functools.lru_cache(maxsize=4096)
def _shard_tag(job_id: str, shard: int, shards: int) -> str:
    if not 0 <= shard < shards:
        raise ValueError(f"shard must be in [0, {shards}), got {shard}")
    width = SLOTS / shards
    centre, half = (shard + 0.5) * width, width / 4
    for n in range(1_000_000):
        tag = f"{job_id}/s{shard}.{n}"
        if abs(key_slot(tag.encode()) - centre) <= half:
            return tag
    raise RuntimeError(f"no hash tag for shard {shard} of {shards}")  # pragma: no cover


def entry_seq(stream: str, group: str) -> str:
    """Hash of the highest entry number consumer group ``group`` was delivered of each
    producer of ``stream`` (``bus.StreamConsumer``): in the stream's slot."""
    return f"{stream}:seq:{group}"


def all_streams(keys: JobKeys) -> list[str]:
    return [
        keys.telemetry,
        keys.iterations,
        keys.liveness,
        keys.failures,
        keys.plans,
        keys.actions,
        keys.deadletter,
        keys.audit,
    ]

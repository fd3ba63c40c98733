"""Detector settings: a validated dataclass built from CLI args/env, and the
runtime-tunable subset re-read from the job's ``detector_config`` Redis hash.

Every field is documented where it is declared.  ``DetectorConfig.validate``
raises ``ValueError`` naming the field on a bad value.  The runtime subset
(:data:`RUNTIME_FIELDS`) can be changed on a running detector with
``HSET resihp:{job}:detector_config threshold 1.3`` (values are strings, lists
are JSON or comma-separated); the service re-reads the hash every loop and
applies valid changes without a restart, keeping the last good value for a
field whose new value is invalid (and saying why in its log and counters).

``heartbeat_k`` is the collector's liveness rule (K consecutive missed
heartbeats make a rank dead).  It lives in the same hash because operators
tune it next to the other detection knobs: the detector validates it and seeds
the hash with its default (HSETNX) so the collector always finds a value; the
collector reads field ``heartbeat_k`` of ``keys.detector_config`` on every
liveness check.  The detector does not re-count heartbeats itself: it trusts
the collector's LivenessEvents.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from resihp.keys import validate_job_id

MODES = ("resihp", "greyhound")

#: The largest ``heartbeat_k`` accepted.  The collector, which acts on K, keeps the same
#: bound and parsing rule (``collector/config.py``: services do not import each other;
#: tests/test_detector_units.py holds the two equal), so it never follows a K refused here.
MAX_HEARTBEAT_K = 1000

# ASCII digits only: int() and float() also take non-ASCII digits ("٣" is 3), which an
# operator cannot tell apart from a typo on most terminals
_ASCII_INT = re.compile(r"[0-9]+")
_ASCII_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class ConfigFieldError(ValueError):
    """A bad value of one field: ``str()`` names the field, ``why`` says only what is
    wrong (for messages that already start with the field's name)."""

    def __init__(self, name: str, why: str):
        super().__init__(f"detector config field {name!r}: {why}")
        self.field = name
        self.why = why


#: Fields that may be changed at runtime through the ``detector_config`` hash.
RUNTIME_FIELDS = (
    "threshold",
    "cpd_penalty",
    "heartbeat_k",
    "disabled_ranks",
    "min_throughput_loss",
    "failslow_enabled",
)


@dataclass
class DetectorConfig:
    """All detector settings.  Units are in the names; ratios are dimensionless."""

    # --- service plumbing ---------------------------------------------------
    #: Redis URL (default $REDIS_URL); unused by replay.
    redis_url: str | None = None
    #: Job whose streams are watched.
    job_id: str = "default"
    #: Stream entries read per stream per loop.
    batch_count: int = 200
    #: How long one read blocks when nothing is pending (milliseconds).
    block_ms: int = 50

    # --- mode -----------------------------------------------------------------
    #: "resihp" (workload-aware, per-chunk residuals) or "greyhound" (baseline:
    #: every iteration-time change point is validated, no workload filter).
    mode: str = "resihp"

    # --- predictor (eq. 1 and the DAG) ------------------------------------------
    #: Iterations used to fit alpha/beta and the residual noise before detecting.
    warmup_iters: int = 20
    #: Iterations to re-fit after a layout change (stages whose shape changed).
    rewarm_iters: int = 8
    #: Per-iteration forgetting factor of the recursive least-squares fit on
    #: healthy iterations (0.98 keeps roughly the last 50 iterations).
    forget: float = 0.98

    # --- fail-slow detection (runtime-tunable fields marked *) -----------------
    #: * Iteration-level workload filter: a change point whose observed time is
    #: within ``threshold`` x predicted is benign (paper: 1.25).
    threshold: float = 1.25
    #: * Smallest throughput loss (fraction of iteration time) a persistent
    #: slowdown must cost to be reported.
    min_throughput_loss: float = 0.05
    #: * ruptures penalty, in units of the series' noise variance (the series
    #: is standardized before segmentation).
    cpd_penalty: float = 8.0
    #: Sliding window of points handed to ruptures.
    cpd_window: int = 48
    #: MB of iteration views (chunk columns) the detector keeps for costing and gating a
    #: change: at most cpd_window views and at most this many MB, the newest 8 always.
    #: A 16,384-GPU view is ~20 MB, so 48 of them grew the detector by ~1 GB (issue 24).
    view_history_mb: float = 256.0
    #: Minimum segment length for ruptures (points).
    cpd_min_size: int = 2
    #: CUSUM screen slack and decision level, in noise standard deviations.
    screen_k_sigma: float = 0.5
    screen_h_sigma: float = 4.0
    #: Post-change iterations that must all stay elevated before a report.
    confirm_iters: int = 2
    #: Smallest relative per-chunk slowdown treated as a shift at all.
    min_chunk_shift: float = 0.03
    #: ... and it must be at least this many noise standard deviations.
    sigma_shift: float = 4.0
    #: Judge each (replica, stage) group against the same stage of the other
    #: replicas (cancels stage-wide eq.-1 misfit when the data mix changes).
    peer_relative: bool = True
    #: Floor of the per-group residual noise (log-ratio standard deviation).
    min_noise_sigma: float = 0.005
    #: A slow device has recovered when its residual slowdown is below this
    #: relative level for ``recovery_iters`` consecutive iterations.
    recovery_shift: float = 0.03
    recovery_iters: int = 3
    #: A set-aside (standby) device's idle-probe counts as healthy when its probe
    #: throughput is within this of the reference *and* above the midpoint between
    #: its reported slow throughput and 1 (a single matmul is noisier than an
    #: iteration's worth of chunks; the midpoint keeps a mildly slow device from
    #: flapping between excluded and re-admitted).
    probe_recovery_shift: float = 0.10
    # --- stage constants (each stage's unit says what it rejects; docs/detector.md) -
    #: [0 baseline] A warm-up group this much slower than the faster half of its
    #: same-degree peers is slow already (``warmup_peer_comparison``): healthy peers
    #: differ by the +-1 % static spread and 3 % noise, a slow GPU by >= 20 %.
    warm_peer_ratio: float = 1.05
    #: [0 baseline] A group this much slower than its healthy scale in a warm-up
    #: iteration runs slow in that iteration's DAG when the iteration-time offset is
    #: learned (below it: noise).
    warm_slow_ratio: float = 1.10
    #: [0 baseline] After a replan, a group of the same ranks this much slower than its
    #: own speed before it is slow (healthy groups read 0.998-1.07: the last stage's LM
    #: head does not scale with its layers; a slow link 2.3, a GPU at 0.6x 1.6).
    prior_outlier_ratio: float = 1.10
    #: [0 baseline] The same for a group the plan shrank (time scaled by the TP degree
    #: too): healthy TP-4 groups shrunk to 2 read 0.93-1.01, a GPU at 0.6x 1.6.
    prior_regroup_ratio: float = 1.25
    #: [0 baseline] No group's residual noise sigma is taken below this share of the
    #: typical (median) group's: every group has the same noise sources (kernel jitter,
    #: eq.-1 misfit) and a 20-point estimate can come out low by chance, which would make
    #: that group alone alarm on noise.
    warm_sigma_floor_share: float = 0.8
    #: [2 change point] A P2P statistic must move by this many times ``min_chunk_shift``:
    #: a link's own time is noisier than a median of compute chunks (one transfer per
    #: micro-batch, its sender's end taken from another clock), and a link that costs
    #: 5 % throughput moves by far more (the bench's slow ports: 100x and more).
    comm_shift_factor: float = 2.0
    #: [3 workload filter] The iteration path blames a group whose residual stands this
    #: many noise sigmas above its baseline since the change point (a 3-sigma level, the
    #: change-point stage's persistence rule applied to every post-change point).
    iteration_blame_sigmas: float = 3.0
    #: [4 localization] Inside a TP group the slow ranks are those whose own compute time
    #: grew by at least this share of the group's slowdown (one slow rank of TP 4 carries
    #: all of it; half leaves room for the noise of one rank's compute time).
    localize_rank_share: float = 0.5
    #: [4 localization] A group whose chunks slowed while no member's own compute grew by
    #: this share of it spent the time in its TP collectives: ``fail_slow_comm`` (stage 7
    #: applies the same share to a known-slow group's level move).
    tp_comm_share: float = 0.25
    #: [5 validation] A slowdown's throughput cost is averaged over the DAG of this many
    #: recent iterations' workloads (one mix can hide or expose a slow stage).
    cost_views: int = 8
    #: [5 validation] A real shift costing under the bar is re-costed every this many
    #: iterations on fresh workloads ...
    recost_every_iters: int = 4
    #: ... for this many iterations (the heaviest replica sets the pace, so the same
    #: slowdown costs more under some data mixes).
    recost_for_iters: int = 40
    #: [5 validation] A watched shift is re-costed at the median of its series' last this
    #: many points when that is above its change point's mean: a throttling ramp keeps
    #: climbing after the change point (costed at its segment mean it was reported late);
    #: 3 is the fewest whose median one spike cannot move.
    ramp_level_iters: int = 3
    #: [7 severity] A known-slow device whose level moves by this factor (either way) and
    #: costs or gains ``min_throughput_loss`` is reported again with its new severity.
    severity_step: float = 0.25
    # --- persistence and flapping (detector/persistence.py; docs/detector.md) -----
    #: A confirmed slowdown is reported once the detector has seen it slow in this many
    #: iterations (its own series over the shift bar, not the iterations since its
    #: change point): longer than the 1-3-iteration stragglers (a GC pause, a
    #: checkpoint write, a thermal blip) that go away before a re-plan would pay off.
    persist_min_iters: int = 4
    #: ... and once the time it has cost (throughput loss x iteration time, summed
    #: over those iterations) reaches the cost of one re-plan (ski rental): the
    #: communicator rebuild is ~1.5 s (§8.3: < 2 s), plus the re-warm.
    replan_cost_s: float = 2.0
    #: ... or, whatever it cost, once it has lasted this many iterations (a job with
    #: short iterations must not wait for minutes on a slowdown it will not shake).
    persist_max_iters: int = 10
    #: ... and once the time it will cost, at today's rate, over the shorter duration
    #: a fail-slow that outlasted the stragglers is expected to have left reaches the
    #: re-plan cost: the longer of as long again as it has lasted (Lindy) and this
    #: floor.  Production studies report fail-slows lasting tens of seconds to hours,
    #: Greyhound's evaluation injects them for N(120 s, 20 s) (calibration notes); 40 s
    #: is where every slowdown the 5 % bar lets through pays for the 2 s re-plan, so past
    #: the 4-iteration hold a reportable slowdown is reported at once, and the cost rule
    #: decides only where the bar or the re-plan cost is set otherwise
    #: (docs/detector.md, "Persistence").  The hold counts the slow iterations the
    #: detector has seen (``evidence.seen_slow``), not those since the change point,
    #: which ruptures estimates backwards: counted from it, the torch trainer's slow
    #: rank (tests/test_e2e_stack.py) was reported in its 2nd slow iteration with a
    #: 20 s floor, so the floor was off (0) until the hold counted what it had seen.
    failslow_min_duration_s: float = 40.0
    #: A recovery of a reported device is reported once it has stayed healthy this
    #: many iterations; slow again before that, it is intermittent (flapping) and is
    #: kept set aside without a new report (3 periods of a 10-on / 10-off flap).
    stable_iters: int = 30
    #: * Master switch of fail-slow detection (fail-stop is always on).
    failslow_enabled: bool = True
    #: * Ranks excluded from fail-slow reporting (operator's per-rank off switch).
    disabled_ranks: frozenset[int] = field(default_factory=frozenset)

    # --- liveness -----------------------------------------------------------------
    #: * The collector's K: consecutive missed heartbeats that make a rank dead.
    heartbeat_k: int = 2

    # --- Greyhound-style baseline (calibration notes) -------------------------------
    #: A change point counts only if the mean before/after differs by this much.
    gh_mean_shift: float = 0.10
    #: ... and it is this many iterations after the previous one.
    gh_min_gap_iters: int = 10
    #: Profiling: a group is suspect at >= this x the median of its peers.
    gh_peer_ratio: float = 1.2
    #: Validation: compute micro-benchmark slow at > this x median.
    gh_compute_ratio: float = 2.0
    #: Validation: pairwise P2P link test slow at > this x median.
    gh_link_ratio: float = 1.1
    #: Training paused per validation: a fixed part (compute micro-benchmark on
    #: every GPU, barrier) plus one P2P test per pipeline link; calibrated so that
    #: 16 / 32 GPUs (8 / 24 links) pause 2.2 / 3.3 s as in the paper's Table 5.
    gh_validation_base_s: float = 1.72
    gh_validation_per_link_s: float = 0.065

    # ------------------------------------------------------------------ checks
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> DetectorConfig:
        def bad(name: str, why: str) -> None:
            raise ConfigFieldError(name, f"{why} (got {getattr(self, name)!r})")

        try:
            validate_job_id(self.job_id)
        except ValueError as e:
            raise ConfigFieldError("job_id", str(e)) from None
        if self.mode not in MODES:
            bad("mode", f"must be one of {MODES}")

        def integer(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("batch_count", "warmup_iters", "cpd_window", "heartbeat_k"):
            if not integer(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        for name in (
            "rewarm_iters",
            "block_ms",
            "recovery_iters",
            "gh_min_gap_iters",
            "persist_min_iters",
            "persist_max_iters",
            "stable_iters",
        ):
            if not integer(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, "must be an integer >= 0")
        for name in ("cost_views", "recost_every_iters", "recost_for_iters", "ramp_level_iters"):
            if not integer(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        for name in (
            "warm_peer_ratio",
            "warm_slow_ratio",
            "prior_outlier_ratio",
            "prior_regroup_ratio",
            "comm_shift_factor",
        ):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 1.0 <= v < math.inf:
                bad(name, "must be a finite number >= 1")
        for name in ("localize_rank_share", "tp_comm_share", "severity_step"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 < v < 1.0:
                bad(name, "must be a number in (0, 1)")
        v = self.warm_sigma_floor_share
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
            bad("warm_sigma_floor_share", "must be a number in [0, 1]")
        v = self.iteration_blame_sigmas
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= v < math.inf:
            bad("iteration_blame_sigmas", "must be a finite number >= 0")
        mb = self.view_history_mb
        if not isinstance(mb, int | float) or isinstance(mb, bool) or not mb > 0:
            bad("view_history_mb", "must be a number > 0")
        if self.warmup_iters < 5:
            bad("warmup_iters", "needs at least 5 iterations to fit alpha, beta and the noise")
        for name in ("forget", "threshold", "min_throughput_loss", "cpd_penalty"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool):
                bad(name, "must be a number")
        if not 0.5 < self.forget <= 1.0:
            bad("forget", "must be in (0.5, 1]")
        if not 1.0 < self.threshold <= 10.0:
            bad("threshold", "must be in (1, 10]")
        if not 0.0 < self.min_throughput_loss < 1.0:
            bad("min_throughput_loss", "must be in (0, 1)")
        if not 0.0 < self.cpd_penalty <= 1e6:
            bad("cpd_penalty", "must be in (0, 1e6]")
        if self.cpd_min_size < 1 or self.cpd_window < 4 * self.cpd_min_size:
            bad("cpd_window", "must hold at least 4 x cpd_min_size points")
        if self.confirm_iters < 1 or self.confirm_iters > self.cpd_window // 2:
            bad("confirm_iters", "must be in [1, cpd_window/2]")
        for name in (
            "screen_k_sigma",
            "screen_h_sigma",
            "min_chunk_shift",
            "sigma_shift",
            "min_noise_sigma",
            "recovery_shift",
            "probe_recovery_shift",
            "gh_mean_shift",
            "gh_validation_base_s",
            "gh_validation_per_link_s",
            "replan_cost_s",
            "failslow_min_duration_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < math.inf:
                bad(name, "must be a finite number >= 0")
        for name in ("gh_peer_ratio", "gh_compute_ratio", "gh_link_ratio"):
            if not 1.0 < getattr(self, name) < math.inf:
                bad(name, "must be a finite number > 1")
        if not isinstance(self.failslow_enabled, bool):
            bad("failslow_enabled", "must be a bool")
        if not isinstance(self.disabled_ranks, frozenset) or any(
            not isinstance(r, int) or r < 0 for r in self.disabled_ranks
        ):
            bad("disabled_ranks", "must be a set of ranks >= 0")
        if self.heartbeat_k > MAX_HEARTBEAT_K:
            bad("heartbeat_k", f"must be <= {MAX_HEARTBEAT_K}")
        return self

    # -------------------------------------------------------------- building
    @classmethod
    def from_args(cls, args: Any) -> DetectorConfig:
        """From an argparse namespace (any attribute named like a field is used)."""
        kw = {}
        for f in dataclasses.fields(cls):
            if hasattr(args, f.name) and getattr(args, f.name) is not None:
                kw[f.name] = getattr(args, f.name)
        if not kw.get("redis_url"):
            kw["redis_url"] = os.environ.get("REDIS_URL")
        if "job_id" not in kw:
            kw["job_id"] = os.environ.get("RESIHP_JOB_ID", "default")
        if "disabled_ranks" in kw:
            kw["disabled_ranks"] = parse_ranks(kw["disabled_ranks"])
        return cls(**kw).validate()

    def replace(self, **changes: Any) -> DetectorConfig:
        return dataclasses.replace(self, **changes).validate()

    def runtime_dict(self) -> dict[str, str]:
        """The runtime subset as the strings stored in the Redis hash."""
        out = {}
        for name in RUNTIME_FIELDS:
            v = getattr(self, name)
            if isinstance(v, frozenset):
                out[name] = json.dumps(sorted(v))
            elif isinstance(v, bool):
                out[name] = "true" if v else "false"
            else:
                out[name] = str(v)
        return out

    def with_runtime(self, raw: dict) -> tuple[DetectorConfig, list[str]]:
        """Apply a ``detector_config`` hash; returns (new config, rejected-field reasons).

        Fields not in :data:`RUNTIME_FIELDS` are refused (a typo must not pass
        silently); a bad value keeps the current one.
        """
        cfg = self
        errors: list[str] = []
        for k, v in raw.items():
            name = k.decode() if isinstance(k, bytes) else str(k)
            val = v.decode(errors="replace") if isinstance(v, bytes) else str(v)
            if name not in RUNTIME_FIELDS:
                errors.append(
                    f"{name}: not a runtime-tunable field (allowed: {', '.join(RUNTIME_FIELDS)})"
                )
                continue
            try:
                parsed = _parse_runtime(name, val)
                if parsed == getattr(cfg, name):
                    continue
                cfg = cfg.replace(**{name: parsed})
            except ConfigFieldError as e:
                errors.append(f"{name}: {e.why}")
            except ValueError as e:
                errors.append(f"{name}: {e}")
        return cfg, errors


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` strings (the benches' ``--set``) -> typed DetectorConfig changes,
    validated together; a bad field or value raises ``ValueError`` naming it."""
    out: dict[str, Any] = {}
    defaults = DetectorConfig()
    for item in items:
        name, _, val = item.partition("=")
        if name not in {f.name for f in dataclasses.fields(DetectorConfig)}:
            raise ConfigFieldError(name, "no such field")
        kind = type(getattr(defaults, name))
        out[name] = val.lower() in ("1", "true", "on") if kind is bool else kind(val)
    DetectorConfig(**out).validate()
    return out


def parse_ranks(v: Any) -> frozenset[int]:
    """Ranks from a JSON list, a comma-separated string, or an iterable of ints."""
    if isinstance(v, frozenset):
        return v
    if isinstance(v, str):
        s = v.strip()
        if not s:
            return frozenset()
        if s.startswith("["):
            try:
                items = json.loads(s)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"not a JSON list of ranks: {e}") from e
            if not isinstance(items, list):
                raise ValueError("not a JSON list of ranks")
        else:
            items = [x.strip() for x in s.split(",") if x.strip()]
    else:
        items = list(v)
    out = set()
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int | str):
            raise ValueError(f"not a rank: {x!r}")
        if isinstance(x, str):
            t = x.strip()
            if t.startswith("-") and _ASCII_INT.fullmatch(t[1:]):
                raise ValueError(f"rank must be >= 0: {t}")
            if not _ASCII_INT.fullmatch(t):
                raise ValueError(f"not a rank: {x!r}")
            if len(t) > 20:  # no job has that many ranks (and int() refuses 4300 digits)
                raise ValueError(f"not a rank: {t[:20]}...")
            x = t
        r = int(x)
        if r < 0:
            raise ValueError(f"rank must be >= 0: {r}")
        out.add(r)
    return frozenset(out)


def _parse_runtime(name: str, val: str) -> Any:
    if name == "disabled_ranks":
        return parse_ranks(val)
    if name == "failslow_enabled":
        low = val.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a bool: {val!r}")
    if name == "heartbeat_k":
        t = val.strip()
        neg = t.startswith("-")
        if not _ASCII_INT.fullmatch(t[neg:]):
            raise ValueError(f"not an integer: {t!r}")
        got = t if len(t) <= 12 else t[:12] + "..."
        if neg:
            raise ValueError(f"must be an integer >= 1 (got {got})")
        if len(t.lstrip("0")) > len(str(MAX_HEARTBEAT_K)):
            # past the bound by its length (and int() refuses more than 4300 digits)
            raise ValueError(f"must be <= {MAX_HEARTBEAT_K} (got {got})")
        return int(t)
    t = val.strip()
    if t.lower().lstrip("+-") in ("inf", "infinity", "nan"):
        raise ValueError(f"not a finite number: {val!r}")
    if not _ASCII_NUMBER.fullmatch(t):
        raise ValueError(f"not a number: {val!r}")
    x = float(t)
    if not math.isfinite(x):
        raise ValueError(f"not a finite number: {val!r}")
    return x

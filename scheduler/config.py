"""Validated configuration of the scheduler service (CLI args / environment).

Every field is documented; a bad value raises ``ValueError`` naming the field.
Runtime-tunable fields (``mode``, ``grace_period_s``, ``delta``) can also be
changed while the service runs through the ``keys.scheduler_config`` hash.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields

from resihp.keys import validate_job_id
from resihp.pipeline.models import get_preset

MODES = ("auto", "manual")
SEALED_ENV = "RESIHP_SEALED_ACTIONS"
#: The fields an operator's ``set_mode`` (and the ``keys.scheduler_config`` hash) may set.
RUNTIME_FIELDS = ("mode", "grace_period_s", "delta")


def check_runtime_fields(overrides: dict) -> None:
    """Raise ``ValueError`` naming unknown (misspelled) fields and the allowed ones, or
    when nothing is given: a typo must not pass for a change."""
    if not isinstance(overrides, dict) or not overrides:
        raise ValueError(f"set_mode needs at least one of {list(RUNTIME_FIELDS)}")
    unknown = [k for k in overrides if k not in RUNTIME_FIELDS]
    if unknown:
        raise ValueError(f"unknown set_mode field(s) {unknown}; allowed {list(RUNTIME_FIELDS)}")


@dataclass
class SchedulerConfig:
    """Settings of one scheduler instance.

    redis_url: Redis to use (default ``$REDIS_URL``).
    job_id: job whose streams this instance serves.
    mode: ``auto`` acknowledges a proposed plan after ``grace_period_s`` unless an
        operator intervened; ``manual`` waits for an operator's acknowledgement.
    grace_period_s: seconds a proposed plan waits in auto mode.
    policy: planning policy (``resihp`` or a baseline, see ``scheduler.policies``).
    delta: Algorithm 1's progress-imbalance threshold (micro-batches).
    model: model preset of the cost model (``resihp.pipeline.models``; an unknown
        name is refused); empty means the preset with the running layout's layer
        count, else a generic layer cost.
    seq_len: tokens per packed micro-batch (the token budget).
    device_mem_gb: memory per device used by the feasibility checks.
    min_gain: a plan that is not a failure response is only proposed when it
        predicts at least this fractional improvement.
    block_ms: how long one ``run_once`` blocks on the input streams.
    consumer: consumer name inside the scheduler's consumer groups.
    sealed_actions: take an operator's or the trainer's action only when the Redis ACL
        user that sent it sealed it and may speak for its actor (``resihp.acl.refusal``);
        anything else is refused and audited. For a Redis with ACL users of its own
        (``docker-compose.acl.yml``); environment ``RESIHP_SEALED_ACTIONS=1``.
    """

    redis_url: str = ""
    job_id: str = "default"
    mode: str = "auto"
    grace_period_s: float = 10.0
    policy: str = "resihp"
    delta: int = 0
    model: str = ""
    seq_len: int = 4096
    device_mem_gb: float = 80.0
    min_gain: float = 0.01
    block_ms: int = 100
    consumer: str = "scheduler-0"
    sealed_actions: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        try:
            validate_job_id(self.job_id)
        except ValueError as e:
            raise ValueError(f"job_id: {e}") from None
        if self.model:
            # an unknown name must not pass for the generic cost model: plans would be
            # priced for a model nobody runs (trainer sim and `resihp up` refuse it too)
            try:
                self.model = get_preset(self.model).name
            except ValueError as e:
                raise ValueError(f"model: {e}") from None
        if not isinstance(self.sealed_actions, bool):
            raise ValueError(f"sealed_actions: must be true or false, got {self.sealed_actions!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {MODES}, got {self.mode!r}")
        for name, lo in (("delta", 0), ("seq_len", 1), ("block_ms", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name}: must be an integer >= {lo}, got {v!r}")
        for name in ("grace_period_s", "device_mem_gb", "min_gain"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise ValueError(f"{name}: must be a number, got {v!r}")
        if not (0 <= self.grace_period_s < math.inf):
            raise ValueError(
                f"grace_period_s: must be a finite number >= 0, got {self.grace_period_s}"
            )
        if not (0 < self.device_mem_gb < math.inf):
            raise ValueError(
                f"device_mem_gb: must be a finite number > 0, got {self.device_mem_gb}"
            )
        if not (0 <= self.min_gain < 1):
            raise ValueError(f"min_gain: must be in [0, 1), got {self.min_gain}")
        from scheduler.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown policy {self.policy!r}; known: {sorted(POLICIES)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SchedulerConfig:
        kw = {}
        for f in fields(cls):
            v = getattr(args, f.name, None)
            if v is not None:
                kw[f.name] = v
        if not kw.get("redis_url"):
            kw["redis_url"] = os.environ.get("REDIS_URL", "")
        if "job_id" not in kw:
            kw["job_id"] = os.environ.get("RESIHP_JOB_ID", "default")
        if not kw.get("sealed_actions"):
            env = os.environ.get(SEALED_ENV, "").strip().lower()
            if env not in ("", "0", "1", "true", "false"):
                raise ValueError(f"sealed_actions: {SEALED_ENV} must be 1 or 0, got {env!r}")
            kw["sealed_actions"] = env in ("1", "true")
        return cls(**kw)

    def apply_runtime(self, overrides: dict[str, str], strict: bool = False) -> list[str]:
        """Apply runtime overrides from ``keys.scheduler_config``; returns the fields changed.

        A bad value leaves the config unchanged and raises ``ValueError`` naming the field;
        with ``strict`` (an operator's ``set_mode``) so does an unknown field or none.
        """
        if strict:
            check_runtime_fields(overrides)
        new = dict(mode=self.mode, grace_period_s=self.grace_period_s, delta=self.delta)
        for k, v in overrides.items():
            if k == "mode":
                new["mode"] = str(v)
            elif k == "grace_period_s":
                try:
                    new["grace_period_s"] = float(v)
                except ValueError as e:
                    raise ValueError(f"grace_period_s: not a number: {v!r}") from e
            elif k == "delta":
                try:
                    new["delta"] = int(v)
                except ValueError as e:
                    raise ValueError(f"delta: not an integer: {v!r}") from e
        old = dict(mode=self.mode, grace_period_s=self.grace_period_s, delta=self.delta)
        for k, v in new.items():
            setattr(self, k, v)
        try:
            self.validate()
        except ValueError:
            for k, v in old.items():
                setattr(self, k, v)
            raise
        changed = [k for k in new if new[k] != old[k]]
        return changed

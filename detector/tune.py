"""Operator-side runtime tuning of a running detector (``resihp config``).

The detector re-reads ``keys.detector_config`` every loop and keeps the last
good value of a field whose new value is invalid.  That protects the service,
but an operator who mistypes a value at a terminal only learns it from the
detector's log.  This module validates assignments *before* they are written
(all of them or none) with the same parser the service uses, and shows what
the hash holds beside what the running detector reports it applied (its health
key carries its runtime settings), so a change can be seen taking effect.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from detector.config import RUNTIME_FIELDS, DetectorConfig
from resihp.bus import Health, list_jobs
from resihp.keys import JobKeys
from resihp.topology import Layout, LayoutError


def parse_assignments(items: list[str]) -> dict[str, str]:
    """``["threshold=1.3", "disabled_ranks=4,5"]`` -> field -> value (strings)."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"{item!r}: expected FIELD=VALUE")
        if name not in RUNTIME_FIELDS:
            raise ValueError(
                f"{name}: not a runtime-tunable field (allowed: {', '.join(RUNTIME_FIELDS)})"
            )
        if name in out:
            raise ValueError(f"{name}: given twice; give each field once")
        out[name] = value.strip()
    return out


def validate(stored: dict[str, str], changes: dict[str, str]) -> dict[str, str]:
    """The hash values to write for ``changes`` on top of what is ``stored``; raises
    ValueError naming every bad field, so nothing is written when one is wrong."""
    base, _ignored = DetectorConfig().with_runtime(
        {k: v for k, v in stored.items() if k in RUNTIME_FIELDS and k not in changes}
    )
    new, errors = base.with_runtime(changes)
    if errors:
        raise ValueError("; ".join(errors))
    # write the canonical form (e.g. a rank list as JSON) so `show` reads back cleanly
    canonical = new.runtime_dict()
    return {k: canonical[k] for k in changes}


def _decode(raw: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): (
            v.decode(errors="replace") if isinstance(v, bytes) else str(v)
        )
        for k, v in raw.items()
    }


def _known_job(client: redis.Redis, job_id: str) -> JobKeys:
    """The keys of ``job_id``; ValueError naming the known jobs when it is neither
    registered in this Redis nor has a ``detector_config`` hash already."""
    keys = JobKeys(job_id)
    jobs = list_jobs(client)
    if job_id in jobs or client.exists(keys.detector_config):
        return keys
    known = ", ".join(jobs) if jobs else "none"
    raise ValueError(f"unknown job {job_id!r} in this Redis (known jobs: {known}); pass --job-id")


def _check_ranks(client: redis.Redis, keys: JobKeys, values: dict[str, str]) -> None:
    """Refuse ``disabled_ranks`` outside the job's layout, when its layout key exists."""
    if "disabled_ranks" not in values:
        return
    raw = client.get(keys.layout)
    if not raw:
        return
    try:
        world = Layout.from_json(raw).world_size
    except LayoutError:
        return  # an unreadable layout is not the operator's mistake; the service copes
    outside = [r for r in json.loads(values["disabled_ranks"]) if r >= world]
    if outside:
        raise ValueError(
            f"disabled_ranks: rank(s) {', '.join(map(str, outside))} outside the job's "
            f"{world} ranks (0-{world - 1})"
        )


def read(client: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    """One row per runtime field: the hash value, the default, and what the running
    detector says it applied (None when no detector reports); for ``heartbeat_k``, the
    K the running collector follows when its health key carries it."""
    keys = _known_job(client, job_id)
    stored = _decode(client.hgetall(keys.detector_config))
    health = Health.get(client, keys, "detector") or {}
    applied = dict(health["config"]) if isinstance(health.get("config"), dict) else {}
    # K is the collector's to apply: its own health key says which K it follows (the
    # detector's copy is only what the detector parsed)
    k = (Health.get(client, keys, "collector") or {}).get("heartbeat_k")
    if isinstance(k, int) and not isinstance(k, bool):
        applied["heartbeat_k"] = str(k)
    defaults = DetectorConfig().runtime_dict()
    return [
        {
            "field": f,
            "stored": stored.get(f),
            "default": defaults[f],
            "applied": applied.get(f),
        }
        for f in RUNTIME_FIELDS
    ]


def write(client: redis.Redis, job_id: str, assignments: list[str]) -> dict[str, tuple]:
    """Validate and write; returns field -> (previous stored value, new value)."""
    changes = parse_assignments(assignments)
    keys = _known_job(client, job_id)
    stored = _decode(client.hgetall(keys.detector_config))
    values = validate(stored, changes)
    _check_ranks(client, keys, values)
    client.hset(keys.detector_config, mapping=values)
    return {k: (stored.get(k), v) for k, v in values.items()}


def who_applies(client: redis.Redis, job_id: str, fields: list[str]) -> str:
    """What happens to values just written, judged from the services' health keys (the
    ones ``show`` reads): "the running detector applies it" is only true with one."""
    keys = JobKeys(job_id)
    if Health.get(client, keys, "detector") is not None:
        lines = ["the running detector applies it within one loop (see `config show`)"]
    else:
        lines = [
            f"no detector is running for job {job_id!r}: the value is stored, and a "
            "detector started later applies it (a command-line flag for the same field "
            "replaces it)"
        ]
    if "heartbeat_k" in fields and Health.get(client, keys, "collector") is not None:
        lines.append("the running collector follows heartbeat_k at its next liveness check")
    return "\n".join(lines)


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'field':<22}{'in Redis':<16}{'applied':<16}default"]
    for r in rows:
        stored = "-" if r["stored"] is None else r["stored"]
        applied = "(no detector)" if r["applied"] is None else r["applied"]
        lines.append(f"{r['field']:<22}{stored:<16}{applied:<16}{r['default']}")
    return "\n".join(lines)

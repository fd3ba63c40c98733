"""Export one iteration's pipeline timeline as Chrome trace-event JSON (opens in Perfetto).

One track per rank: the collector aggregates chunk timings over each TP group,
so every chunk of (dp, stage) is drawn on each rank of that TP group (from the
layout, else from the record's per-rank columns).  Observed chunks are process
1, predicted ones (when given) process 2.  Timestamps are microseconds since
the iteration's first chunk.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import numpy as np

from dashboard.figures import FLOW_LABELS, normalize_chunks
from resihp.topology import Layout


def _rank_map(record: dict[str, Any], layout: Layout | None) -> dict[tuple[int, int], list[int]]:
    """(dp, stage) -> ranks of that TP group: the layout's, unless a rank the record says
    ran a (dp, stage) is not in that group there (not the record's layout: the page fell
    back to the current one); then the record's own per-rank columns."""
    reported: dict[tuple[int, int], list[int]] = defaultdict(list)
    rk = record.get("ranks") or {}
    for r, d, s in zip(rk.get("rank", []), rk.get("dp", []), rk.get("stage", []), strict=False):
        reported[(int(d), int(s))].append(int(r))
    if layout is None:
        return reported
    out: dict[tuple[int, int], list[int]] = defaultdict(list)
    for d, stages in enumerate(layout.groups):
        for s, grp in enumerate(stages):
            out[(d, s)] = list(grp)
    if all(set(rs) <= set(out.get(key, ())) for key, rs in reported.items()):
        return out
    return reported


#: Above this many DP replicas a download covers the replicas chosen on the page (default:
#: the first 4): a whole 16k-GPU iteration is millions of events.
MAX_ALL_REPLICAS = 8


def trace_replicas(chunks: dict[str, list] | None, selected: list[int] | None) -> list[int] | None:
    """Which DP replicas a download covers (None = all)."""
    all_dps = sorted({int(d) for d in (chunks or {}).get("dp", [])})
    if selected:
        return sorted(set(selected))
    return None if len(all_dps) <= MAX_ALL_REPLICAS else all_dps[:4]


def _events(
    cols: dict[str, list] | None,
    pid: int,
    ranks: dict,
    t0: float | None,
    dps: list[int] | None = None,
) -> tuple[list, set]:
    c = normalize_chunks(cols)
    if not c:
        return [], set()
    t0 = float(c["start_s"].min()) if t0 is None else t0
    evs, used = [], set()
    sel = np.isin(c["dp"], dps) if dps is not None else np.ones(len(c["stage"]), bool)
    for i in np.flatnonzero(sel).tolist():
        d, s = int(c["dp"][i]), int(c["stage"][i])
        kind, mb, src = str(c["kind"][i]), int(c["microbatch"][i]), int(c["src_dp"][i])
        flow = FLOW_LABELS.get(int(c["direction"][i]), "")
        tids = ranks.get((d, s)) or [-(1 + d * 10_000 + s)]  # no rank known: a (dp, stage) track
        ts = (float(c["start_s"][i]) - t0) * 1e6
        dur = max(float(c["duration_s"][i]) * 1e6, 0.0)
        for tid in tids:
            used.add((tid, d, s))
            evs.append(
                {
                    "name": f"{kind}{flow} mb{mb}" + (f" (from dp{src})" if src != d else ""),
                    "cat": kind,
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": round(ts, 3),
                    "dur": round(dur, 3),
                    "args": {
                        "microbatch": mb,
                        "dp": d,
                        "stage": s,
                        "src_dp": src,
                        "migrated": src != d,
                    },
                }
            )
    return evs, used


def chrome_trace(
    record: dict[str, Any],
    layout: Layout | None = None,
    predicted: dict[str, list] | None = None,
    job_id: str = "",
    dps: list[int] | None = None,
) -> dict[str, Any]:
    """The trace-event JSON object for one IterationRecord dict (``dps``: only those replicas)."""
    ranks = _rank_map(record, layout)
    obs = normalize_chunks(record.get("chunks"))
    t0 = float(obs["start_s"].min()) if obs else None
    it = record.get("iteration", "?")
    events: list[dict[str, Any]] = []
    meta: list[dict[str, Any]] = []
    for pid, name, cols, base in (
        (1, f"{job_id} iteration {it} observed".strip(), record.get("chunks"), t0),
        (2, f"{job_id} iteration {it} predicted".strip(), predicted, None),
    ):
        evs, used = _events(cols, pid, ranks, base, dps)
        if not evs:
            continue
        events.extend(evs)
        meta.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
        )
        meta.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
        for tid, d, s in sorted(used):
            label = f"rank {tid} (dp{d} stage{s})" if tid >= 0 else f"dp{d} stage{s}"
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}}
            )
            meta.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": s * 1_000_000 + d * 1000 + max(tid, 0) % 1000},
                }
            )
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "job_id": job_id,
            "iteration": it,
            "iteration_time_s": record.get("iteration_time_s"),
            "dp_replicas": "all" if dps is None else list(dps),
        },
    }


def chrome_trace_json(
    record: dict[str, Any],
    layout: Layout | None = None,
    predicted: dict[str, list] | None = None,
    job_id: str = "",
    dps: list[int] | None = None,
) -> str:
    return json.dumps(chrome_trace(record, layout, predicted, job_id, dps), separators=(",", ":"))

"""Synthetic chunk rows of whole iterations, for the ingest bench and the tests.

Rows follow a layout: every active rank reports F and B (and W for zero-bubble
schedules) for each micro-batch its (replica, stage) runs, optionally a SEND
per micro-batch.  Times are a plausible 1F1B-like staircase; only their shape
matters to the collector.  Built with numpy in one pass per iteration.
"""

from __future__ import annotations

import numpy as np

from resihp.assembly import LayoutView
from resihp.schemas import CHUNK_DTYPE, ChunkKind
from resihp.topology import Layout


def iteration_rows(
    layout: Layout,
    iteration: int,
    t0_s: float = 0.0,
    chunk_s: float = 0.01,
    comm: bool = False,
    rng: np.random.Generator | None = None,
    slow: dict[int, float] | None = None,
) -> np.ndarray:
    """All chunk rows of one iteration (compute kinds per the layout's schedule).

    ``slow`` maps rank -> slowdown factor applied to its chunk durations.
    """
    view = LayoutView(layout)
    ranks = np.flatnonzero(view.active)
    n_mb = layout.microbatches
    kinds = [ChunkKind.F, ChunkKind.B]
    if layout.schedule.lower().replace("-", "") in ("zbh1", "zbh"):
        kinds.append(ChunkKind.W)
    if comm:
        kinds.append(ChunkKind.SEND)
    k = len(kinds)
    per_rank = np.array([n_mb[view.dp[r]] for r in ranks]) * k
    rank_col = np.repeat(ranks, per_rank)
    # position of each row inside its rank's list: microbatch-major, kind-minor
    offs = np.arange(len(rank_col)) - np.repeat(np.cumsum(per_rank) - per_rank, per_rank)
    mb = offs // k
    kind = np.asarray(kinds, dtype=np.int8)[offs % k]
    rows = np.zeros(len(rank_col), dtype=CHUNK_DTYPE)
    rows["rank"] = rank_col
    rows["iteration"] = iteration
    rows["dp"] = view.dp[rank_col]
    rows["stage"] = view.stage[rank_col]
    rows["src_dp"] = -1
    rows["kind"] = kind
    rows["microbatch"] = mb
    rows["direction"] = np.where(kind == ChunkKind.SEND, 1, 0)
    dur = np.full(len(rows), chunk_s)
    dur[kind == ChunkKind.B] *= 2
    if rng is not None:
        dur *= 1 + 0.02 * rng.random(len(rows))
    if slow:
        for r, f in slow.items():
            dur[rank_col == r] *= f
    start = t0_s + (rows["stage"] + offs) * chunk_s * 1.5
    rows["start_s"] = start
    rows["end_s"] = start + dur
    rows["compute_s"] = np.where(kind <= ChunkKind.W, dur * 0.9, -1.0)
    return rows

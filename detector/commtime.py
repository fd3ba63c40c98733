"""Own transfer time of RECV and ALLREDUCE rows, with the wait for the peer taken out.

docs/trace-format.md ("Communication rows") defines a RECV or ALLREDUCE row as
the trainer times it: from posting the operation to its completion, so a
receive that was posted before its sender finished also holds the wait for the
sender (the torch trainer; the simulator's default ``comm_timing="blocking"``).
A slow GPU then makes every receive up- and downstream of it (and every other
replica's all-reduce) long: read as raw durations, healthy links looked up to
55x slower (issue 28: 272 of 346 false reports).

What the link itself took is what follows the later of the two ends being
ready.  The record says both on the collector's common clock:

* RECV of an activation at stage *s* (direction +1): the sender is the F chunk
  of the same micro-batch at stage *s-1*; of a gradient (direction -1), the B
  chunk at stage *s+1*.  ``own = end - max(start, sender_end)``.
* ALLREDUCE at stage *s*: it cannot finish before the last replica's last
  chunk of that stage: ``own = end - max(start, last_end)``.

A receive posted after its sender had already finished (``start >
sender_end``) measured only the tail of a transfer that began earlier (the
data was in flight, or buffered, while the receiver computed): it is not a
measurement of the link and is dropped.  With pure-transfer rows
(``start == sender_end``) ``own`` is the row's duration, unchanged.  A row
whose sender chunk is not in the record keeps its duration.  Clock skew
between the two nodes shifts ``own`` by the skew; it is constant per link, so
it moves the link's baseline, not its changes.
"""

from __future__ import annotations

import numpy as np

from resihp.schemas import ChunkKind

F = int(ChunkKind.F)
B = int(ChunkKind.B)
RECV = int(ChunkKind.RECV)
ALLREDUCE = int(ChunkKind.ALLREDUCE)
#: Slack when comparing a receive's posting time with its sender's end (seconds): the
#: record's times are rounded, and a pure-transfer row starts exactly at the sender's end.
POST_SLACK_S = 1e-4


def _code(dp, stage, src, mb) -> np.ndarray:
    return ((dp.astype(np.int64) * 4096 + stage) * 4096 + src) * 65536 + mb


def own_comm_time(
    dp: np.ndarray,
    stage: np.ndarray,
    src: np.ndarray,
    mb: np.ndarray,
    kind: np.ndarray,
    direction: np.ndarray,
    start: np.ndarray,
    duration: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(durations with RECV/ALLREDUCE rows replaced by their own time, mask of rows to keep)."""
    dur = duration.astype(np.float64, copy=True)
    keep = np.ones(len(kind), dtype=bool)
    end = start + duration
    recv = np.flatnonzero((kind == RECV) & (direction != 0))
    if len(recv):
        sender_end = np.full(len(recv), np.nan)
        for k, sign in ((F, 1), (B, -1)):
            sel = kind == k
            if not sel.any():
                continue
            codes = _code(dp[sel], stage[sel], src[sel], mb[sel])
            order = np.argsort(codes, kind="stable")
            codes, ends = codes[order], end[sel][order]
            mine = direction[recv] == sign
            want = _code(dp[recv], stage[recv] - sign, src[recv], mb[recv])
            pos = np.clip(np.searchsorted(codes, want), 0, len(codes) - 1)
            hit = mine & (codes[pos] == want)
            sender_end[hit] = ends[pos[hit]]
        known = np.isfinite(sender_end) & np.isfinite(start[recv])
        late = known & (start[recv] > sender_end + POST_SLACK_S)
        keep[recv[late]] = False
        w = known & ~late
        dur[recv[w]] = np.maximum(0.0, end[recv[w]] - np.maximum(start[recv[w]], sender_end[w]))
    ar = np.flatnonzero(kind == ALLREDUCE)
    comp = kind <= int(ChunkKind.W)
    if len(ar) and comp.any():
        last = np.full(int(stage.max()) + 1, -np.inf)
        np.maximum.at(last, stage[comp], end[comp])
        ready = last[stage[ar]]
        ok = np.isfinite(ready) & np.isfinite(start[ar])
        dur[ar[ok]] = np.maximum(0.0, end[ar[ok]] - np.maximum(start[ar[ok]], ready[ok]))
    return dur, keep

"""One job's telemetry beyond one shard: K node groups, K streams, K collectors, one merger.

A job too large for one Redis stream (or one collector core) spreads its telemetry over K
streams (``keys.telemetry_shard(k, K)``, hash tag ``{JOB/sk.N}``: K slots, one in each
K-th of the slot space, so on a Redis Cluster of at least K masters normally K masters).
Node group k is the contiguous nodes ``[k*N/K, (k+1)*N/K)`` (:func:`shard_of_node`); every
rank sends to its node's stream.  Tensor-parallel groups stay inside a node, so no TP group
spans two shards.

* :class:`ShardCollector` k is the ordinary collector (validation, dedup, TP aggregation,
  per-node liveness, per-rank clock skew) restricted to the ranks of its nodes: it reads
  stream k, expects only its ranks, judges only its nodes, and publishes partial records
  on ``keys.partials(k)`` in the job's slot (config ``instance`` ``shard<k>``).
* :class:`RecordMerger` is the one place where the iteration record is assembled: once
  the K partial records of an iteration are in (or ``wait_s`` after the first), it merges
  them (:func:`merge_partials`) and publishes the job's ``IterationRecord`` on
  ``keys.iterations``, complete only when all K partials were.  Liveness events stay per
  node: each shard collector writes its nodes' events to ``keys.liveness`` directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import redis

from collector.config import CollectorConfig
from collector.predictions import LayoutPredictions
from collector.service import CollectorService, encode_fast
from resihp.keys import JobKeys
from resihp.schemas import IterationRecord
from resihp.topology import Layout
from resihp.wire import decode_entry

log = logging.getLogger(__name__)


def shard_of_node(node: int, num_nodes: int, shards: int) -> int:
    """The node group (0..shards-1) of ``node``: contiguous groups of equal size."""
    return min(shards - 1, node * shards // max(1, num_nodes))


def shard_ranks(layout: Layout, shard: int, shards: int) -> np.ndarray:
    """Every rank of the layout (active, standby, dead) on a node of group ``shard``."""
    nodes = -(-layout.world_size // layout.devices_per_node)
    ranks = np.arange(layout.world_size)
    mine = np.array([shard_of_node(int(n), nodes, shards) for n in range(nodes)])
    return ranks[mine[ranks // layout.devices_per_node] == shard]


class ShardCollector(CollectorService):
    """The collector of node group ``shard`` of ``shards`` (see the module doc)."""

    def __init__(self, config: CollectorConfig, client: redis.Redis, shard: int, shards: int):
        if not 0 <= shard < shards:
            raise ValueError(f"shard must be in [0, {shards}), got {shard}")
        self.shard, self.shards = shard, shards
        keys = JobKeys(config.job_id)
        super().__init__(
            config,
            client,
            telemetry_stream=keys.telemetry_shard(shard, shards),
            records_stream=keys.partials(shard),
        )

    def set_layout(self, layout: Layout, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        super().set_layout(layout, now)
        mine = shard_ranks(layout, self.shard, self.shards)
        view = self.assembler.view
        if view is not None:
            view.expected_ranks = np.intersect1d(view.expected_ranks, mine)
        owned = set(mine.tolist())
        expected = {r: n for r, n in self.liveness._rank_node.items() if r in owned}
        self.liveness.set_expected(expected, set(layout.dead) & owned, now)


def merge_partials(parts: list[IterationRecord], shards: int) -> IterationRecord:
    """The job's record of one iteration from its shards' partial records: columns
    concatenated (no TP group spans two shards), times the outer bounds, micro-batch
    stats once per (replica, micro-batch), complete only if all ``shards`` were."""
    it = parts[0].iteration
    chunks: dict[str, list] = {}
    ranks: dict[str, list] = {}
    probes: dict[str, list] = {}
    for p in parts:
        for dst, src in ((chunks, p.chunks), (ranks, p.ranks), (probes, p.probes or {})):
            for k, v in src.items():
                dst.setdefault(k, []).extend(np.asarray(v).tolist())
    seen: dict[tuple[int, int], int] = {}
    mb_cols = ("dp", "microbatch", "token_budget", "num_docs", "sum_sq_len", "max_len")
    mbs: dict[str, list] = {c: [] for c in mb_cols}
    for p in parts:
        m = p.microbatches or {}
        for i in range(len(m.get("dp", []))):
            key = (int(m["dp"][i]), int(m["microbatch"][i]))
            if key in seen:
                continue
            seen[key] = 1
            for c in mb_cols:
                mbs[c].append(m[c][i])
    start = min(p.start_s for p in parts)
    end = max(p.end_s for p in parts)
    # samples: distinct micro-batches (by owning replica) that ran compute, as build_record
    samples = 0
    if chunks.get("kind"):
        compute = np.isin(np.asarray(chunks["kind"]), ["F", "B", "W"])
        src, dp = np.asarray(chunks["src_dp"]), np.asarray(chunks["dp"])
        owner = np.where(src >= 0, src, dp).astype(np.int64)
        mb = np.asarray(chunks["microbatch"]).astype(np.int64)
        samples = int(np.unique((owner << 20 | mb)[compute]).size)
    rec = IterationRecord(
        iteration=it,
        iteration_time_s=max(0.0, end - start),
        start_s=start,
        end_s=end,
        samples=samples,
        tokens=int(sum(mbs["token_budget"])),
        num_ranks_reporting=sum(p.num_ranks_reporting for p in parts),
        chunks=chunks,
        ranks=ranks,
        microbatches=mbs,
        layout_id=max(p.layout_id for p in parts),
        complete=len(parts) == shards and all(p.complete for p in parts),
    )
    if probes:
        rec.probes = probes
    return rec


@dataclass
class RecordMerger:
    """The one assembly point of a sharded job (see the module doc)."""

    client: redis.Redis
    job_id: str
    shards: int
    #: after the first partial of an iteration, publish without the missing ones this late
    wait_s: float = 30.0
    maxlen: int = 1000
    #: iteration -> shard -> (partial's entry id, partial record)
    open: dict[int, dict[int, tuple]] = field(default_factory=dict)
    first_s: dict[int, float] = field(default_factory=dict)
    done_floor: int = -1
    published_total: int = 0

    def __post_init__(self) -> None:
        self.keys = JobKeys(self.job_id)
        self.group = self.keys.group("merger")
        self.streams = [self.keys.partials(k) for k in range(self.shards)]
        self.predictions = LayoutPredictions(self.client, self.keys)
        for stream in self.streams:
            try:
                self.client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def run_once(self, block_ms: int = 100) -> int:
        """Read partials, publish the iterations whose shards are all in (or timed out);
        -> records published.  Partials are acknowledged once their record is out."""
        resp = self.client.xreadgroup(
            self.group, "merger-0", dict.fromkeys(self.streams, ">"), count=64, block=block_ms
        )
        for stream, entries in resp or []:
            shard = self.streams.index(stream.decode() if isinstance(stream, bytes) else stream)
            for eid, fields in entries:
                good, _bad = decode_entry(fields)
                for m in good:
                    if isinstance(m, IterationRecord) and m.iteration > self.done_floor:
                        self.open.setdefault(m.iteration, {})[shard] = (eid, m)
                        self.first_s.setdefault(m.iteration, time.monotonic())
        n = 0
        now = time.monotonic()
        for it in sorted(self.open):
            parts = self.open[it]
            if len(parts) < self.shards and now - self.first_s[it] < self.wait_s:
                continue
            rec = merge_partials([parts[k][1] for k in sorted(parts)], self.shards)
            self.client.xadd(
                self.keys.iterations, encode_fast(rec), maxlen=self.maxlen, approximate=True
            )
            self.predictions.observe(rec)
            for k, (eid, _) in parts.items():
                self.client.xack(self.streams[k], self.group, eid)
            del self.open[it], self.first_s[it]
            self.done_floor = max(self.done_floor, it)
            n += 1
        self.published_total += n
        return n

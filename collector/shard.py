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
from resihp.bus import StreamConsumer, dead_letter
from resihp.keys import JobKeys
from resihp.schemas import RECORD_FLAGS, IterationRecord
from resihp.topology import Layout

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
    # a shard's flag (its span beyond the bound) is the job's: the merged span holds it
    rec.flags = [f for f in RECORD_FLAGS if any(f in p.flags for p in parts)]
    return rec


@dataclass
class RecordMerger:
    """The one assembly point of a sharded job (see the module doc).

    Each partials stream is read through a :class:`resihp.bus.StreamConsumer` (group
    ``keys.group("merger")``): a restarted merger first re-reads the partials it took but
    never acknowledged, a dead merger's are reclaimed after ``claim_idle_ms``, and an
    undecodable entry is dead-lettered with its reason and acknowledged.  A message that is
    not an ``IterationRecord``, and a partial of an iteration already published (late),
    is dead-lettered with the reason and acknowledged too (counters
    ``merger_rejected_total``, ``merger_late_partials_total``): nothing stays pending
    forever and nothing is dropped without a trace."""

    client: redis.Redis
    job_id: str
    shards: int
    #: after the first partial of an iteration, publish without the missing ones this late
    wait_s: float = 30.0
    maxlen: int = 1000
    #: a partial another merger took and left unacknowledged this long is reclaimed (ms)
    claim_idle_ms: int = 30_000
    #: iteration -> shard -> (partial's entry id, partial record)
    open: dict[int, dict[int, tuple]] = field(default_factory=dict)
    first_s: dict[int, float] = field(default_factory=dict)
    done_floor: int = -1
    published_total: int = 0
    late_total: int = 0
    rejected_total: int = 0

    def __post_init__(self) -> None:
        self.keys = JobKeys(self.job_id)
        self.group = self.keys.group("merger")
        self.streams = [self.keys.partials(k) for k in range(self.shards)]
        self.predictions = LayoutPredictions(self.client, self.keys)
        self.inputs = [
            StreamConsumer(
                self.client,
                self.keys,
                stream,
                self.group,
                consumer="merger-0",
                claim_idle_ms=self.claim_idle_ms,
            )
            for stream in self.streams
        ]
        for c in self.inputs:
            c.ensure_group()
        #: (shard, entry id) -> iterations it holds partials of that are not yet out
        self._holds: dict[tuple[int, bytes], set[int]] = {}

    def _refuse(self, shard: int, eid: bytes, counter: str, reason: str, raw) -> None:
        dead_letter(self.client, self.keys, self.streams[shard], "merger", reason, raw)
        self.client.hincrby(self.keys.counters, counter, 1)

    def _take(self, shard: int, eid: bytes, messages: list) -> None:
        held: set[int] = set()
        for m in messages:
            if not isinstance(m, IterationRecord):
                self.rejected_total += 1
                what = getattr(m, "TYPE", type(m).__name__)
                raw = m.to_dict() if hasattr(m, "to_dict") else repr(m)[:2000]
                self._refuse(
                    shard,
                    eid,
                    "merger_rejected_total",
                    f"{what} on the partial-records stream of shard {shard}: ignored",
                    raw,
                )
            elif m.iteration <= self.done_floor:
                self.late_total += 1
                self._refuse(
                    shard,
                    eid,
                    "merger_late_partials_total",
                    f"late partial record of iteration {m.iteration} from shard {shard}: "
                    f"the job's record of it is out (merged up to {self.done_floor})",
                    {"iteration": m.iteration, "shard": shard, "flags": m.flags},
                )
            else:
                old = self.open.setdefault(m.iteration, {}).get(shard)
                self.open[m.iteration][shard] = (eid, m)
                self.first_s.setdefault(m.iteration, time.monotonic())
                held.add(m.iteration)
                if old is not None and old[0] != eid:
                    self._release(shard, old[0], m.iteration)
        if held:
            self._holds.setdefault((shard, eid), set()).update(held)
        else:
            self.inputs[shard].ack([eid])

    def _release(self, shard: int, eid: bytes, iteration: int) -> None:
        its = self._holds.get((shard, eid))
        if its is None:
            return
        its.discard(iteration)
        if not its:
            del self._holds[(shard, eid)]
            self.inputs[shard].ack([eid])

    def run_once(self, block_ms: int = 100) -> int:
        """Read partials, publish the iterations whose shards are all in (or timed out);
        -> records published.  Partials are acknowledged once their record is out."""
        got = 0
        for shard, c in enumerate(self.inputs):
            for eid, messages in c.read(count=64, block_ms=None):
                got += 1
                self._take(shard, eid, messages)
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
                self._release(k, eid, it)
            del self.open[it], self.first_s[it]
            self.done_floor = max(self.done_floor, it)
            n += 1
        self.published_total += n
        if not got and not n and block_ms:
            time.sleep(block_ms / 1000)
        return n

"""Synthetic IterationRecords for the detector's unit tests (not a simulator).

``SyntheticJob`` draws packed micro-batches with long-tailed document lengths,
costs every chunk with eq. 1 plus noise, runs the shared pipeline DAG to get
chunk start times and the iteration time, and assembles an ``IterationRecord``
directly (TP-group max durations, per-rank compute time).  Slowdowns can be
switched on per rank (compute) or per pipeline link (P2P).  The full cluster
simulator (``trainer/sim``) and the collector's assembler are what the bench
uses; this helper only gives unit tests small, controlled series.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from resihp.pipeline.dag import PipelineDAG
from resihp.schemas import KIND_NAMES, IterationRecord
from resihp.topology import Layout


def pack_microbatch(
    rng: np.random.Generator, token_budget: int, mean_doc: float
) -> tuple[int, float, int]:
    """Documents with lognormal lengths packed into one micro-batch: (num_docs, sum l^2, max l)."""
    lens = []
    left = token_budget
    while left > 0:
        ln = int(min(left, max(16, rng.lognormal(np.log(mean_doc), 1.0))))
        lens.append(ln)
        left -= ln
    a = np.asarray(lens, dtype=float)
    return len(lens), float((a * a).sum()), int(a.max())


@dataclass
class SyntheticJob:
    layout: Layout
    token_budget: int = 8192
    mean_doc: float = 1500.0
    alpha_s: float = 2.0e-6  # per token per stage holding an even share of the layers
    beta_s: float = 2.0e-10  # per l^2
    noise: float = 0.01
    p2p_s: float = 0.002
    seed: int = 0
    rank_slow: dict[int, float] = field(default_factory=dict)
    link_slow: dict[tuple[int, int], float] = field(
        default_factory=dict
    )  # (dp, lower stage) -> factor
    iteration: int = 0
    clock_s: float = 1000.0
    node_skew_s: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.dag = PipelineDAG.from_layout(self.layout)

    def next_record(self) -> IterationRecord:
        lay, dag, rng = self.layout, self.dag, self.rng
        mbs = {}
        for d in range(lay.dp):
            for j in range(lay.microbatches[d]):
                mbs[(d, j)] = pack_microbatch(rng, self.token_budget, self.mean_doc)
        st = dag.chunk_stage
        kd = dag.chunk_kind
        mult = np.where(kd == 0, 1.0, np.where(kd == 1, 1.0 if dag.split_w else 2.0, 1.0))
        n = np.full(len(st), float(self.token_budget))
        sq = np.array(
            [mbs[(int(s), int(j))][1] for s, j in zip(dag.chunk_src_dp, dag.chunk_mb, strict=True)]
        )
        # a stage's chunks cost in proportion to the layers it holds (alpha, beta are for
        # an even share): a replan that moves layers changes its chunk times
        per_layer = np.asarray(lay.layers, dtype=float) * lay.pp / lay.num_layers
        base = (self.alpha_s * n + self.beta_s * sq) * mult * per_layer[st]
        base *= 1 + self.noise * rng.standard_normal(len(st))
        # per-rank speed factors within each TP group
        coords = lay.coords()
        gfac = np.ones(len(st))
        rank_factor = {r: self.rank_slow.get(r, 1.0) for r in coords}
        for d, s in {(int(a), int(b)) for a, b in zip(dag.chunk_dp, st, strict=True)}:
            grp = lay.groups[d][s]
            f = max(rank_factor.get(r, 1.0) for r in grp) if grp else 1.0
            if f != 1.0:
                gfac[(dag.chunk_dp == d) & (st == s)] = f
        cost = base * gfac
        edge = np.full(dag.num_edges, self.p2p_s) * (
            1 + self.noise * rng.standard_normal(dag.num_edges)
        )
        if self.link_slow:
            es = st[dag.edge_src]
            ed = st[dag.edge_dst]
            edp = dag.chunk_dp[dag.edge_src]
            for (d, s), f in self.link_slow.items():
                edge[(edp == d) & (np.minimum(es, ed) == s)] *= f
        res = dag.evaluate(cost, edge)
        t0 = self.clock_s
        it_time = res.iteration_time_s + 0.01
        # chunks (TP-group view)
        ch = {
            "dp": dag.chunk_dp.tolist(),
            "stage": st.tolist(),
            "src_dp": dag.chunk_src_dp.tolist(),
            "microbatch": dag.chunk_mb.tolist(),
            "kind": KIND_NAMES[kd].tolist(),
            "start_s": (
                t0
                + res.start_s
                + np.array(
                    [self._skew(lay, int(d), int(s)) for d, s in zip(dag.chunk_dp, st, strict=True)]
                )
            ).tolist(),
            "duration_s": cost.tolist(),
        }
        # P2P sends: one per data edge, on the sending stage
        sd = dag.chunk_dp[dag.edge_src]
        ss = st[dag.edge_src]
        for i in range(dag.num_edges):
            ch["dp"].append(int(sd[i]))
            ch["stage"].append(int(ss[i]))
            ch["src_dp"].append(int(dag.chunk_src_dp[dag.edge_src[i]]))
            ch["microbatch"].append(int(dag.chunk_mb[dag.edge_src[i]]))
            ch["kind"].append("SEND")
            ch["start_s"].append(float(t0 + res.end_s[dag.edge_src[i]]))
            ch["duration_s"].append(float(edge[i]))
        # ranks
        ranks = {"rank": [], "dp": [], "stage": [], "busy_s": [], "compute_s": [], "comm_s": []}
        for r, (d, s, _t) in sorted(coords.items()):
            sel = (dag.chunk_dp == d) & (st == s)
            ranks["rank"].append(r)
            ranks["dp"].append(d)
            ranks["stage"].append(s)
            ranks["busy_s"].append(float(cost[sel].sum()))
            ranks["compute_s"].append(float((base[sel] * rank_factor.get(r, 1.0)).sum()))
            ranks["comm_s"].append(float(self.p2p_s * 2 * lay.microbatches[d]))
        mcols = {
            "dp": [],
            "microbatch": [],
            "token_budget": [],
            "num_docs": [],
            "sum_sq_len": [],
            "max_len": [],
        }
        for (d, j), (k, s2, mx) in sorted(mbs.items()):
            mcols["dp"].append(d)
            mcols["microbatch"].append(j)
            mcols["token_budget"].append(self.token_budget)
            mcols["num_docs"].append(k)
            mcols["sum_sq_len"].append(s2)
            mcols["max_len"].append(mx)
        rec = IterationRecord(
            iteration=self.iteration,
            iteration_time_s=it_time,
            start_s=t0,
            end_s=t0 + it_time,
            samples=lay.total_microbatches,
            tokens=lay.total_microbatches * self.token_budget,
            num_ranks_reporting=len(ranks["rank"]),
            chunks=ch,
            ranks=ranks,
            microbatches=mcols,
            layout_id=lay.layout_id,
        )
        self.iteration += 1
        self.clock_s += it_time
        return rec

    def _skew(self, lay: Layout, d: int, s: int) -> float:
        if not self.node_skew_s:
            return 0.0
        grp = lay.groups[d][s]
        return self.node_skew_s.get(lay.node_of(grp[0]), 0.0) if grp else 0.0

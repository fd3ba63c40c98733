"""Chunk, P2P and all-reduce costs for the pipeline DAG (paper eq. 1, §7 P2P rule).

Forward compute of a packed micro-batch on one (replica, stage) TP group is
``alpha*N + beta*sum(l_i^2)`` (eq. 1).  ``alpha`` and ``beta`` scale with the
layers on the stage, divide by the TP degree and by the group's effective
speed (its slowest member: TP collectives synchronise every layer).  TP
collectives add a per-token NVLink term to F and B.  B and W are fixed
multiples of the forward compute (B ~ W ~ F with the ZB split; fused B = B+W).

P2P between stages follows §7: the sender scatters the activation into
``max(TP_send, TP_recv)`` pieces sent in parallel over the NICs of the smaller
group, and the receiver all-gathers over NVLink; same-node transfers use
NVLink only.  The DP gradient all-reduce is a ring over the stage's replicas.
All bandwidths are bytes per second and can be slowed per rank (``link_speed``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from resihp.topology import Layout

from .dag import PipelineDAG


@dataclass(frozen=True)
class StageCost:
    """Eq. 1 coefficients of one TP group at its current layers, degree and speed.

    Forward compute time = ``alpha_s_per_token * N + beta_s_per_token2 * sum(l^2)``;
    ``tp_comm_s_per_token * N`` is added to F and B for the TP collectives.
    """

    alpha_s_per_token: float
    beta_s_per_token2: float
    tp_comm_s_per_token: float = 0.0

    def forward_s(self, tokens: float, sum_sq_len: float) -> float:
        return (
            self.alpha_s_per_token * tokens
            + self.beta_s_per_token2 * sum_sq_len
            + (self.tp_comm_s_per_token * tokens)
        )


def _as_ragged(x, counts: list[int], name: str) -> np.ndarray:
    """Flatten per-replica per-micro-batch values (scalar, 2-D array or list of lists)."""
    total = sum(counts)
    if np.isscalar(x):
        return np.full(total, float(x))
    rows = list(x)
    if len(rows) != len(counts):
        raise ValueError(f"{name} has {len(rows)} replicas, layout has {len(counts)}")
    out = []
    for d, (row, m) in enumerate(zip(rows, counts, strict=True)):
        r = np.atleast_1d(np.asarray(row, dtype=float))
        if r.size == 1 and m != 1:
            r = np.full(m, float(r[0]))
        if r.size < m:
            raise ValueError(f"{name}[{d}] has {r.size} values, replica {d} has {m} micro-batches")
        out.append(r[:m])
    return np.concatenate(out) if out else np.zeros(0)


@dataclass
class CostModel:
    """Cost model of one model on one cluster; see the module docstring.

    Per-layer coefficients are for one device at speed 1.0 and TP degree 1.
    ``stage_overrides`` maps ``(dp, stage)`` to a fitted :class:`StageCost`
    (the detector's warm-up profile) that replaces the analytic one.
    """

    alpha_layer_s_per_token: float
    beta_layer_s_per_token2: float
    hidden: int = 4096
    params_per_layer: float = 202e6
    head_alpha_s_per_token: float = 0.0  # LM head + loss on the last stage, TP=1
    head_params: float = 0.0
    ratio_b: float = 1.0  # B compute / F compute (ZB split)
    ratio_w: float = 1.0  # W compute / F compute
    bytes_per_elem: int = 2
    grad_bytes_per_param: int = 2
    tokens_per_microbatch: int = 4096  # P2P message size is N * hidden * bytes
    nvlink_bytes_per_s: float = 230e9
    ib_bytes_per_s: float = 20e9
    nvlink_latency_s: float = 3e-6
    ib_latency_s: float = 7.5e-6
    tp_allreduces_per_layer: int = 2
    allreduce_overlap: float = 0.0  # fraction of the DP all-reduce hidden behind compute
    stage_overrides: dict[tuple[int, int], StageCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (
            "alpha_layer_s_per_token",
            "beta_layer_s_per_token2",
            "ratio_b",
            "ratio_w",
            "head_alpha_s_per_token",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("nvlink_bytes_per_s", "ib_bytes_per_s", "hidden", "tokens_per_microbatch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostModel.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.allreduce_overlap <= 1.0:
            raise ValueError(
                f"CostModel.allreduce_overlap must be in [0, 1], got {self.allreduce_overlap}"
            )
        self._dag_cache: OrderedDict[str, PipelineDAG] = OrderedDict()

    # ------------------------------------------------------------ per group
    @property
    def p2p_bytes_per_microbatch(self) -> float:
        return float(self.tokens_per_microbatch) * self.hidden * self.bytes_per_elem

    def _tp_comm_per_token(self, t: int, link: float) -> float:
        if t <= 1:
            return 0.0
        per_token = self.hidden * self.bytes_per_elem
        return (
            self.tp_allreduces_per_layer
            * 2
            * (t - 1)
            / t
            * per_token
            / (self.nvlink_bytes_per_s * link)
        )

    def stage_cost(
        self,
        layout: Layout,
        dp: int,
        stage: int,
        device_speed: Mapping[int, float] | None = None,
        link_speed: Mapping[int, float] | None = None,
    ) -> StageCost | None:
        """Coefficients of the TP group running ``stage`` in replica ``dp`` (None if it has no devices)."""
        if (dp, stage) in self.stage_overrides:
            return self.stage_overrides[(dp, stage)]
        grp = layout.groups[dp][stage]
        if not grp:
            return None
        t = len(grp)
        speed = min(device_speed.get(r, 1.0) for r in grp) if device_speed else 1.0
        link = min(link_speed.get(r, 1.0) for r in grp) if link_speed else 1.0
        if speed <= 0:
            raise ValueError(
                f"device speed of group dp={dp} stage={stage} is {speed}; dead ranks cannot run work"
            )
        n_layers = layout.layers[stage]
        alpha = n_layers * self.alpha_layer_s_per_token
        if stage == layout.pp - 1:
            alpha += self.head_alpha_s_per_token
        return StageCost(
            alpha_s_per_token=alpha / (t * speed),
            beta_s_per_token2=n_layers * self.beta_layer_s_per_token2 / (t * speed),
            tp_comm_s_per_token=n_layers * self._tp_comm_per_token(t, max(link, 1e-9)),
        )

    def stage_coefficients(self, layout: Layout, device_speed=None, link_speed=None) -> np.ndarray:
        """``[dp, pp, 3]`` array of (alpha, beta, tp_comm) per TP group (zeros where empty).

        Vectorized over groups (the same numbers as :meth:`stage_cost` for each); only the
        ranks named in the speed maps are visited, so a 16,384-GPU layout costs one pass.
        """
        if not self.stage_overrides:
            return self._stage_coefficients_fast(layout, device_speed, link_speed)
        out = np.zeros((layout.dp, layout.pp, 3))
        for d in range(layout.dp):
            for s in range(layout.pp):
                sc = self.stage_cost(layout, d, s, device_speed, link_speed)
                if sc is not None:
                    out[d, s] = (sc.alpha_s_per_token, sc.beta_s_per_token2, sc.tp_comm_s_per_token)
        return out

    def _group_min(self, layout: Layout, t: np.ndarray, speeds) -> np.ndarray:
        """Per group: min over its ranks of ``speeds.get(r, 1.0)`` (1.0 where none named)."""
        D, P = t.shape
        out = np.ones((D, P))
        if not speeds:
            return out
        where = {}
        for d, st in enumerate(layout.groups):
            for s_, g in enumerate(st):
                for r in g:
                    where[r] = (d, s_)
        mn = np.full((D, P), np.inf)
        cnt = np.zeros((D, P))
        for r, v in speeds.items():
            ds = where.get(r)
            if ds is not None:
                mn[ds] = min(mn[ds], float(v))
                cnt[ds] += 1
        named = cnt > 0
        out[named] = np.where(cnt[named] >= t[named], mn[named], np.minimum(1.0, mn[named]))
        return out

    def _stage_coefficients_fast(self, layout: Layout, device_speed, link_speed) -> np.ndarray:
        t = np.array([[len(g) for g in st] for st in layout.groups], dtype=float).reshape(
            layout.dp, layout.pp
        )
        live = t > 0
        speed = self._group_min(layout, t, device_speed)
        link = self._group_min(layout, t, link_speed)
        bad = live & (speed <= 0)
        if bad.any():
            d, st = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(
                f"device speed of group dp={d} stage={st} is {speed[d, st]}; dead ranks cannot run work"
            )
        n = np.asarray(layout.layers, dtype=float)[None, :]
        alpha = np.broadcast_to(n * self.alpha_layer_s_per_token, t.shape).copy()
        alpha[:, -1] += self.head_alpha_s_per_token
        denom = np.where(live, t * speed, 1.0)
        comm = np.zeros(t.shape)
        pairs = {(int(a), float(b)) for a, b in zip(t[live], link[live], strict=True)}
        for a, b in pairs:
            m = live & (t == a) & (link == b)
            comm[m] = self._tp_comm_per_token(a, max(b, 1e-9))
        out = np.zeros((layout.dp, layout.pp, 3))
        out[..., 0] = np.where(live, alpha / denom, 0.0)
        out[..., 1] = np.where(live, n * self.beta_layer_s_per_token2 / denom, 0.0)
        out[..., 2] = np.where(live, n * comm, 0.0)
        return out

    # ------------------------------------------------------------ chunks
    def chunk_costs(
        self,
        dag: PipelineDAG,
        layout: Layout,
        token_budget,
        sum_sq_len,
        device_speed: Mapping[int, float] | None = None,
        link_speed: Mapping[int, float] | None = None,
    ) -> np.ndarray:
        """Execution time of every chunk of ``dag`` (seconds).

        ``token_budget`` and ``sum_sq_len`` are per owner replica per
        micro-batch (``[dp][mb]``, scalars broadcast).
        """
        coef = self.stage_coefficients(layout, device_speed, link_speed)
        return self.chunk_costs_from_coefficients(dag, layout, coef, token_budget, sum_sq_len)

    def chunk_costs_from_coefficients(
        self, dag, layout, coef, token_budget, sum_sq_len
    ) -> np.ndarray:
        compute, comm = self.chunk_cost_parts(dag, layout, coef, token_budget, sum_sq_len)
        return compute + comm

    def chunk_cost_parts(
        self, dag: PipelineDAG, layout: Layout, coef: np.ndarray, token_budget, sum_sq_len
    ) -> tuple[np.ndarray, np.ndarray]:
        """(pure compute, TP collective) seconds of every chunk, from ``stage_coefficients``."""
        counts = list(layout.microbatches)
        n_flat = _as_ragged(token_budget, counts, "token_budget")
        s_flat = _as_ragged(sum_sq_len, counts, "sum_sq_len")
        off = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        mb_idx = off[dag.chunk_src_dp] + dag.chunk_mb
        n = n_flat[mb_idx]
        sq = s_flat[mb_idx]
        dev = dag.chunk_dp * layout.pp + dag.chunk_stage
        c = coef.reshape(-1, 3)[dev]
        if dag.split_w:
            f_comp = np.array([1.0, self.ratio_b, self.ratio_w])
        else:
            f_comp = np.array([1.0, self.ratio_b + self.ratio_w, 0.0])
        f_comm = np.array([1.0, 1.0, 0.0])  # W has no TP collective
        k = dag.chunk_kind.astype(np.int64)
        compute = (c[:, 0] * n + c[:, 1] * sq) * f_comp[k]
        comm = c[:, 2] * n * f_comm[k]
        return compute, comm

    # ------------------------------------------------------------ P2P
    def p2p_time_s(
        self,
        layout: Layout,
        src: tuple[int, int],
        dst: tuple[int, int],
        link_speed: Mapping[int, float] | None = None,
        nbytes: float | None = None,
    ) -> float:
        """Time to move one micro-batch's activation/gradient from TP group ``src`` to ``dst``."""
        g1 = layout.groups[src[0]][src[1]]
        g2 = layout.groups[dst[0]][dst[1]]
        if not g1 or not g2:
            return 0.0
        size = self.p2p_bytes_per_microbatch if nbytes is None else nbytes
        link = min(link_speed.get(r, 1.0) for r in (*g1, *g2)) if link_speed else 1.0
        link = max(link, 1e-9)
        t1, t2 = len(g1), len(g2)
        nodes = {layout.node_of(r) for r in (*g1, *g2)}
        gather = (t2 - 1) / t2 * size / self.nvlink_bytes_per_s if t2 > 1 else 0.0
        if len(nodes) == 1:
            return (
                self.nvlink_latency_s
                + size / min(t1, t2) / (self.nvlink_bytes_per_s * link)
                + gather
            )
        return self.ib_latency_s + size / min(t1, t2) / (self.ib_bytes_per_s * link) + gather

    def _group_arrays(
        self, layout: Layout, link_speed
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (dp, stage) group: TP degree, node, slowest link factor (flattened dp*pp)."""
        n = layout.dp * layout.pp
        tdeg = np.ones(n)
        node = np.full(n, -1, dtype=np.int64)
        link = np.ones(n)
        for d, st in enumerate(layout.groups):
            for s, g in enumerate(st):
                if g:
                    i = d * layout.pp + s
                    tdeg[i] = len(g)
                    node[i] = layout.node_of(g[0])  # a TP group never spans nodes
                    if link_speed:
                        link[i] = max(min(link_speed.get(r, 1.0) for r in g), 1e-9)
        return tdeg, node, link

    def edge_costs(
        self, dag: PipelineDAG, layout: Layout, link_speed: Mapping[int, float] | None = None
    ) -> np.ndarray:
        """P2P time on every data edge of ``dag`` (seconds); same rule as :meth:`p2p_time_s`."""
        tdeg, node, link = self._group_arrays(layout, link_speed)
        src, dst = dag.edge_src_dev, dag.edge_dst_dev
        size = self.p2p_bytes_per_microbatch
        t1, t2 = tdeg[src], tdeg[dst]
        same = node[src] == node[dst]
        lk = np.minimum(link[src], link[dst])
        bw = np.where(same, self.nvlink_bytes_per_s, self.ib_bytes_per_s) * lk
        lat = np.where(same, self.nvlink_latency_s, self.ib_latency_s)
        gather = (t2 - 1) / t2 * size / self.nvlink_bytes_per_s
        return lat + size / np.minimum(t1, t2) / bw + gather

    # ------------------------------------------------------------ DP all-reduce
    def allreduce_costs(
        self, layout: Layout, link_speed: Mapping[int, float] | None = None
    ) -> np.ndarray:
        """Per-stage DP gradient all-reduce time (ring over the replicas holding the stage)."""
        out = np.zeros(layout.pp)
        for s in range(layout.pp):
            groups = [g for g in layout.dp_group(s) if g]
            dpn = len(groups)
            if dpn <= 1:
                continue
            params = layout.layers[s] * self.params_per_layer
            if s == layout.pp - 1 or s == 0:
                params += self.head_params / (2 if layout.pp > 1 else 1)
            per_rank = params * self.grad_bytes_per_param / min(len(g) for g in groups)
            ranks = [r for g in groups for r in g]
            link = min(link_speed.get(r, 1.0) for r in ranks) if link_speed else 1.0
            link = max(link, 1e-9)
            one_node = len({layout.node_of(r) for r in ranks}) == 1
            bw = self.nvlink_bytes_per_s if one_node else self.ib_bytes_per_s
            lat = self.nvlink_latency_s if one_node else self.ib_latency_s
            ring = 2 * (dpn - 1) / dpn * per_rank / (bw * link) + 2 * (dpn - 1) * lat
            out[s] = ring * (1.0 - self.allreduce_overlap)
        return out

    # ------------------------------------------------------------ convenience
    def dag_for(self, layout: Layout) -> PipelineDAG:
        """The DAG of ``layout`` (cached on its JSON; structure is built once per layout)."""
        key = json.dumps(layout.to_dict(), sort_keys=True)
        dag = self._dag_cache.get(key)
        if dag is None:
            dag = PipelineDAG.from_layout(layout)
            self._dag_cache[key] = dag
            while len(self._dag_cache) > 16:
                self._dag_cache.popitem(last=False)
        else:
            self._dag_cache.move_to_end(key)
        return dag

    def evaluate(
        self, layout: Layout, token_budget, sum_sq_len, device_speed=None, link_speed=None
    ):
        """Full :class:`EvalResult` of ``layout`` with these micro-batches and speeds."""
        dag = self.dag_for(layout)
        cost = self.chunk_costs(dag, layout, token_budget, sum_sq_len, device_speed, link_speed)
        edges = self.edge_costs(dag, layout, link_speed)
        if dag.has_migrations:
            # migrated chunks run where they arrive under these costs (engine pre-pass)
            dag = dag.retimed(cost, edges)
            cost = self.chunk_costs(dag, layout, token_budget, sum_sq_len, device_speed, link_speed)
            edges = self.edge_costs(dag, layout, link_speed)
        return dag.evaluate(cost, edges, self.allreduce_costs(layout, link_speed))

    def predict_iteration_s(
        self,
        layout: Layout,
        token_budget,
        sum_sq_len,
        device_speed: Mapping[int, float] | None = None,
        link_speed: Mapping[int, float] | None = None,
    ) -> float:
        """Expected iteration time (critical path + DP all-reduce) in seconds."""
        return self.evaluate(
            layout, token_budget, sum_sq_len, device_speed, link_speed
        ).iteration_time_s


__all__ = ["CostModel", "StageCost"]

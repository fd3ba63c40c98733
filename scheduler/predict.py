"""Iteration-time prediction for plans through the shared pipeline engine and cost model.

:class:`Predictor` wraps :func:`resihp.pipeline.models.cost_model_for` (the
paper's Table 3 models calibrated to A100) and evaluates a layout's chunk DAG
(:class:`resihp.pipeline.PipelineDAG`) under device speeds ``p`` (rank ->
normalized throughput), so every number in a plan comes from the same engine
the detector and the simulator use.  Micro-batches are taken as one
``seq_len``-token document each (``sum l^2 = seq_len^2``), the cost-heaviest
packing; ``time_scale`` multiplies every time (calibration against measured
throughput).

DAGs are cached on the layout's *structure* (empty groups, micro-batch counts,
migrations, schedule): layer counts, TP degrees and speeds only change costs,
so the planner's many what-ifs reuse one compiled DAG.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from resihp.pipeline import CostModel, PipelineDAG
from resihp.pipeline.models import cost_model_for
from resihp.topology import Layout
from scheduler.memory import MemoryModel


@dataclass
class Predictor:
    """Cost model of one model/sequence length, evaluated through the DAG engine."""

    model: str = ""
    seq_len: int = 4096
    device_mem_gb: float = 80.0
    time_scale: float = 1.0
    memory: MemoryModel = field(init=False)
    cost: CostModel = field(init=False)
    _dags: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)
    _retimed: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.memory = MemoryModel.for_model(self.model, self.seq_len, self.device_mem_gb)
        try:
            self.cost = cost_model_for(self.model, self.seq_len)
        except ValueError:
            # unknown model: the cost model's defaults (a 7B-class layer)
            self.cost = CostModel(
                alpha_layer_s_per_token=2 * 202e6 / 156e12,
                beta_layer_s_per_token2=2 * 4096 / 156e12,
                tokens_per_microbatch=self.seq_len,
            )

    @property
    def layer_params(self) -> float:
        return self.cost.params_per_layer

    @property
    def _n(self) -> float:
        return float(self.seq_len)

    @property
    def _sq(self) -> float:
        return float(self.seq_len) ** 2

    # ------------------------------------------------------------ per stage
    def stage_speed(self, layout: Layout, p: dict[int, float]) -> np.ndarray:
        out = np.zeros((layout.dp, layout.pp))
        for d, stages in enumerate(layout.groups):
            for s, g in enumerate(stages):
                out[d, s] = min((p.get(r, 1.0) for r in g), default=0.0)
        return out

    def _parts(self, layout: Layout, p: dict[int, float]):
        """Per (replica, stage): compute seconds per layer, TP-comm seconds per layer, head seconds."""
        speed = self.stage_speed(layout, p)
        k = np.array([[max(len(g), 1) for g in st] for st in layout.groups], dtype=float)
        c = self.cost
        live = speed > 0
        denom = np.where(live, k * np.maximum(speed, 1e-12), 1.0)
        comp = (c.alpha_layer_s_per_token * self._n + c.beta_layer_s_per_token2 * self._sq) / denom
        comm = np.vectorize(lambda t: c._tp_comm_per_token(int(t), 1.0))(k) * self._n
        head = np.zeros_like(comp)
        head[:, -1] = c.head_alpha_s_per_token * self._n / denom[:, -1]
        return (
            np.where(live, comp, np.inf),
            np.where(live, comm, np.inf),
            np.where(live, head, np.inf),
        )

    def stage_chunk_s(self, layout: Layout, p: dict[int, float], layers: list[int] | None = None):
        """(F, B, W) seconds per micro-batch for every (replica, stage); inf where no devices."""
        L = np.asarray(layers or layout.layers, dtype=float)[None, :]
        comp, comm, head = self._parts(layout, p)
        fc = comp * L + head
        tc = comm * L
        rb, rw = self.cost.ratio_b, self.cost.ratio_w
        if layout.schedule == "zbh1":
            return (
                (fc + tc) * self.time_scale,
                (fc * rb + tc) * self.time_scale,
                fc * rw * self.time_scale,
            )
        return (
            (fc + tc) * self.time_scale,
            (fc * (rb + rw) + tc) * self.time_scale,
            np.zeros_like(fc),
        )

    def per_layer_s(self, layout: Layout, p: dict[int, float]) -> np.ndarray:
        """Forward+backward seconds per layer per micro-batch on every (replica, stage)."""
        comp, comm, _ = self._parts(layout, p)
        return (comp * (1 + self.cost.ratio_b + self.cost.ratio_w) + 2 * comm) * self.time_scale

    def head_s(self, layout: Layout, p: dict[int, float]) -> np.ndarray:
        """Extra forward+backward seconds of the LM head (last stage only)."""
        _, _, head = self._parts(layout, p)
        return head * (1 + self.cost.ratio_b + self.cost.ratio_w) * self.time_scale

    # ------------------------------------------------------------ engine
    def dag(self, layout: Layout, schedule: str | None = None) -> PipelineDAG:
        """The layout's DAG; ``schedule`` overrides its kind (an engine-only kind, e.g. 1f1bsplit)."""
        kind = schedule or layout.schedule
        key = (
            kind,
            tuple(tuple(bool(g) for g in st) for st in layout.groups),
            tuple(layout.microbatches),
            tuple(tuple(m.to_list()) for m in layout.migrations),
        )
        dag = self._dags.get(key)
        if dag is None:
            dag = PipelineDAG.from_layout(layout, kind)
            self._dags[key] = dag
            if len(self._dags) > 64:
                self._dags.popitem(last=False)
        else:
            self._dags.move_to_end(key)
        return dag

    def _timed(self, layout: Layout, p: dict[int, float], schedule: str | None = None):
        """(DAG, chunk costs, edge costs) with migrated chunks placed by projected arrival.

        The engine's re-timing pre-pass (``PipelineDAG.retimed``) needs the
        costs; its result is cached on the structure and the cost vector.
        """
        dag = self.dag(layout, schedule)
        cost = self.cost.chunk_costs(dag, layout, self.seq_len, self._sq, p)
        edges = self.cost.edge_costs(dag, layout)
        if not dag.has_migrations:
            return dag, cost, edges
        key = (id(dag), hash(cost.tobytes()), hash(edges.tobytes()))
        hit = self._retimed.get(key)
        if hit is not None and hit[0] is dag:
            self._retimed.move_to_end(key)
            return hit[1], hit[2], hit[3]
        rd = dag.retimed(cost, edges)
        rc = self.cost.chunk_costs(rd, layout, self.seq_len, self._sq, p)
        re_ = self.cost.edge_costs(rd, layout)
        self._retimed[key] = (dag, rd, rc, re_)
        if len(self._retimed) > 64:
            self._retimed.popitem(last=False)
        return rd, rc, re_

    def iteration_s(
        self,
        layout: Layout,
        p: dict[int, float],
        allreduce_replicas: int | None = None,
        schedule: str | None = None,
    ) -> float:
        """Predicted iteration time; inf when a TP group holds a dead device.

        ``allreduce_replicas``: charge the DP all-reduce as if each stage had this many
        replicas (a single pipeline that is one of several, e.g. Oobleck's).
        ``schedule``: evaluate under this engine kind instead of the layout's.
        """
        if layout.runs_dead(p):
            return float("inf")
        dag, cost, edges = self._timed(layout, p, schedule)
        if allreduce_replicas and allreduce_replicas > layout.dp:
            wide = copy.copy(layout)
            wide.groups = [layout.groups[0]] * allreduce_replicas
            ar = self.cost.allreduce_costs(wide)
        else:
            ar = self.cost.allreduce_costs(layout)
        return dag.evaluate(cost, edges, ar).iteration_time_s * self.time_scale

    def layer_evaluator(self, layout: Layout, p: dict[int, float], schedule: str | None = None):
        """A function mapping layer partitions ``[V, pp]`` to iteration times (one batched DAG run).

        ``schedule``: evaluate under this engine kind instead of the layout's.

        Chunk costs, the DP all-reduce and the LM head are affine in a stage's
        layer count, so two cost evaluations give the per-layer and fixed parts
        and every candidate is a linear combination of them.
        """
        if layout.runs_dead(p):
            return lambda Lm: np.full(len(Lm), np.inf)
        dag, _, edges = self._timed(layout, p, schedule)
        one, two = copy.copy(layout), copy.copy(layout)
        one.layers = [1] * layout.pp
        two.layers = [2] * layout.pp
        c1 = self.cost.chunk_costs(dag, one, self.seq_len, self._sq, p)
        c2 = self.cost.chunk_costs(dag, two, self.seq_len, self._sq, p)
        a1, a2 = self.cost.allreduce_costs(one), self.cost.allreduce_costs(two)
        per, const = c2 - c1, 2 * c1 - c2
        ar_per, ar_const = a2 - a1, 2 * a1 - a2

        def run(layer_vectors) -> np.ndarray:
            Lm = np.asarray(layer_vectors, dtype=float)
            return (
                dag.evaluate_batch_affine(const, per, Lm, edges, ar_const, ar_per) * self.time_scale
            )

        return run

    def iteration_s_layers(self, layout: Layout, p: dict[int, float], layer_vectors) -> np.ndarray:
        """Iteration times of ``layout`` under many layer partitions at once."""
        return self.layer_evaluator(layout, p)(layer_vectors)

    def samples_per_s(self, layout: Layout, p: dict[int, float], samples_per_mb: int = 1) -> float:
        t = self.iteration_s(layout, p)
        return layout.total_microbatches * samples_per_mb / t if np.isfinite(t) and t > 0 else 0.0

"""Topology of a hybrid-parallel job: ranks, nodes, (dp, stage, tp) coordinates.

A :class:`Layout` is the one checked object that says which devices run what.
It describes what adaptation produces and a uniform launch does not:
heterogeneous TP degrees across stages and replicas (``groups[dp][stage]`` is
the TP group's rank list), uneven layer counts per stage, node-local standby
devices, dead devices, per-replica micro-batch counts and stage-level
micro-batch migrations between DP replicas.  Every service reads and writes it
through ``to_dict``/``from_dict``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class LayoutError(ValueError):
    """A layout that cannot run; the message says what is wrong."""


def is_power_of_two(k: int) -> bool:
    return k > 0 and (k & (k - 1)) == 0


@dataclass(frozen=True)
class Migration:
    """Stage ``stage`` of micro-batch ``microbatch`` owned by ``src_dp`` runs on ``dst_dp``."""

    stage: int
    src_dp: int
    microbatch: int
    dst_dp: int

    def to_list(self) -> list[int]:
        return [self.stage, self.src_dp, self.microbatch, self.dst_dp]


#: Pipeline schedules a layout may name: ``resihp.pipeline.schedule.SCHEDULE_KINDS`` (kept
#: here so the core need not import the pipeline engine; a test holds the two equal).
#: Which of them a trainer runs is the trainer's check, not the layout's.
SCHEDULES = ("gpipe", "1f1b", "zbh1", "interleaved")

#: The largest job a layout may describe (64x the 16,384-GPU jobs the stack is sized for).
MAX_WORLD_SIZE = 1 << 20


@dataclass
class Layout:
    """Where every layer and micro-batch of the job runs.

    groups[dp][stage] -> TP group ranks (its length is that stage's TP degree
    in that replica). layers[stage] -> layers on that stage (all replicas hold
    the same model partition). microbatches[dp] -> micro-batches that replica
    owns per iteration.
    """

    world_size: int
    devices_per_node: int
    num_layers: int
    groups: list[list[list[int]]]
    layers: list[int]
    microbatches: list[int]
    standby: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)
    layout_id: int = 0
    schedule: str = "1f1b"

    # ---------------------------------------------------------------- build
    @classmethod
    def uniform(
        cls,
        tp: int,
        pp: int,
        dp: int,
        num_layers: int,
        num_microbatches: int,
        devices_per_node: int = 8,
        schedule: str = "1f1b",
    ) -> Layout:
        """Megatron ordering tp-dp-pp: rank = t + tp*(d + dp*s)."""
        if min(tp, pp, dp) < 1:
            raise LayoutError(f"parallel degrees must be >= 1, got tp={tp} pp={pp} dp={dp}")
        if num_layers < pp:
            raise LayoutError(f"{num_layers} layers cannot fill {pp} pipeline stages")
        base, extra = divmod(num_layers, pp)
        layers = [base + (1 if s < extra else 0) for s in range(pp)]
        groups = [
            [[t + tp * (d + dp * s) for t in range(tp)] for s in range(pp)] for d in range(dp)
        ]
        lay = cls(
            world_size=tp * pp * dp,
            devices_per_node=devices_per_node,
            num_layers=num_layers,
            groups=groups,
            layers=layers,
            microbatches=[num_microbatches] * dp,
            schedule=schedule,
        )
        lay.validate()
        return lay

    # ---------------------------------------------------------------- shape
    @property
    def pp(self) -> int:
        return len(self.layers)

    @property
    def dp(self) -> int:
        return len(self.groups)

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.devices_per_node)

    @property
    def total_microbatches(self) -> int:
        return sum(self.microbatches)

    def tp_degree(self, dp: int, stage: int) -> int:
        return len(self.groups[dp][stage])

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def node_ranks(self, node: int) -> list[int]:
        lo = node * self.devices_per_node
        return list(range(lo, min(lo + self.devices_per_node, self.world_size)))

    def coords(self) -> dict[int, tuple[int, int, int]]:
        """rank -> (dp, stage, tp_index) for every rank that runs work."""
        out = {}
        for d, stages in enumerate(self.groups):
            for s, grp in enumerate(stages):
                for t, r in enumerate(grp):
                    out[r] = (d, s, t)
        return out

    def runs_dead(self, p: Mapping[int, float]) -> bool:
        """Whether a rank with speed ``p[rank] <= 0`` is in one of the TP groups.

        Only the ranks ``p`` lists are looked up (no rank -> coordinate map is built: the
        planner asks this of every candidate, and at 16,384 GPUs building ``coords`` was a
        visible part of planning).
        """
        dead = {r for r, v in p.items() if v <= 0}
        if not dead:
            return False
        return any(not dead.isdisjoint(g) for stages in self.groups for g in stages)

    def active_ranks(self) -> list[int]:
        return sorted(self.coords())

    def idle_host_migrations(self) -> list[Migration]:
        """Migrations into a replica that owns no micro-batches.

        Valid for the pipeline engine and the simulator, but the torch trainer cannot run
        them (such a replica runs no schedule to slot the chunks into), so the planner
        never proposes them.
        """
        return [m for m in self.migrations if self.microbatches[m.dst_dp] <= 0]

    def exchange_migrations(self) -> list[Migration]:
        """Migrations that move no work: two replicas sending each other chunks of one
        stage, or a micro-batch whose every stage runs on one other replica (that replica
        might as well own it).

        Such a layout does the same work as one without them; under split backward
        (``resihp.pipeline.schedule.ENGINE_KINDS``) they would only relabel local chunks
        as migrated ones to defer their W, so the planner does not propose them there.
        """
        pairs = {(m.stage, m.src_dp, m.dst_dp) for m in self.migrations}
        dsts: dict[tuple[int, int], set[int]] = {}
        stages: dict[tuple[int, int], int] = {}
        for m in self.migrations:
            k = (m.src_dp, m.microbatch)
            dsts.setdefault(k, set()).add(m.dst_dp)
            stages[k] = stages.get(k, 0) + 1
        whole = {k for k, n in stages.items() if n == self.pp and len(dsts[k]) == 1}
        return [
            m
            for m in self.migrations
            if (m.stage, m.dst_dp, m.src_dp) in pairs or (m.src_dp, m.microbatch) in whole
        ]

    def pp_group(self, dp: int) -> list[list[int]]:
        return self.groups[dp]

    def dp_group(self, stage: int) -> list[list[int]]:
        """The TP groups of ``stage`` across replicas (gradient all-reduce peers)."""
        return [self.groups[d][stage] for d in range(self.dp)]

    def idle_ranks(self) -> list[int]:
        used = set(self.coords()) | set(self.dead) | set(self.standby)
        return [r for r in range(self.world_size) if r not in used]

    # ---------------------------------------------------------------- check
    def validate(self, groups: bool = True) -> None:
        """Raise LayoutError unless the layout is well formed.

        ``groups=False`` skips the per-rank checks of the TP groups and the standby list
        (the planner's candidates share the groups of one layout it validated already:
        at 16,384 GPUs those checks were most of each candidate's validation).
        """
        if self.world_size <= 0 or self.devices_per_node <= 0:
            raise LayoutError("world_size and devices_per_node must be > 0")
        if self.world_size > MAX_WORLD_SIZE:
            # services size per-rank arrays by it: a typo must not allocate for 10^9 GPUs
            raise LayoutError(
                f"world_size {self.world_size} is beyond the {MAX_WORLD_SIZE} ranks ResiHP handles"
            )
        if self.schedule not in SCHEDULES:
            # a typo ('ZBH1', '1f1b' with a fullwidth digit) would be planned and predicted
            # as 1F1B while the ranks run something else
            raise LayoutError(f"unknown schedule {self.schedule!r}: one of {', '.join(SCHEDULES)}")
        if not self.groups or not self.layers:
            raise LayoutError("layout has no replicas or no stages")
        if any(len(stages) != self.pp for stages in self.groups):
            raise LayoutError("every DP replica must have the same number of stages")
        if sum(self.layers) != self.num_layers:
            raise LayoutError(
                f"layers per stage {self.layers} sum to {sum(self.layers)}, model has "
                f"{self.num_layers}"
            )
        if any(n < 1 for n in self.layers):
            raise LayoutError(f"every stage needs at least one layer: {self.layers}")
        if len(self.microbatches) != self.dp or any(m < 0 for m in self.microbatches):
            raise LayoutError(
                f"microbatches {self.microbatches} must list one count >= 0 per replica"
            )
        if groups:
            self._validate_groups()
        self._validate_migrations()

    def _validate_groups(self) -> None:
        seen: dict[int, tuple[int, int]] = {}
        dead = set(self.dead)
        for d, stages in enumerate(self.groups):
            for s, grp in enumerate(stages):
                if not grp:
                    continue  # a stage of a replica whose devices are all gone: work migrates away
                if not is_power_of_two(len(grp)):
                    raise LayoutError(
                        f"TP group dp={d} stage={s} has degree {len(grp)}, not a power of two"
                    )
                nodes = {self.node_of(r) for r in grp}
                if len(nodes) > 1:
                    raise LayoutError(f"TP group dp={d} stage={s} spans nodes {sorted(nodes)}")
                for r in grp:
                    if not 0 <= r < self.world_size:
                        raise LayoutError(f"rank {r} outside world of {self.world_size}")
                    if r in dead:
                        raise LayoutError(f"dead rank {r} is assigned work (dp={d} stage={s})")
                    if r in seen:
                        raise LayoutError(f"rank {r} is in two TP groups: {seen[r]} and {(d, s)}")
                    seen[r] = (d, s)
        for r in self.standby:
            if r in seen or r in dead:
                raise LayoutError(f"standby rank {r} is also active or dead")

    def _validate_migrations(self) -> None:
        for m in self.migrations:
            if not (0 <= m.stage < self.pp and 0 <= m.src_dp < self.dp and 0 <= m.dst_dp < self.dp):
                raise LayoutError(f"migration {m.to_list()} out of range")
            if m.microbatch >= self.microbatches[m.src_dp]:
                raise LayoutError(
                    f"migration {m.to_list()}: replica {m.src_dp} has no such micro-batch"
                )
            if not self.groups[m.dst_dp][m.stage]:
                raise LayoutError(f"migration {m.to_list()}: destination stage has no devices")
        # A (replica, stage) without devices must have every micro-batch migrated away.
        moved = {(m.src_dp, m.stage, m.microbatch) for m in self.migrations}
        for d, stages in enumerate(self.groups):
            for s, grp in enumerate(stages):
                if not grp:
                    for j in range(self.microbatches[d]):
                        if (d, s, j) not in moved:
                            raise LayoutError(
                                f"replica {d} stage {s} has no devices but micro-batch {j} is not migrated"
                            )

    # ---------------------------------------------------------------- wire
    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "devices_per_node": self.devices_per_node,
            "num_layers": self.num_layers,
            "groups": self.groups,
            "layers": self.layers,
            "microbatches": self.microbatches,
            "standby": sorted(self.standby),
            "dead": sorted(self.dead),
            "migrations": [m.to_list() for m in self.migrations],
            "layout_id": self.layout_id,
            "schedule": self.schedule,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        try:
            lay = cls(
                world_size=int(d["world_size"]),
                devices_per_node=int(d["devices_per_node"]),
                num_layers=int(d["num_layers"]),
                groups=[[[int(r) for r in g] for g in st] for st in d["groups"]],
                layers=[int(x) for x in d["layers"]],
                microbatches=[int(x) for x in d["microbatches"]],
                standby=[int(x) for x in d.get("standby", [])],
                dead=[int(x) for x in d.get("dead", [])],
                migrations=[Migration(*map(int, m)) for m in d.get("migrations", [])],
                layout_id=int(d.get("layout_id", 0)),
                schedule=str(d.get("schedule", "1f1b")),
            )
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
            raise LayoutError(f"malformed layout: {e!r}") from e
        lay.validate()
        return lay

    @classmethod
    def from_json(cls, raw: str | bytes) -> Layout:
        """A layout as stored in ``keys.layout``; LayoutError for anything unreadable
        (bad JSON or UTF-8, nesting too deep, numbers too big), never another error."""
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise LayoutError(f"layout is not JSON: {e}") from e
        if not isinstance(d, dict):
            raise LayoutError(f"layout is not a JSON object but {type(d).__name__}")
        return cls.from_dict(d)

    def out_of_service(self) -> list[int]:
        """Ranks alive but neither in a group nor on standby: an operator's override dropped
        them; they stay out (no work, no reuse as a spare) until an override keeps them."""
        busy = set(self.coords()) | set(self.standby) | set(self.dead)
        return [r for r in range(self.world_size) if r not in busy]

    def copy(self) -> Layout:
        return Layout.from_dict(self.to_dict())

    def summary(self) -> str:
        tps = sorted({len(g) for st in self.groups for g in st})
        return (
            f"DP{self.dp}xPP{self.pp} TP{'/'.join(map(str, tps))} layers={self.layers} "
            f"mb={self.microbatches} dead={len(self.dead)} standby={len(self.standby)}"
            + (f" out_of_service={len(out)}" if (out := self.out_of_service()) else "")
        )

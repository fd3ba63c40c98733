"""Two-level heartbeat liveness (paper §5.1), as pure logic on arrival times.

In the shared core so the live collector and the detector's offline replay judge
liveness with the same code.

Level 1, :class:`NodeMonitor`: one per node, fed the heartbeats of that
node's devices; it keeps the active device set and decides that a device has
fail-stopped when K consecutive beats are missing while the node itself is
still heard from.  Level 2, :class:`LivenessCoordinator`: tracks only the
node monitors (when each last heard any device) and aggregates their
decisions; a node whose monitor hears no device at all for K intervals is
reported down as a whole (one ``scope="node"`` event, not one per device).

Time is always the *arrival* time of a beat on the collector's side.  The
rank's own ``wall_time_s`` is never compared with the collector's clock, so
clock skew between nodes cannot make a live rank look dead or a dead one
alive.

Thresholds: with interval I and K missed beats, a device is dead once nothing
arrived for ``(K + jitter_beats) * I`` (the half beat of slack absorbs
scheduling jitter so a beat that is a little late is not a miss).  With the
defaults (I = 1 s, K = 2) and a check every I/4 the decision comes within
2.75 I of the failure, inside the 3-interval budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from resihp.schemas import LivenessEvent


@dataclass
class RankState:
    rank: int
    node: int
    last_arrival_s: float
    alive: bool = True
    seq: int = -1
    iteration: int = -1
    generation: int = 0
    rejoined: bool = False  # heard again after being dead; reported at the next check


@dataclass
class RankDecision:
    rank: int
    state: str  # "dead" | "rejoined"
    last_seen_s: float
    missed_beats: int


@dataclass
class NodeMonitor:
    """Node-local monitor: the active device set of one node."""

    node: int
    interval_s: float
    k: int
    jitter_beats: float = 0.5
    ranks: dict[int, RankState] = field(default_factory=dict)
    last_heard_s: float = -math.inf

    def track(self, rank: int, now_s: float, dead: bool = False) -> None:
        if rank in self.ranks:
            return
        self.ranks[rank] = RankState(rank, self.node, -math.inf if dead else now_s, alive=not dead)
        if not dead:
            # Expecting a device is a promise it will beat: start the node's clock too.
            self.last_heard_s = max(self.last_heard_s, now_s)

    def untrack(self, rank: int) -> None:
        self.ranks.pop(rank, None)

    def observe(
        self, rank: int, arrival_s: float, seq: int = -1, iteration: int = -1, generation: int = 0
    ) -> None:
        st = self.ranks.get(rank)
        if st is None:
            st = self.ranks[rank] = RankState(rank, self.node, -math.inf)
        # only a beat newer than any heard from it brings a dead device back: an old entry
        # read again (reclaimed after a consumer restart) says nothing about now
        newer = arrival_s > st.last_arrival_s
        # Invariant: last_heard_s >= every device's last_arrival_s.
        if newer:
            st.last_arrival_s = arrival_s
            if arrival_s > self.last_heard_s:
                self.last_heard_s = arrival_s
        if seq > st.seq:
            st.seq = seq
        if iteration > st.iteration:
            st.iteration = iteration
        if generation > st.generation:
            st.generation = generation
        if not st.alive and newer:
            st.alive = True
            st.rejoined = True

    def missed(self, last_s: float, now_s: float) -> int:
        if last_s == -math.inf:
            return self.k
        return max(0, int((now_s - last_s) / self.interval_s))

    def deadline_s(self) -> float:
        return (self.k + self.jitter_beats) * self.interval_s

    def silent(self, now_s: float) -> bool:
        """No device of this node heard for K intervals: the node is down."""
        return now_s - self.last_heard_s >= self.deadline_s()

    def check(self, now_s: float) -> list[RankDecision]:
        """Devices dead while their node is alive, and devices heard again."""
        out: list[RankDecision] = []
        limit = self.deadline_s()
        for st in self.ranks.values():
            if st.rejoined:
                st.rejoined = False
                out.append(RankDecision(st.rank, "rejoined", st.last_arrival_s, 0))
            elif st.alive and now_s - st.last_arrival_s >= limit:
                # Only a device silent while its node kept talking for more than
                # a beat after it is this device's failure; otherwise the whole
                # node is going quiet and the coordinator reports it once.
                if self.last_heard_s - st.last_arrival_s > 1.25 * self.interval_s:
                    st.alive = False
                    out.append(
                        RankDecision(
                            st.rank,
                            "dead",
                            st.last_arrival_s,
                            self.missed(st.last_arrival_s, now_s),
                        )
                    )
        return out

    def mark_all_dead(self) -> list[int]:
        newly = []
        for st in self.ranks.values():
            if st.alive:
                st.alive = False
                newly.append(st.rank)
            st.rejoined = False
        return newly

    def take_rejoined(self) -> list[RankState]:
        out = [st for st in self.ranks.values() if st.rejoined]
        for st in out:
            st.rejoined = False
        return out


class LivenessCoordinator:
    """Central coordinator: tracks node monitors only and emits LivenessEvents."""

    def __init__(self, interval_s: float = 1.0, k: int = 2, jitter_beats: float = 0.5):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.interval_s = float(interval_s)
        self.k = int(k)
        self.jitter_beats = float(jitter_beats)
        self.monitors: dict[int, NodeMonitor] = {}
        self.node_down: set[int] = set()
        self._rank_node: dict[int, int] = {}
        #: the ranks the current layout lists as dead
        self._layout_dead: set[int] = set()
        #: rank -> node for ranks heard but not expected (set from the layout)
        self.node_of: Callable[[int], int] | None = None

    # ------------------------------------------------------------ configuration
    def set_k(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = int(k)
        for m in self.monitors.values():
            m.k = self.k

    def _monitor(self, node: int) -> NodeMonitor:
        m = self.monitors.get(node)
        if m is None:
            m = self.monitors[node] = NodeMonitor(node, self.interval_s, self.k, self.jitter_beats)
        return m

    def set_expected(self, rank_node: dict[int, int], dead: set[int], now_s: float) -> None:
        """Ranks the layout expects to beat (rank -> node) and ranks it says are dead.

        New expected ranks get a full deadline from ``now_s``; ranks that left the
        layout are forgotten; ranks the layout marks dead are tracked as dead so
        that a beat from them is reported as a re-join.
        """
        wanted = dict(rank_node)
        for r in dead:
            wanted.setdefault(r, rank_node.get(r, self._rank_node.get(r, -1)))
        for r in list(self._rank_node):
            if r not in wanted:
                self._monitor(self._rank_node.pop(r)).untrack(r)
        for r, node in wanted.items():
            if node < 0:
                continue
            old = self._rank_node.get(r)
            if old is not None and old != node:
                self._monitor(old).untrack(r)
            self._rank_node[r] = node
            mon = self._monitor(node)
            mon.track(r, now_s, dead=r in dead)
            if r in dead and r not in self._layout_dead:
                # newly dead in the layout: a beat from it from now on is a re-join; one
                # already dead in the previous layout keeps what was heard since (each
                # layout rewrite must not report the same re-join again)
                mon.ranks[r].alive = False
                mon.ranks[r].rejoined = False
        self._layout_dead = set(dead)
        for node in [n for n, m in self.monitors.items() if not m.ranks]:
            del self.monitors[node]
            self.node_down.discard(node)

    def resume(self, now_s: float) -> None:
        """After an outage of the bus: nobody could be heard, so nobody is judged on it."""
        for m in self.monitors.values():
            if m.node in self.node_down:
                continue
            m.last_heard_s = max(m.last_heard_s, now_s)
            for st in m.ranks.values():
                if st.alive:
                    st.last_arrival_s = max(st.last_arrival_s, now_s)

    # ------------------------------------------------------------ level 1 input
    def observe(
        self,
        rank: int,
        node: int,
        arrival_s: float,
        seq: int = -1,
        iteration: int = -1,
        generation: int = 0,
    ) -> None:
        known = self._rank_node.get(rank)
        if known is not None:
            node = known
        else:
            if self.node_of is not None:  # the layout knows better than the beat
                node = self.node_of(rank)
            self._rank_node[rank] = node
        self._monitor(node).observe(rank, arrival_s, seq, iteration, generation)

    # ------------------------------------------------------------ level 2 decisions
    def check(self, now_s: float) -> list[LivenessEvent]:
        events: list[LivenessEvent] = []
        for node, mon in sorted(self.monitors.items()):
            if node in self.node_down:
                back = mon.take_rejoined()
                if back:
                    self.node_down.discard(node)
                    events.append(
                        LivenessEvent(
                            scope="node",
                            node=node,
                            ranks=sorted(st.rank for st in back),
                            state="rejoined",
                            detected_at_s=now_s,
                            last_seen_s=mon.last_heard_s,
                            missed_beats=0,
                        )
                    )
                continue
            if mon.silent(now_s) and any(st.alive for st in mon.ranks.values()):
                mon.mark_all_dead()
                self.node_down.add(node)
                events.append(
                    LivenessEvent(
                        scope="node",
                        node=node,
                        ranks=sorted(mon.ranks),
                        state="dead",
                        detected_at_s=now_s,
                        last_seen_s=mon.last_heard_s,
                        missed_beats=mon.missed(mon.last_heard_s, now_s),
                    )
                )
                continue
            for d in mon.check(now_s):
                events.append(
                    LivenessEvent(
                        scope="rank",
                        node=node,
                        ranks=[d.rank],
                        state=d.state,
                        detected_at_s=now_s,
                        last_seen_s=d.last_seen_s,
                        missed_beats=d.missed_beats,
                    )
                )
        return events

    # ------------------------------------------------------------ views
    def node_last_heard(self) -> dict[int, float]:
        return {n: m.last_heard_s for n, m in self.monitors.items() if m.last_heard_s > -math.inf}

    def dead_ranks(self) -> list[int]:
        return sorted(
            r for m in self.monitors.values() for r, st in m.ranks.items() if not st.alive
        )

    def alive_ranks(self) -> list[int]:
        return sorted(r for m in self.monitors.values() for r, st in m.ranks.items() if st.alive)

    def rank_state(self, rank: int) -> RankState | None:
        node = self._rank_node.get(rank)
        if node is None:
            return None
        return self.monitors[node].ranks.get(rank)

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

Job-wide silence: the same rule one level up.  A device is dead on its own only
if its node kept talking for more than 1.25 I after it; a node is dead on its
own only if some other node still alive kept talking for more than 1.25 I after
it.  When a node reaches its deadline and no node still alive was heard more
than 1.25 I after it, every node of the job went quiet together: a stall of the
telemetry source (the trainer process, its host, the path to Redis), not N
independent node failures.  The coordinator then holds the node verdicts for
``hold_deadlines`` more deadlines (default :data:`JOB_SILENCE_HOLD_DEADLINES`)
and says the job is silent (:attr:`LivenessCoordinator.job_silent_since_s`).  A
job heard again within the hold produces no verdict at all; a silence that
outlasts it makes each node dead as before, ``(1 + hold_deadlines)`` deadlines
after its last beat (7.5 I with the defaults).  Nobody is judged on a silence
that ended within the hold (as after an outage of the bus): every deadline then
runs from when the job was heard again, so a device beating again at its own
phase a moment after its peers is not dead, and a node still silent then is
dead one deadline later.  Partial
failures (a device, a node, any subset of nodes while one node still alive
talks) keep the 2.5 I latency exactly: the other nodes beat every I, so by then
one was heard at least 1.5 I after the failure.  A job whose nodes all died
already but one (or a one-node job) is that node: its death is a job-wide
silence.

Mass loss: many nodes dying within one deadline while the rest of the job still
talks is far more often the observer's problem (a telemetry path that delayed some
nodes' beats, a collector that fell behind) than that many independent failures.
When at least ``mass_loss_min_nodes`` nodes and ``mass_loss_fraction`` of the nodes
alive reach their deadline within one deadline of each other, those verdicts are
*suspect*: held for ``hold_deadlines`` more deadlines (the same hold as a job-wide
silence), during which the collector must stay caught up on the stream (it judges
at its read frontier while behind) and the rest of the job keeps being heard.  A
node heard again within the hold produces no verdict; one still silent after it is
dead, ``(1 + hold_deadlines)`` deadlines after its last beat (the cross-check costs a
real mass failure 5 s more with the defaults; a single node, or a few, keep 2.5 I).

Late or silent: a host so loaded that its beats come late and a host that stopped
look the same until the late beat arrives; only time tells them apart.  The deadline
therefore follows the jitter the job shows: the longest gap between two beats of a node
that was heard again before its verdict, over the last ~``GAP_WINDOW_S`` (the larger of
two 30 s buckets), times ``DEADLINE_STRETCH_FACTOR``, is the deadline when that is more
than ``(K + jitter_beats) * I``, up to ``DEADLINE_STRETCH_MAX`` times it.  A stopped host
never completes its gap, so it cannot stretch its own deadline; beats that arrive
on time keep the static one.  Co-located processes share one CPU, so the stretch is
job-wide (any node's late beat warns of the others').  The cost: a host that stops
while the job shows jitter is reported that much later (figures: docs/operations.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from resihp.schemas import LivenessEvent

#: Extra fail-stop deadlines a job-wide silence holds the node verdicts for (see the
#: module doc): with K=2 and I = 1 s a whole job that stops is reported dead 7.5 s after
#: its last beat instead of 2.5 s, and a stall of its telemetry shorter than that (the
#: soak saw 3-4.3 s) is reported as nothing.  0 turns the hold off.
JOB_SILENCE_HOLD_DEADLINES = 2.0
#: How much later than a node another one must have been heard for the first node's
#: silence to be its own (in intervals): the level-1 rule's margin, one level up.
QUIET_TOGETHER_BEATS = 1.25
#: Fail-stop deadlines a rank (or node) gets while it is starting: not heard once since it
#: was expected, or heard but its beats still in the job's iteration 0.  Ranks of
#: one job start at different moments (each imports its framework; under load a node
#: process of bench/failstop_latency.py first beat 1.5-2.4 s after its deadline started,
#: at the job's first telemetry, load 19-33), and the layout's promise is not a beat:
#: those starts were all 8 false reports of 22 diagnostic trials of that bench.  The first
#: iteration is the other heavy moment (model build, first collectives): in CI beside a
#: second test worker the torch trainer's ranks 1 and 6 (0.5 s beats, 1.25 s deadline)
#: were declared dead in iteration 0 and rejoined a moment later.  A rank beating a later
#: iteration (or none) is judged on the deadline alone.  The cost: a host silent in the
#: job's first iteration is reported 4 deadlines after its last beat (a killed rank
#: process is seen at once by its agent connection, resihp/liveness_agent.py).
FIRST_BEAT_DEADLINES = 4.0
#: Adaptive deadline: the fail-stop deadline stretches to ``DEADLINE_STRETCH_FACTOR`` x the
#: longest gap between two beats of a live node seen over the last ~``GAP_WINDOW_S``
#: (only gaps shorter than the deadline then in force: a node heard again before its
#: verdict), up to ``DEADLINE_STRETCH_MAX`` x the static deadline.  See the module doc.
DEADLINE_STRETCH_FACTOR = 1.5
DEADLINE_STRETCH_MAX = 2.0
GAP_WINDOW_S = 60.0
#: Fraction of the nodes alive whose deaths within one deadline are a suspect mass loss.
MASS_LOSS_FRACTION = 0.1
#: ... and at least this many nodes (a 4-node job losing 1 node is not a mass loss).
MASS_LOSS_MIN_NODES = 4


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
    heard: bool = False  # any beat of it arrived (else it is still starting: first-beat grace)

    @property
    def starting(self) -> bool:
        """Not heard yet, or its beats still in the job's first iteration (iteration 0:
        model build, communicators, first collectives): FIRST_BEAT_DEADLINES."""
        return not self.heard or self.iteration == 0


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
    first_beat_deadlines: float = FIRST_BEAT_DEADLINES
    #: the deadline in force when the job's jitter stretched it (set by the coordinator)
    stretched_s: float = 0.0
    heard: bool = False  # any beat of any of its devices arrived
    ranks: dict[int, RankState] = field(default_factory=dict)
    last_heard_s: float = -math.inf
    #: Deadlines run from here at the earliest: when the job was heard again after a
    #: job-wide silence, which nobody is judged on (their real last beats stay as heard).
    judge_from_s: float = -math.inf

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
        st.heard = self.heard = True
        # Invariant: last_heard_s >= every device's last_arrival_s.
        if newer:
            st.last_arrival_s = arrival_s
            if arrival_s > self.last_heard_s:
                self.last_heard_s = arrival_s
        if seq > st.seq:
            st.seq = seq
        if not st.alive and newer:
            st.alive = True
            st.rejoined = True
        if iteration > st.iteration:
            st.iteration = iteration
        if generation > st.generation:
            st.generation = generation

    def missed(self, last_s: float, now_s: float) -> int:
        if last_s == -math.inf:
            return self.k
        return max(0, int((now_s - last_s) / self.interval_s))

    def deadline_s(self) -> float:
        d = (self.k + self.jitter_beats) * self.interval_s
        return d if self.stretched_s <= d else self.stretched_s

    def rank_deadline_s(self, st: RankState) -> float:
        """The deadline of one device: longer while it is starting (FIRST_BEAT_DEADLINES)."""
        d = self.deadline_s()
        return d * max(1.0, self.first_beat_deadlines) if st.starting else d

    def node_deadline_s(self) -> float:
        """The node's deadline: longer while every device of it alive is starting."""
        d = self.deadline_s()
        # checked for every node at every look: stop at the first alive device past its
        # start (in steady state the first one), not a list of the node's devices
        alive = (st for st in self.ranks.values() if st.alive)
        first = next(alive, None)
        if self.heard and (
            first is None or not (first.starting and all(a.starting for a in alive))
        ):
            return d
        return d * max(1.0, self.first_beat_deadlines)

    def quiet_since_s(self) -> float:
        """Since when the node counts as quiet: its last beat, or a later fresh start."""
        return max(self.last_heard_s, self.judge_from_s)

    def silent(self, now_s: float) -> bool:
        """No device of this node heard for K intervals: the node is down."""
        return now_s - self.quiet_since_s() >= self.node_deadline_s()

    def check(self, now_s: float) -> list[RankDecision]:
        """Devices dead while their node is alive, and devices heard again."""
        out: list[RankDecision] = []
        for st in self.ranks.values():
            if st.rejoined:
                st.rejoined = False
                out.append(RankDecision(st.rank, "rejoined", st.last_arrival_s, 0))
            elif st.alive and now_s - max(
                st.last_arrival_s, self.judge_from_s
            ) >= self.rank_deadline_s(st):
                # Only a device silent while its node kept talking for more than
                # a beat after it is this device's failure; otherwise the whole
                # node is going quiet and the coordinator reports it once.
                if self.last_heard_s - st.last_arrival_s > QUIET_TOGETHER_BEATS * self.interval_s:
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

    def __init__(
        self,
        interval_s: float = 1.0,
        k: int = 2,
        jitter_beats: float = 0.5,
        hold_deadlines: float = JOB_SILENCE_HOLD_DEADLINES,
        mass_loss_fraction: float = MASS_LOSS_FRACTION,
        mass_loss_min_nodes: int = MASS_LOSS_MIN_NODES,
        first_beat_deadlines: float = FIRST_BEAT_DEADLINES,
        stretch_max: float = DEADLINE_STRETCH_MAX,
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not 0 <= hold_deadlines < math.inf:
            raise ValueError(f"hold_deadlines must be finite and >= 0, got {hold_deadlines}")
        self.interval_s = float(interval_s)
        self.k = int(k)
        self.jitter_beats = float(jitter_beats)
        if not 1 <= first_beat_deadlines < math.inf:
            raise ValueError(f"first_beat_deadlines must be >= 1, got {first_beat_deadlines}")
        self.first_beat_deadlines = float(first_beat_deadlines)
        if not 1 <= stretch_max < math.inf:
            raise ValueError(f"stretch_max must be >= 1, got {stretch_max}")
        self.stretch_max = float(stretch_max)
        #: longest beat gap of a live node in the current / previous GAP_WINDOW_S/2 bucket
        self._gap_bucket = -1
        self._gap_peak_s = 0.0
        self._gap_prev_peak_s = 0.0
        #: the deadline in force (the static one, or stretched by the job's jitter)
        self.deadline_in_force_s = self.static_deadline_s()
        self.hold_deadlines = float(hold_deadlines)
        if not 0 < mass_loss_fraction <= 1:
            raise ValueError(f"mass_loss_fraction must be in (0, 1], got {mass_loss_fraction}")
        if mass_loss_min_nodes < 2:
            raise ValueError(f"mass_loss_min_nodes must be >= 2, got {mass_loss_min_nodes}")
        self.mass_loss_fraction = float(mass_loss_fraction)
        self.mass_loss_min_nodes = int(mass_loss_min_nodes)
        #: nodes whose death verdict is held as part of a suspect mass loss (see module doc)
        self.suspect_nodes: set[int] = set()
        #: (when declared, node) of the node deaths of the last deadline
        self._recent_dead: list[tuple[float, int]] = []
        #: suspect mass losses held so far (each new one counted once)
        self.mass_loss_holds_total = 0
        #: While node verdicts are held because the whole job went quiet together: when
        #: any of its nodes still alive was last heard.  None otherwise.
        self.job_silent_since_s: float | None = None
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

    def set_interval(self, interval_s: float) -> None:
        """The trainer's heartbeat period changed (it announced another): every deadline
        follows it; the caller gives every rank a fresh one (:meth:`resume`), as beats
        judged on the old period say nothing about the new one."""
        if not (isinstance(interval_s, int | float) and 0 < interval_s < math.inf):
            raise ValueError(f"interval_s must be finite and > 0, got {interval_s!r}")
        self.interval_s = float(interval_s)
        self.deadline_in_force_s = self.static_deadline_s()
        for m in self.monitors.values():
            m.interval_s = self.interval_s
            m.stretched_s = self.deadline_in_force_s

    def _monitor(self, node: int) -> NodeMonitor:
        m = self.monitors.get(node)
        if m is None:
            m = self.monitors[node] = NodeMonitor(
                node, self.interval_s, self.k, self.jitter_beats, self.first_beat_deadlines
            )
            m.stretched_s = self.deadline_in_force_s
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
        self.job_silent_since_s = None
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
        mon = self._monitor(node)
        before = mon.last_heard_s if mon.heard else math.inf  # a first beat is no gap
        mon.observe(rank, arrival_s, seq, iteration, generation)
        if mon.last_heard_s - before > self._gap_peak_s:
            self._note_gap(mon, mon.last_heard_s - before, arrival_s)

    def _note_gap(self, mon: NodeMonitor, gap_s: float, arrival_s: float) -> None:
        """A live node heard again after ``gap_s``: the job's jitter (module doc)."""
        if (
            mon.node in self.node_down
            or gap_s >= mon.deadline_s()
            or mon.judge_from_s > mon.last_heard_s - gap_s
        ):
            return  # a dead node's return, or a silence the job was held on
        self._roll_gaps(arrival_s)
        self._gap_peak_s = max(self._gap_peak_s, gap_s)

    def _roll_gaps(self, now_s: float) -> None:
        if not math.isfinite(now_s):  # an offline replay's start or end
            return
        bucket = int(now_s // (GAP_WINDOW_S / 2))
        if bucket > self._gap_bucket:
            self._gap_prev_peak_s = self._gap_peak_s if bucket == self._gap_bucket + 1 else 0.0
            self._gap_peak_s = 0.0
            self._gap_bucket = bucket

    def _stretch(self, now_s: float) -> None:
        """Set the deadline in force from the job's recent beat gaps (module doc)."""
        self._roll_gaps(now_s)
        base = self.static_deadline_s()
        peak = max(self._gap_peak_s, self._gap_prev_peak_s)
        d = min(self.stretch_max * base, max(base, DEADLINE_STRETCH_FACTOR * peak))
        if d != self.deadline_in_force_s:
            self.deadline_in_force_s = d
            for m in self.monitors.values():
                m.stretched_s = d

    # ------------------------------------------------------------ level 2 decisions
    def static_deadline_s(self) -> float:
        """K intervals plus the jitter slack."""
        return (self.k + self.jitter_beats) * self.interval_s

    def deadline_s(self) -> float:
        """The fail-stop deadline in force: the static one, or stretched (module doc)."""
        return max(self.static_deadline_s(), self.deadline_in_force_s)

    def alive_nodes(self) -> list[NodeMonitor]:
        """Monitors of the nodes not declared down that still have a device alive."""
        return [
            m
            for n, m in self.monitors.items()
            if n not in self.node_down and any(st.alive for st in m.ranks.values())
        ]

    def check(self, now_s: float) -> list[LivenessEvent]:
        events: list[LivenessEvent] = []
        self._stretch(now_s)
        alive = self.alive_nodes()
        # when the job (its nodes still alive) was last heard, and whether to hold at all
        job_heard_s = max((m.last_heard_s for m in alive), default=-math.inf)
        hold_s = self.hold_deadlines * self.deadline_s()
        held = False
        if self.job_silent_since_s is not None and job_heard_s > self.job_silent_since_s:
            # heard again after a silence that held the verdicts: as after an outage of
            # the bus, nobody is judged on it; every deadline runs from now on (devices
            # of other processes beat again at their own phase, a moment later)
            for m in alive:
                m.judge_from_s = max(m.judge_from_s, job_heard_s)
        dying: list[tuple[int, NodeMonitor]] = []
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
                if (
                    hold_s > 0
                    and job_heard_s - mon.last_heard_s <= QUIET_TOGETHER_BEATS * self.interval_s
                    and now_s - mon.quiet_since_s() < mon.node_deadline_s() + hold_s
                ):
                    # every node still alive went quiet with this one: a job-wide
                    # silence, not this node's failure (yet)
                    held = True
                    continue
                dying.append((node, mon))
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
        self.job_silent_since_s = job_heard_s if held else None
        for node, mon in self._past_mass_hold(dying, len(alive), hold_s, now_s):
            mon.mark_all_dead()
            self.node_down.add(node)
            self._recent_dead.append((now_s, node))
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
        return events

    def _past_mass_hold(
        self, dying: list[tuple[int, NodeMonitor]], n_alive: int, hold_s: float, now_s: float
    ) -> list[tuple[int, NodeMonitor]]:
        """The nodes of ``dying`` to declare dead now: all of them, unless they make a
        suspect mass loss with the node deaths of the last deadline (module doc); then
        only those silent past the hold as well."""
        horizon = now_s - self.deadline_s()
        self._recent_dead = [(t, n) for t, n in self._recent_dead if t >= horizon]
        wave = len(dying) + len(self._recent_dead)
        mass = (
            hold_s > 0
            and len(dying) > 0
            and wave >= self.mass_loss_min_nodes
            and wave >= self.mass_loss_fraction * (n_alive + len(self._recent_dead))
        )
        if not mass:
            self.suspect_nodes = set()
            return dying
        out = [
            (n, m) for n, m in dying if now_s - m.quiet_since_s() >= m.node_deadline_s() + hold_s
        ]
        suspect = {n for n, _ in dying} - {n for n, _ in out}
        if suspect - self.suspect_nodes and not self.suspect_nodes:
            self.mass_loss_holds_total += 1
        self.suspect_nodes = suspect
        return out

    def declare_node_dead(self, node: int, now_s: float) -> LivenessEvent | None:
        """A node whose agent connection closed (its process died and its kernel closed
        the socket, :mod:`resihp.liveness_agent`): dead now, without K missed beats.
        None when the node is unknown, down already, or has no device alive.  Only beats
        that arrive after ``now_s`` bring it back (one already in the stream, unread, is
        from before)."""
        mon = self.monitors.get(node)
        if mon is None or node in self.node_down:
            return None
        if not any(st.alive for st in mon.ranks.values()):
            return None
        last = mon.last_heard_s
        mon.mark_all_dead()
        for st in mon.ranks.values():
            st.last_arrival_s = max(st.last_arrival_s, now_s)
        mon.last_heard_s = max(mon.last_heard_s, now_s)
        self.node_down.add(node)
        self._recent_dead.append((now_s, node))
        return LivenessEvent(
            scope="node",
            node=node,
            ranks=sorted(mon.ranks),
            state="dead",
            detected_at_s=now_s,
            last_seen_s=last,
            missed_beats=0,
        )

    def declare_rank_dead(self, rank: int, now_s: float) -> LivenessEvent | None:
        """A rank whose own agent connection closed (a rank process of its own killed, its
        node's other ranks still there): dead now, as :meth:`declare_node_dead` for one
        device.  None when the rank is unknown, dead already, or its node is down."""
        node = self._rank_node.get(rank)
        mon = self.monitors.get(node) if node is not None else None
        st = mon.ranks.get(rank) if mon is not None else None
        if st is None or not st.alive or node in self.node_down:
            return None
        last = st.last_arrival_s
        st.alive = False
        st.rejoined = False
        st.last_arrival_s = max(st.last_arrival_s, now_s)
        mon.last_heard_s = max(mon.last_heard_s, now_s)
        return LivenessEvent(
            scope="rank",
            node=node,
            ranks=[rank],
            state="dead",
            detected_at_s=now_s,
            last_seen_s=last,
            missed_beats=0,
        )

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

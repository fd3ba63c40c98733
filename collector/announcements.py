"""What the trainer says in its job state, read by the collector: the job finished on
purpose, the period its ranks beat at, and that only TP rank 0 of each group sends chunk rows.

A mixin of :class:`collector.service.CollectorService` (it reads the service's client,
config, keys, liveness coordinator, assembler, layout and counters).  The job state
(``keys.job_state``, :func:`resihp.bus.job_state_doc`) is re-read every half heartbeat
interval, at most every second, before the telemetry batch it may be about.  Every
announcement is untrusted input: a value out of bounds is refused, said once and counted,
and what was in force stays.
"""

from __future__ import annotations

import logging
from typing import Any

from resihp import bus

log = logging.getLogger("collector.service")


class TrainerAnnouncements:
    """Mixin: see the module doc."""

    _job_state_next: float
    _finished: bool
    #: field -> the repr of the last value of it refused (each said and counted once)
    _refused_said: dict[str, str]

    def _refuse(self, name: str, raw: Any, counter: str, why: str) -> None:
        """An announcement refused: said and counted once per value in a row (compared by
        repr: a NaN the JSON parser lets through is the same value at the next read)."""
        said = repr(raw)[:200]
        if self._refused_said.get(name) == said:
            return
        self._refused_said[name] = said
        self._count(counter)
        log.error("collector: job %s announces %s=%.40r, %s", self.keys.job_id, name, raw, why)

    def _job_finished(self, now: float) -> bool:
        """Whether the trainer said the job ended on purpose.

        Re-read every half heartbeat interval: the trainer says so right after its last
        beat, well before K intervals of silence could count as a failure."""
        if now >= self._job_state_next:
            self._job_state_next = now + min(1.0, self.liveness.interval_s / 2)
            # A Redis restarted without its data forgot the job: listing it again here
            # (SADD is idempotent) keeps it in status and metrics whatever trainer runs
            # it (a telemetry producer lists the job only once).
            bus.register_job(self.client, self.keys)
            doc = bus.job_state_doc(self.client, self.keys)
            finished = doc.get("state") == "finished"
            if doc and not finished and self.config.follow_trainer_interval:
                # the period announced, else this collector's own
                announced = doc.get(bus.JOB_HEARTBEAT_INTERVAL_S, self.config.heartbeat_interval_s)
                self._follow_interval(announced, now)
            if doc:  # a finished job's too: its last records may still be assembled
                self._follow_tp0_only(doc.get(bus.JOB_REPORTS_TP0_ONLY, False), now)
            if self._finished and not finished:
                # Running again (a new launch): nobody was expected meanwhile.
                self.liveness.resume(now)
            self._finished = finished
        return self._finished

    def _follow_interval(self, raw: Any, now: float) -> None:
        """The heartbeat period the trainer announced (``bus.JOB_HEARTBEAT_INTERVAL_S``;
        a trainer that announces none, this collector's ``heartbeat_interval_s``): the
        fail-stop deadline follows it, from a fresh deadline for every rank.  An
        announcement is untrusted input: outside ``bus.HEARTBEAT_INTERVAL_BOUNDS_S`` (or
        not a number) it is refused, said once and counted, and the period stays."""
        lo, hi = bus.HEARTBEAT_INTERVAL_BOUNDS_S
        if not bus.heartbeat_interval_ok(raw):
            self._refuse(
                bus.JOB_HEARTBEAT_INTERVAL_S,
                raw,
                "heartbeat_interval_refused_total",
                f"not a number in [{lo:g}, {hi:g}] s: liveness stays on "
                f"{self.liveness.interval_s:g} s",
            )
            return
        if float(raw) == self.liveness.interval_s:
            return
        log.info(
            "collector: job %s beats every %g s (it says so): fail-stop deadline %g -> %g s",
            self.keys.job_id,
            float(raw),
            self._deadline_s(),
            (self.liveness.k + self.liveness.jitter_beats) * float(raw),
        )
        self.liveness.set_interval(float(raw))
        self.liveness.resume(now)

    def _follow_tp0_only(self, raw: Any, now: float) -> None:
        """Whether the trainer said only TP rank 0 of each group sends chunk rows
        (``bus.JOB_REPORTS_TP0_ONLY``; absent: every rank does): the assembler then
        expects those ranks alone, so a record is complete when they are in, not
        published incomplete after waiting for the others (up to ``stale_s``).  ``tp_dedup`` in the config keeps that
        mode whatever the trainer says.  Not a bool: refused, said once and counted."""
        if not isinstance(raw, bool):
            self._refuse(
                bus.JOB_REPORTS_TP0_ONLY,
                raw,
                "reports_tp0_only_refused_total",
                "not a bool: the assembler keeps expecting "
                + ("TP rank 0 of each group" if self.assembler.tp_dedup else "every rank"),
            )
            return
        on = raw or self.config.tp_dedup
        if on == self.assembler.tp_dedup:
            return
        log.info(
            "collector: job %s %s: records expect chunk rows from %s",
            self.keys.job_id,
            "reports TP rank 0 only (it says so)" if on else "reports every TP rank again",
            "TP rank 0 of each group" if on else "every rank",
        )
        self.assembler.tp_dedup = on
        if self.layout is not None:  # the assembler's view of it, with the new expectation
            self.set_layout(self.layout, now)

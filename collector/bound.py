"""The bound on an iteration record's span: what the collector flags, and when it learns a new pace.

A record whose span exceeds ``RECORD_TIME_FACTOR`` (10) x the median of the job's recent
unflagged complete records (the reference, once there are 3) is flagged
``iteration_time_beyond_bound`` (:data:`resihp.schemas.RECORD_FLAGS`): a rank's clock
stepped, or the job hung.  A flagged record does not move the reference, so a genuine
lasting slowdown (the whole job 10x slower: a degraded fabric, a throttled cluster) would
be flagged for ever: ``RECORD_NEW_PACE_RUN`` complete records flagged in a row whose spans
agree within ``RECORD_NEW_PACE_SPREAD`` become the job's new pace (the reference restarts
from them); a stepping clock gives spans that do not agree and keeps being flagged.  A new
layout restarts the reference (``CollectorService.set_layout`` calls :meth:`reset`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import numpy as np

from resihp import bus
from resihp.schemas import RECORD_TIME_FACTOR, IterationRecord

log = logging.getLogger("collector.service")

#: Complete records of the recent pace the reference is the median of.
RECORD_REFERENCE_RECORDS = 32
#: Complete records flagged in a row (spans within RECORD_NEW_PACE_SPREAD x of each
#: other) that make the job's new pace.
RECORD_NEW_PACE_RUN = 8
RECORD_NEW_PACE_SPREAD = 2.0


class RecordBound:
    """See the module doc."""

    def __init__(self) -> None:
        #: spans of the recent unflagged complete records (the reference)
        self.recent_s: deque[float] = deque(maxlen=RECORD_REFERENCE_RECORDS)
        #: spans of the complete records flagged in a row since the last unflagged one
        self.run_s: list[float] = []
        self._flag_log = bus.ThrottledWarning(log, every_s=60.0)

    def apply(self, rec: IterationRecord, svc: Any) -> None:
        """:meth:`check` ``rec``; flag it if beyond the bound, counted (``svc._count``:
        ``iterations_time_flagged_total``, ``iterations_time_new_pace_total``) and said."""
        ref = self.reference_s()
        pace = self.check(rec)
        if pace is None:
            return
        rec.flags.append("iteration_time_beyond_bound")
        svc._count("iterations_time_flagged_total")
        self._flag_log.warning(
            "collector: iteration %d spans %.1f s, more than %g x the recent median "
            "%.2f s: published flagged (a rank's clock stepped, or the job hung)",
            rec.iteration,
            rec.iteration_time_s,
            RECORD_TIME_FACTOR,
            ref,
        )
        if pace:
            svc._count("iterations_time_new_pace_total")
            log.warning(
                "collector: job %s: %d records in a row span %.1f-%.1f s, beyond the bound "
                "and alike: taken as the job's new pace (the reference was %.2f s)",
                svc.keys.job_id,
                len(pace),
                min(pace),
                max(pace),
                ref,
            )

    def reset(self) -> None:
        self.recent_s.clear()
        self.run_s.clear()

    def reference_s(self) -> float:
        """The median span of the recent complete records (NaN before 3)."""
        return float(np.median(self.recent_s)) if len(self.recent_s) >= 3 else float("nan")

    def check(self, rec: IterationRecord) -> list[float] | None:
        """None: within the bound (a complete record joins the reference).  Otherwise
        beyond it: ``[]``, or the run of spans that just became the new pace."""
        ref = self.reference_s()
        if not (ref > 0 and rec.iteration_time_s > RECORD_TIME_FACTOR * ref):
            self.run_s.clear()
            if rec.complete:
                self.recent_s.append(rec.iteration_time_s)
            return None
        if not rec.complete:
            return []
        run = self.run_s
        run.append(rec.iteration_time_s)
        del run[:-RECORD_NEW_PACE_RUN]
        if len(run) < RECORD_NEW_PACE_RUN or max(run) > RECORD_NEW_PACE_SPREAD * min(run):
            return []
        pace = list(run)
        self.recent_s.clear()
        self.recent_s.extend(pace)
        run.clear()
        return pace

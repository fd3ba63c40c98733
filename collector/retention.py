"""Telemetry stream retention: trim behind the slowest consumer group, bounded in time and bytes.

A mixin of :class:`collector.service.CollectorService` (it reads the service's client,
config, stream names, read frontier and counters).  The telemetry stream is trimmed to the
oldest entry any consumer group still needs, and never keeps more than ``telemetry_keep_s``
before the newest entry read, shortened to hold about ``telemetry_keep_mb`` at the byte
rate the collector reads at.  MAXLEN on the producers' XADD stays the memory backstop;
what it trims unread, and what the producer quotas refuse, is counted and said here.
"""

from __future__ import annotations

import redis


class TelemetryRetention:
    """Mixin: see the module doc."""

    @staticmethod
    def _id(raw: bytes | str) -> tuple[int, int]:
        ms, _, seq = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition("-")
        return int(ms), int(seq or 0)

    def telemetry_trim_floor(self) -> tuple[str, str] | None:
        """The id the telemetry stream may be trimmed to (XTRIM MINID: entries below it
        go) and the group that sets it (``""``: the retention window), or None.

        The oldest entry any consumer group still needs: its oldest pending (delivered,
        not acknowledged) entry, else the one after its last-delivered id; and never
        more than ``telemetry_keep_s`` before the newest entry this collector read."""
        if not self._frontier_s:
            return None  # nothing read yet: no window to keep from
        try:
            groups = self.client.xinfo_groups(self.telemetry_stream)
        except redis.ResponseError:  # no stream (Redis lost its data): nothing to trim
            return None
        if not groups:
            return None
        keep_ms = int(round(self.telemetry_keep_window_s() * 1000))
        floor, by = (max(0, int(round(self._frontier_s * 1000)) - keep_ms), 0), ""
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else str(g["name"])
            ms, seq = self._id(g["last-delivered-id"])
            need = (ms, seq + 1)
            if g["pending"]:
                summary = self.client.xpending(self.telemetry_stream, name)
                if summary["pending"] and summary["min"] is not None:
                    need = min(need, self._id(summary["min"]))
            if need < floor:
                floor, by = need, name
        return f"{floor[0]}-{floor[1]}", by

    def telemetry_keep_window_s(self) -> float:
        """Seconds of telemetry kept before the newest entry read: ``telemetry_keep_s``,
        shortened so that it holds about ``telemetry_keep_mb`` at the byte rate this
        collector reads the stream at (updated here, smoothed over trims)."""
        mark = (self._frontier_s, self.consumer.stats.read_bytes_total)
        if self._rate_mark is not None and mark[0] > self._rate_mark[0]:
            rate = (mark[1] - self._rate_mark[1]) / (mark[0] - self._rate_mark[0])
            old = self.telemetry_bytes_per_s
            self.telemetry_bytes_per_s = rate if not old else 0.5 * (old + rate)
        if self._rate_mark is None or mark[0] > self._rate_mark[0]:
            self._rate_mark = mark
        keep_s = self.config.telemetry_keep_s
        if self.telemetry_bytes_per_s > 0:
            keep_s = min(keep_s, self.config.telemetry_keep_mb * 1e6 / self.telemetry_bytes_per_s)
        return keep_s

    def trim_telemetry(self) -> int:
        """Trim the telemetry stream to :meth:`telemetry_trim_floor`; -> entries removed.

        Exact (not ``~``): every few seconds it removes what arrived since the last trim,
        and its cost beyond whole macro nodes is one node's entries; an approximate trim
        keeps up to a node (100 entries) more than the rule says."""
        got = self.telemetry_trim_floor()
        if got is None:
            return 0
        minid, by = got
        if by and by != self.consumer.group:
            behind_s = self._frontier_s - self._id(minid)[0] / 1000.0
            if behind_s > 2 * self.config.telemetry_keep_s:
                self._trim_log.warning(
                    "collector: consumer group %s of %s still needs telemetry from %.0f s "
                    "before the newest: it holds the trim back (the stream is bounded by its "
                    "MAXLEN only); delete the group if nobody reads it",
                    by,
                    self.telemetry_stream,
                    behind_s,
                )
        removed = int(self.client.xtrim(self.telemetry_stream, minid=minid, approximate=False))
        self._count("telemetry_trimmed_total", removed)
        return removed

    #: (consumer stat, counter, what the log line says of such entries)
    _UNREAD = (
        (
            "refused_total",
            "telemetry_refused_total",
            "refused unread, their producer over its quota (a junk flood?), summed in the "
            "dead-letter stream",
        ),
        (
            "lost_total",
            "telemetry_lost_total",
            "trimmed from the telemetry stream before this collector read them (a flood "
            "past the stream's MAXLEN?)",
        ),
    )

    def _count_lost(self) -> None:
        """Entries of the job's producers trimmed before this collector read them, and
        entries refused unread over their producer's quota: counted (``telemetry_lost_total``,
        ``telemetry_refused_total``: metrics, health, ``resihp status``, the dashboard's
        banner) and said, never silent."""
        for stat, counter, what in self._UNREAD:
            new = getattr(self.consumer.stats, stat) - self._unread_said[counter]
            if new <= 0:
                continue
            self._unread_said[counter] += new
            self._count(counter, new)
            self._health_now = True
            self._unread_log[counter].warning(
                "collector: job %s: %d telemetry entries %s; %d so far",
                self.keys.job_id,
                new,
                what,
                self._unread_said[counter],
            )

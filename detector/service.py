"""The live detector: Redis streams in, FailureReports and device health out.

``DetectorService(config, client)`` reads ``keys.liveness`` and
``keys.iterations`` through consumer groups (``bus.StreamConsumer``: invalid
entries go to the dead-letter stream, unacknowledged ones are re-delivered
after a restart), hands each batch to the pure :class:`detector.engine.Detector`
(liveness first, so a fail-stop is reported before a co-occurring fail-slow),
publishes reports to ``keys.failures`` and keeps ``keys.device_health``
(rank -> JSON {"p", "state", "since"}, plus "kind" - the fail-slow kind - on a
slow device) current.  Every loop it re-reads the runtime subset of its
settings from ``keys.detector_config`` (writing back the settings in use when
the hash is gone with Redis's data) and the layout from ``keys.layout``, so
thresholds, the CPD penalty, heartbeat K and the per-rank off switch change
without a restart.  Started while Redis cannot be reached, it waits for it
(``resihp.entry.wait_for_redis``) and restores what it had published then (device
health, slow and dead ranks alike, the job's newest iteration, the report sequence).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import redis

from detector.config import DetectorConfig
from detector.engine import Detector
from resihp import bus, entry
from resihp.keys import JobKeys
from resihp.memory import HeapTrim
from resihp.schemas import FailureReport, IterationRecord, LivenessEvent
from resihp.topology import Layout, LayoutError
from resihp.wire import decode_entry

log = logging.getLogger(__name__)
SERVICE = "detector"
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
#: The sequence number that ends a report id the engine builds
#: (``<mode>-<kind>-i<iteration>-r<rank>-<seq>``, see ``Detector._report_id``).
_REPORT_SEQ = re.compile(r"^[a-z]+-[a-z_]+-i-?\d+-r-?\d+-(\d+)$")
#: How many of the newest entries a restart reads back from a stream.
_RESTORE_SCAN = 200


class DetectorService:
    def __init__(
        self,
        config: DetectorConfig,
        client: redis.Redis,
        consumer: str | None = None,
        override: frozenset[str] = frozenset(),
    ):
        """``override``: runtime fields set explicitly at start (command-line flags); they
        replace what the job's ``detector_config`` hash holds, the others only fill it."""
        self.config = config.validate()
        self.override = frozenset(override)
        self.client = client
        self.keys = JobKeys(config.job_id)
        self._down_log = bus.ThrottledWarning(log)
        self.engine = Detector(self.config)
        self._restored = False
        # Redis may not answer yet (started before it, or during an outage): run() then
        # waits for it; a crash here would spend the launcher's restart budget instead
        entry.try_redis(self._restore, SERVICE, client)
        name = consumer or f"{SERVICE}-0"
        group = self.keys.group(SERVICE)
        self.live_in = bus.StreamConsumer(
            client, self.keys, self.keys.liveness, group, consumer=name
        )
        self.iter_in = bus.StreamConsumer(
            client, self.keys, self.keys.iterations, group, consumer=name
        )
        self.health = bus.Health(client, self.keys, SERVICE)
        self._layout_raw: bytes | None = None
        self._config_errors_seen: set[str] = set()
        self._seeded = False
        self.reports_total = 0
        self.records_flagged_total = 0
        self._flag_log = bus.ThrottledWarning(log, every_s=60.0)
        self.config_changes_total = 0
        self.heap = HeapTrim()  # freed record buffers back to the kernel (resihp/memory.py)

    def _restore(self) -> None:
        """Take over what a previous detector process of this job published: the device
        health (slow devices stay slow, dead ones dead), the job's newest iteration and
        the report sequence, so a restart neither re-reports a death nor stamps a report
        "iteration 0" while the job is hung, nor repeats a report id."""
        restored = self.engine.restore(self._published_health())
        self.engine.resume(self._newest_iteration(), self._published_report_seq())
        self._restored = True
        if restored:
            log.info(
                "detector: %d device(s) were reported slow before this process started; "
                "their recovery will be reported",
                restored,
            )
        if self.engine.failstop.dead:
            log.info(
                "detector: ranks %s were reported dead before this process started; "
                "a death reported again for them is a duplicate",
                sorted(self.engine.failstop.dead),
            )

    def _newest_iteration(self) -> int | None:
        """The iteration of the newest IterationRecord in ``keys.iterations`` (None when
        there is none).  It is the job's iteration, not necessarily one this detector has
        judged: records a predecessor left unacknowledged are re-delivered and judged
        all the same (the engine's stale check also compares layout ids)."""
        for fields in self._newest_entries(self.keys.iterations, page=1):
            try:
                good, _bad = decode_entry(fields)
            except Exception:  # noqa: BLE001 - a poison entry must not stop the start
                continue
            its = [m.iteration for m in good if isinstance(m, IterationRecord)]
            if its:
                return max(its)
        return None

    def _newest_entries(self, stream: str, page: int):
        """Up to ``_RESTORE_SCAN`` entries of ``stream``, newest first, read ``page`` at a
        time (an IterationRecord of a large job is megabytes: read one by one, and
        usually the first is the one wanted)."""
        top = "+"  # then just below the oldest id read (no "(" ranges before Redis 6.2)
        left = _RESTORE_SCAN
        while left > 0:
            got = self.client.xrevrange(stream, max=top, count=min(page, left))
            if not got:
                return
            for _id, fields in got:
                yield fields
            left -= len(got)
            last = got[-1][0]
            ms, seq = map(int, (last.decode() if isinstance(last, bytes) else last).split("-"))
            if seq:
                top = f"{ms}-{seq - 1}"
            elif ms:
                top = f"{ms - 1}-{2**64 - 1}"
            else:
                return

    def _published_report_seq(self) -> int:
        """The highest report sequence number already used for this job: the newest
        reports' ids in ``keys.failures`` and ``detector_reports_total`` (a process
        numbered its reports from 1 before ids were continued across restarts, so the
        count of all reports bounds those; the stream is capped, its newest entries are
        kept)."""
        seq = 0
        raw = self.client.hget(self.keys.counters, "detector_reports_total")
        try:
            seq = max(seq, int(raw or 0))
        except ValueError:
            pass
        for fields in self._newest_entries(self.keys.failures, page=_RESTORE_SCAN):
            try:
                good, _bad = decode_entry(fields)
            except Exception:  # noqa: BLE001
                continue
            for m in good:
                found = _REPORT_SEQ.match(getattr(m, "report_id", "") or "")
                if found:
                    seq = max(seq, int(found.group(1)))
        return seq

    def _published_health(self) -> dict[int, dict]:
        """``keys.device_health`` as a previous detector process left it."""
        out = {}
        for k, v in self.client.hgetall(self.keys.device_health).items():
            try:
                out[int(k)] = json.loads(v)
            except (TypeError, ValueError):
                log.warning("unreadable device_health entry %r: skipped", k)
        return {r: h for r, h in out.items() if r >= 0 and isinstance(h, dict)}

    # ---------------------------------------------------------- settings
    def _seed_config(self) -> None:
        """Write our runtime defaults where absent, so operators (and the
        collector, for heartbeat_k) always find a value.  A setting given explicitly
        at start replaces the stored one: the hash outlives detector processes, and a
        flag silently losing to an earlier run's value would surprise whoever gave it."""
        mine = self.config.runtime_dict()
        stored = self.client.hmget(self.keys.detector_config, list(mine))
        pipe = self.client.pipeline(transaction=False)
        for (k, v), old in zip(mine.items(), stored, strict=True):
            if k in self.override:
                old = old.decode() if isinstance(old, bytes) else old
                if old is not None and old != v:
                    log.info("detector: %s=%s from the command line replaces %s", k, v, old)
                pipe.hset(self.keys.detector_config, k, v)
            else:
                pipe.hsetnx(self.keys.detector_config, k, v)
        pipe.execute()
        self._seeded = True

    def _write_back_config(self) -> None:
        """The hash is gone (Redis restarted without its data, it is never emptied on
        purpose): write back the settings this detector runs on, or `resihp config show`
        shows nothing and the collector falls back to its own heartbeat_k.  HSETNX: a
        value an operator sets meanwhile wins."""
        log.warning(
            "detector: %s is gone from Redis (restarted without its data?): "
            "writing back the settings in use",
            self.keys.detector_config,
        )
        pipe = self.client.pipeline(transaction=False)
        for k, v in self.config.runtime_dict().items():
            pipe.hsetnx(self.keys.detector_config, k, v)
        # the device health went with it: write back what this process knows, or a
        # detector started later would forget the ranks already reported dead (and
        # report them again) and the slow ones
        for r, h in self.engine.health.items():
            pipe.hsetnx(self.keys.device_health, str(r), json.dumps(h, separators=(",", ":")))
        pipe.execute()

    def refresh_config(self) -> bool:
        """Apply the runtime hash; True when something changed."""
        raw = self.client.hgetall(self.keys.detector_config)
        if not raw and self._seeded:
            self._write_back_config()
            return False
        new, errors = self.config.with_runtime(raw)
        for e in errors:
            if e not in self._config_errors_seen:
                self._config_errors_seen.add(e)
                log.error("detector: ignoring runtime setting %s", e)
                bus.incr_counter(self.client, self.keys, "detector_config_rejected_total")
        if new != self.config:
            changed = {
                f: (getattr(self.config, f), getattr(new, f))
                for f in new.runtime_dict()
                if getattr(self.config, f) != getattr(new, f)
            }
            log.info("detector: runtime config changed %s", changed)
            self.config = new
            self.engine.set_config(new)
            self.config_changes_total += 1
            bus.incr_counter(self.client, self.keys, "detector_config_changes_total")
            return True
        return False

    def refresh_layout(self) -> None:
        raw = self.client.get(self.keys.layout)
        if raw is None or raw == self._layout_raw:
            return
        self._layout_raw = raw
        try:
            layout = Layout.from_json(raw)
        except LayoutError as e:
            log.error(
                "detector: layout at %s is invalid, keeping the previous one: %s",
                self.keys.layout,
                e,
            )
            bus.incr_counter(self.client, self.keys, "detector_layout_invalid_total")
            return
        self.engine.set_layout(layout)
        self.live_in.max_rank = None  # liveness may name ranks of an older, larger layout
        self.iter_in.max_rank = layout.world_size  # a record of rank 99999 is refused

    # ---------------------------------------------------------- main step
    def run_once(self) -> int:
        """One bounded step: read what is pending, judge it, publish. Returns messages handled."""
        if not self._restored:
            self._restore()
        if not self._seeded:
            self._seed_config()
        self.refresh_config()
        self.refresh_layout()
        # the wait blocks on the liveness stream: a fail-stop (a killed process is
        # reported within 0.5 s, issue 24) wakes this loop at once, while an iteration
        # record, seconds apart, may wait out the rest of ``block_ms``
        its = self.iter_in.read(count=self.config.batch_count, block_ms=None)
        live = self.live_in.read(
            count=self.config.batch_count, block_ms=None if its else self.config.block_ms
        )
        msgs = [m for _id, ms in live for m in ms] + [m for _id, ms in its for m in ms]
        if not msgs:
            return 0
        msgs = self._pass_over_flagged(msgs)
        self._dead_letter_misrouted(live, LivenessEvent, self.keys.liveness)
        self._dead_letter_misrouted(its, IterationRecord, self.keys.iterations)
        reports = self.engine.handle_batch(msgs, now_s=time.time())
        self._publish(reports)
        self.live_in.ack([i for i, _ in live])
        self.iter_in.ack([i for i, _ in its])
        self.heap.maybe()
        return len(msgs)

    def _pass_over_flagged(self, msgs: list) -> list:
        """Records the collector flagged (``IterationRecord.flags``: a span beyond its
        bound, a stepped clock or a hung job) are no measurement to act on: counted
        (``detector_records_flagged_total``) and kept from the engine, so one absurd span
        neither trains the detector's baselines nor reports a slow device.  A lasting
        genuine slowdown stops being flagged after a few records (the collector takes it
        as the job's new pace) and reaches the engine then."""
        flagged = [m for m in msgs if isinstance(m, IterationRecord) and m.flags]
        if not flagged:
            return msgs
        self.records_flagged_total += len(flagged)
        self.client.hincrby(self.keys.counters, "detector_records_flagged_total", len(flagged))
        self._flag_log.warning(
            "detector: %d record(s) flagged by the collector (%s, iteration %d) passed over",
            len(flagged),
            ",".join(flagged[-1].flags),
            flagged[-1].iteration,
        )
        return [m for m in msgs if not (isinstance(m, IterationRecord) and m.flags)]

    def _dead_letter_misrouted(self, entries, expected: type, stream: str) -> None:
        """A valid message of another kind on this stream is kept in the dead-letter
        stream (the engine skips it), so a producer writing to the wrong stream shows."""
        for _id, ms in entries:
            for m in ms:
                if not isinstance(m, expected):
                    bus.dead_letter(
                        self.client,
                        self.keys,
                        stream,
                        SERVICE,
                        f"{getattr(m, 'TYPE', type(m).__name__)} on the stream of "
                        f"{expected.TYPE} messages: ignored",
                        m.to_dict(),
                    )

    def _publish(self, reports: list[FailureReport]) -> None:
        # one transaction: the reports and the device health they change land together,
        # so device_health never lags a published report (a restarted detector takes
        # the dead and slow ranks from it) and the report count matches the stream
        pipe = self.client.pipeline(transaction=True)
        for rep in reports:
            pipe.xadd(
                self.keys.failures,
                {b"m": ("[" + rep.to_json() + "]").encode()},
                maxlen=10_000,
                approximate=True,
            )
            pipe.hincrby(self.keys.counters, f"detector_{rep.kind}_total", 1)
        health = self.engine.take_health_updates()
        if health:
            pipe.hset(
                self.keys.device_health,
                mapping={str(r): json.dumps(h, separators=(",", ":")) for r, h in health.items()},
            )
        if reports:
            pipe.hincrby(self.keys.counters, "detector_reports_total", len(reports))
        pipe.execute()
        self.reports_total += len(reports)
        for rep in reports:  # after the reports are out: a log line must not delay them
            log.warning(
                "detector: %s ranks=%s nodes=%s iteration=%d severity=%s",
                rep.kind,
                rep.ranks,
                rep.nodes,
                rep.iteration,
                rep.severity,
            )

    def health_extra(self) -> dict:
        fs = self.engine.failslow.stats
        return {
            "mode": self.config.mode,
            "iterations_total": self.engine.stats.iterations_total,
            "reports_total": self.reports_total,
            "records_flagged_total": self.records_flagged_total,
            "validations_total": fs.validations_total,
            "benign_filtered_total": fs.benign_filtered_total,
            "warm": self.engine.failslow.ready,
            # what it applied, so `resihp config show` can confirm a change took effect
            "config": self.config.runtime_dict(),
        }

    def run(self, stop: threading.Event) -> None:
        if not self._restored and not entry.wait_for_redis(
            self._restore, SERVICE, self.client, stop
        ):
            return
        last_beat = 0.0
        while not stop.is_set():
            try:
                self.run_once()
                now = time.monotonic()
                if now - last_beat >= 1.0:
                    last_beat = now
                    self.health.beat("ok", **self.health_extra())
            except _REDIS_DOWN as e:
                self._down_log.warning("detector: redis unavailable (%s); retrying", e)
                stop.wait(0.2)

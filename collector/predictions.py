"""Per-layout healthy iteration time: recorded once per layout the job runs, so the
dashboard draws the "predicted (healthy)" line for iterations of every layout.

The dashboard predicts the healthy time of the layout in force from the latest record;
iterations of a layout a plan replaced had no prediction (the layout history keeps
layouts, but re-predicting each from one of its records is seconds at 16k GPUs on every
first view).  The collector, which assembles the records, predicts each layout once from
its first complete, unflagged record (``resihp.pipeline.healthy``, under the device
verdicts of ``keys.device_health`` at that time) and writes
``keys.layout_predictions[layout_id] = {"predicted_healthy_s", "iteration", "at_s"}``,
keeping the newest :data:`KEEP` layouts.  It runs on a worker thread, never in the
collector's loop (3 s for a 16k-GPU iteration at load 31, ``bench/dashboard_scale.py``);
one at a time: a layout met while another's prediction runs waits for a later record.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis

from resihp.keys import JobKeys
from resihp.schemas import IterationRecord
from resihp.topology import Layout, LayoutError

log = logging.getLogger(__name__)

#: Layout ids the hash keeps (newest), as many as the dashboard's layout history.
KEEP = 2000


def read_device_health(client: redis.Redis, keys: JobKeys) -> dict[int, dict[str, Any]]:
    """``keys.device_health`` as rank -> verdict; unreadable entries are passed over."""
    out: dict[int, dict[str, Any]] = {}
    for k, v in client.hgetall(keys.device_health).items():
        try:
            d = json.loads(v)
            if isinstance(d, dict):
                out[int(k)] = d
        except (TypeError, ValueError):
            continue
    return out


class LayoutPredictions:
    """Predicts each layout's healthy iteration time once (see the module doc)."""

    def __init__(self, client: redis.Redis, keys: JobKeys, background: bool = True):
        self.client = client
        self.keys = keys
        self.background = background
        #: (layout id, identity of the Layout object): a trainer that restarts reuses ids
        self._done: set[tuple[int, int]] = set()
        self._busy = threading.Lock()
        self.predicted_total = 0

    def observe(self, rec: IterationRecord, layout: Layout | None = None) -> None:
        """After ``rec`` was published: predict its layout if that was not done yet.
        ``layout``: the layout in force (None: read ``keys.layout``)."""
        if not rec.complete or rec.flags or not rec.chunks:
            return
        if layout is None or layout.layout_id != rec.layout_id:
            layout = self._current(rec.layout_id)
        if layout is None or layout.layout_id != rec.layout_id:
            return  # the record ran under a layout that is not at hand: a later one is
        key = (rec.layout_id, id(layout))
        if key in self._done or not self._busy.acquire(blocking=False):
            return
        self._done.add(key)
        if not self.background:
            self._run(key, layout, rec)
            return
        threading.Thread(
            target=self._run, args=(key, layout, rec), name="layout-prediction", daemon=True
        ).start()

    def _current(self, layout_id: int) -> Layout | None:
        if any(lid == layout_id for lid, _ in self._done):
            return None  # done under the layout object we had; no re-read per record
        raw = self.client.get(self.keys.layout)
        try:
            return Layout.from_json(raw) if raw else None
        except LayoutError:
            return None

    def _run(self, key: tuple[int, int], layout: Layout, rec: IterationRecord) -> None:
        # the DAG engine only here: a health probe importing the service does not load it
        from resihp.pipeline.healthy import predict_healthy

        try:
            health = read_device_health(self.client, self.keys)
            res = predict_healthy(layout, rec.chunks, health)
            if res is None:
                self._done.discard(key)
                return
            self.client.hset(
                self.keys.layout_predictions,
                str(rec.layout_id),
                json.dumps(
                    {
                        "predicted_healthy_s": round(res["iteration_time_s"], 6),
                        "iteration": rec.iteration,
                        "at_s": round(time.time(), 3),
                    }
                ),
            )
            self._trim()
            self.predicted_total += 1
        except redis.RedisError as e:
            self._done.discard(key)  # a later record tries again
            log.warning("layout %d: prediction not recorded: %s", rec.layout_id, e)
        except Exception:  # noqa: BLE001 - a prediction is optional; never stop the collector
            log.exception("layout %d: no healthy prediction", rec.layout_id)
        finally:
            self._busy.release()

    def _trim(self) -> None:
        if self.client.hlen(self.keys.layout_predictions) <= KEEP:
            return
        ids = sorted(int(k) for k in self.client.hkeys(self.keys.layout_predictions))
        self.client.hdel(self.keys.layout_predictions, *[str(i) for i in ids[:-KEEP]])

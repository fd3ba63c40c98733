"""The overview's "predicted (healthy)" line spans every iteration: the collector records
each layout's DAG-predicted healthy time once (``keys.layout_predictions``), and the chart
uses it for rows of layouts a plan replaced (it had no prediction for them before)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from collector.predictions import LayoutPredictions
from dashboard.data import DashboardData
from dashboard.figures import iteration_time_figure, predicted_series
from dashboard.predict import healthy_iteration_time_s
from resihp.keys import JobKeys
from resihp.schemas import IterationRecord
from resihp.topology import Layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dashboard_scenario import simulate  # noqa: E402


def _record(layout: Layout, it: int, slow: dict | None = None) -> IterationRecord:
    cols, dur = simulate(layout, slow or {}, 1000.0 + it)
    return IterationRecord(
        iteration=it,
        iteration_time_s=dur,
        start_s=1000.0 + it,
        end_s=1000.0 + it + dur,
        samples=8,
        tokens=8 * 4096,
        num_ranks_reporting=layout.world_size,
        chunks=cols,
        layout_id=layout.layout_id,
    )


@pytest.mark.redis
def test_the_collector_records_each_layout_once_and_the_dashboard_reads_it(r):
    keys = JobKeys("lp")
    first = Layout.uniform(tp=2, pp=4, dp=2, num_layers=32, num_microbatches=8)
    second = Layout.uniform(tp=2, pp=2, dp=2, num_layers=32, num_microbatches=8)
    second.layout_id = 1
    r.set(keys.layout, json.dumps(first.to_dict()))
    # rank 5 at half speed: the prediction heals it (the same engine as the dashboard's)
    r.hset(keys.device_health, "5", json.dumps({"p": 0.5, "state": "slow", "since": 1.0}))
    pred = LayoutPredictions(r, keys, background=False)
    slow = _record(first, 3, {5: 0.5})
    pred.observe(slow, first)
    pred.observe(_record(first, 4, {5: 0.5}), first)  # the same layout: not again
    flagged = _record(second, 5)
    flagged.flags = ["iteration_time_beyond_bound"]
    pred.observe(flagged, second)  # a flagged record predicts nothing
    pred.observe(_record(second, 6), None)  # keys.layout still holds layout 0: not at hand
    r.set(keys.layout, json.dumps(second.to_dict()))
    pred.observe(_record(second, 7), None)  # read from keys.layout (the shard merger's way)
    assert pred.predicted_total == 2
    got = DashboardData(r).layout_predictions("lp")
    assert set(got) == {0, 1}
    dash_s = healthy_iteration_time_s(
        first, slow.to_dict(), {5: {"p": 0.5, "state": "slow", "since": 1.0}}
    )
    assert got[0] == pytest.approx(dash_s, rel=1e-5)
    assert got[0] < slow.iteration_time_s * 0.8  # healed: faster than observed at p=0.5
    stored = json.loads(r.hget(keys.layout_predictions, "0"))
    assert stored["iteration"] == 3 and stored["at_s"] <= time.time()


def test_the_predicted_line_spans_iterations_of_every_layout():
    rows = [
        {"iteration": i, "iteration_time_s": 1.0, "layout_id": 0 if i < 10 else 1}
        for i in range(20)
    ]
    # before: only the current layout's rows had a prediction
    assert predicted_series(rows, [], 0.8, 1)[:10] == [None] * 10
    pred = predicted_series(rows, [], 0.8, 1, {0: 0.6, 1: 0.7})
    assert pred == [0.6] * 10 + [0.8] * 10  # the live prediction wins on its own layout
    # no live prediction (no record yet): the recorded one of every layout
    assert predicted_series(rows, [], None, None, {0: 0.6, 1: 0.7}) == [0.6] * 10 + [0.7] * 10
    fig = iteration_time_figure(rows, [], 0.8, 1, {0: 0.6})
    line = next(t for t in fig.data if t.name == "predicted (healthy)")
    assert None not in line.y and len(line.y) == 20

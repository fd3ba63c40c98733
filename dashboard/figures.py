"""Iteration, pipeline-timeline, failure and plan figures and table rows (pure: no Redis, no Dash).

Everything here takes plain Python data (summaries, columnar chunk dicts,
messages) and returns ``plotly.graph_objects.Figure`` objects or lists of
rows, so it is unit-testable and reused by the incident exporter.  The shared
style (colors, template, ``empty_figure``) lives here too; the device-health
figures (skew and coordinate heatmaps, heartbeat ages) are :mod:`dashboard.figures_skew`.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from datetime import UTC, datetime
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from resihp.schemas import KIND_NAMES, ChunkKind, FailureReport

KIND_COLORS = {
    "F": "#4C78A8",
    "B": "#54A24B",
    "W": "#F58518",
    "SEND": "#BAB0AC",
    "RECV": "#9D9D9D",
    "ALLREDUCE": "#B279A2",
    "TP_COMM": "#D8B5A5",
}
FAILURE_COLORS = {
    "fail_stop": "#d62728",
    "fail_slow_compute": "#ff7f0e",
    "fail_slow_comm": "#9467bd",
    "recovery": "#2ca02c",
}
PLOT_TEMPLATE = "plotly_white"
#: p_i below which a device counts as slow on the pages (the overview's "slow devices").
SLOW_P = 0.9


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def wall_end(row: dict[str, Any]) -> float:
    """When an iteration ended on the wall clock (its publish time when known)."""
    return row.get("published_s") or row["end_s"]


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(template=PLOT_TEMPLATE, xaxis_visible=False, yaxis_visible=False, height=260)
    return fig


# ---------------------------------------------------------------- overview


#: Labels of vertical lines closer than this fraction of the x span share one label: rotated
#: side by side they overlapped ("acknowledged" over "applied" a second later).
LABEL_MIN_GAP = 0.025


def _xnum(x: Any) -> float:
    return x.timestamp() if isinstance(x, datetime) else float(x)


def merge_close_labels(
    marks: list[tuple[Any, str, str, str | None]], span: tuple[Any, Any] | None
) -> list[tuple[Any, str, str, str | None]]:
    """``marks`` with each run of labels closer than ``LABEL_MIN_GAP`` of ``span`` joined
    into the run's first label ("acknowledged / applied"); the lines themselves all stay."""
    labelled = sorted((i for i, m in enumerate(marks) if m[3]), key=lambda i: _xnum(marks[i][0]))
    if span is None or len(labelled) < 2:
        return marks
    width = abs(_xnum(span[1]) - _xnum(span[0]))
    if width <= 0:
        return marks
    out = list(marks)
    head = labelled[0]
    for i in labelled[1:]:
        if (_xnum(marks[i][0]) - _xnum(marks[head][0])) / width < LABEL_MIN_GAP:
            x, color, dash, label = out[head]
            out[head] = (x, color, dash, f"{label} / {marks[i][3]}")
            out[i] = (*marks[i][:3], None)
        else:
            head = i
    return out


#: What a graph shows from the page's first paint until its callback answers: an empty
#: panel for seconds read as "no data" (the overview and skew heatmaps on first view).
LOADING_TEXT = "loading: reading the job from Redis (a job that has not reported yet says so)"


def loading_figure() -> go.Figure:
    return empty_figure(LOADING_TEXT)


def _vertical_lines(
    fig: go.Figure,
    marks: list[tuple[Any, str, str, str | None]],
    span: tuple[Any, Any] | None = None,
) -> None:
    """Full-height lines at x (with an optional rotated label), set in one layout update:
    ``add_vline`` per line re-validates the whole layout each time, which costs seconds
    once a job has a hundred failures on a page refreshed every second.  ``span``: the x
    axis's extent, to join labels that would overlap (:func:`merge_close_labels`)."""
    shapes, notes = [], []
    for x, color, dash, label in merge_close_labels(marks, span):
        shapes.append(
            {
                "type": "line",
                "xref": "x",
                "yref": "paper",
                "x0": x,
                "x1": x,
                "y0": 0,
                "y1": 1,
                "line": {"color": color, "dash": dash, "width": 1},
            }
        )
        if label:
            notes.append(
                {
                    "x": x,
                    "xref": "x",
                    "y": 1,
                    "yref": "paper",
                    "text": label,
                    "textangle": -90,
                    "showarrow": False,
                    "font": {"size": 10},
                    "xanchor": "left",
                    "yanchor": "top",
                }
            )
    if shapes:
        fig.update_layout(shapes=shapes, annotations=notes or None)


#: A wall-clock gap between two iterations longer than STALL_FACTOR times the median gap
#: and than STALL_MIN_S is a stall, drawn as a break in the throughput line.
STALL_FACTOR = 5.0
STALL_MIN_S = 10.0


def stall_breaks(ends_s: list[float]) -> list[int]:
    """Indices ``i`` where the job stood still between iterations ``i - 1`` and ``i``.

    The median gap is the job's own pace (one slow iteration does not move it); the
    floor keeps a pause of a few seconds in a fast job (a checkpoint, a replan) a line."""
    if len(ends_s) < 3:
        return []
    gaps = np.diff(np.asarray(ends_s, dtype=float))
    usual = float(np.median(gaps[gaps > 0])) if (gaps > 0).any() else 0.0
    limit = max(STALL_FACTOR * usual, STALL_MIN_S)
    return (np.flatnonzero(gaps > limit) + 1).tolist()


def throughput_figure(
    rows: list[dict[str, Any]],
    failures: list[FailureReport] = (),
    phases: list[tuple[str, float]] = (),
    title: str = "Throughput",
    stopped: tuple[float, float] | None = None,
) -> go.Figure:
    """samples/s over wall time; failures and recovery phases as vertical markers.

    ``stopped``: (since_s, now_s) of a job that makes no progress (hung or stalled), drawn
    as a zero-rate segment up to now: without it the line ended at the last iteration's
    rate, which read as the job still training at that rate."""
    if not rows:
        return empty_figure("waiting for the first iteration")
    ends = [wall_end(r) for r in rows]
    # A hang (a dead device, no plan yet) publishes nothing: joined across it, the line
    # would ramp smoothly from the last rate before it to the first after it.
    breaks = stall_breaks(ends)
    fig = go.Figure(
        go.Scatter(
            x=_gapped([_ts(t) for t in ends], breaks),
            y=_gapped([r["samples_per_s"] for r in rows], breaks),
            mode="lines",
            name="samples/s",
            line={"color": "#4C78A8"},
            customdata=_gapped([r["iteration"] for r in rows], breaks),
            hovertemplate="iteration %{customdata}<br>%{y:.2f} samples/s<extra></extra>",
        )
    )
    # the failure lines' colors need a key: one legend entry per kind shown
    kinds = sorted({f.kind for f in failures})
    for kind in kinds:
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="lines",
                name=f"{kind} reported",
                line={"color": FAILURE_COLORS.get(kind, "black"), "dash": "dot", "width": 1},
                hoverinfo="skip",
            )
        )
    if stopped is not None and stopped[1] > stopped[0]:
        since_s, now_s = stopped
        fig.add_trace(
            go.Scatter(
                x=[_ts(since_s), _ts(now_s)],
                y=[0.0, 0.0],
                mode="lines",
                name="no progress",
                line={"color": "#E45756", "dash": "dot", "width": 3},
                hovertemplate=f"no iteration since {_ts(since_s).strftime('%H:%M:%S')}"
                f" ({now_s - since_s:.0f} s)<extra></extra>",
            )
        )
    marks = [
        (_ts(f.detected_at_s), FAILURE_COLORS.get(f.kind, "black"), "dot", None) for f in failures
    ]
    marks += [(_ts(t), "#555", "dash", name) for name, t in phases]
    xs = [m[0] for m in marks] + [_ts(ends[0]), _ts(ends[-1])]
    _vertical_lines(fig, marks, (min(xs), max(xs)))
    fig.update_layout(
        template=PLOT_TEMPLATE,
        title=title,
        height=300,
        margin={"l": 50, "r": 20, "t": 40, "b": 60 if kinds or stopped else 40},
        yaxis_title="samples/s",
        showlegend=bool(kinds) or stopped is not None,
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


#: Evidence keys holding the predicted healthy iteration time, most specific first.
PREDICTED_KEYS = ("predicted_healthy_s", "predicted_s", "predicted_iteration_time_s")
OBSERVED_KEYS = ("observed_s", "observed_iteration_time_s", "observed_at_change_s")


def evidence_number(ev: dict[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` in ``ev`` that holds a finite number."""
    for k in keys:
        v = ev.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def predicted_series(
    rows: list[dict[str, Any]],
    failures: list[FailureReport] = (),
    healthy_predicted_s: float | None = None,
    healthy_layout_id: int | None = None,
    by_layout: dict[int, float] | None = None,
) -> list[float | None]:
    """Predicted healthy iteration time per row.

    Priority: the record's own ``predicted_iteration_time_s``; else the latest failure
    evidence (``PREDICTED_KEYS``) reported at or before that iteration, on rows of the
    layout it was reported under; else the DAG prediction for the current layout
    (``healthy_predicted_s``) on rows of that layout (``healthy_layout_id``; None: any
    row); else the prediction the collector recorded for the row's layout
    (``by_layout``, ``keys.layout_predictions``); else None. Evidence used to stand for
    every later row, however many plans had changed the layout since: the gauge and the
    chart showed a past layout's prediction.
    """
    by_layout = by_layout or {}
    evid = sorted(
        (f.iteration, v)
        for f in failures
        if (v := evidence_number(f.evidence, *PREDICTED_KEYS)) is not None
    )
    out: list[float | None] = []
    j, current, current_layout = 0, None, None
    for r in rows:
        lid = r.get("layout_id")
        while j < len(evid) and evid[j][0] <= r["iteration"]:
            current, current_layout = evid[j][1], lid
            j += 1
        own = r.get("predicted_iteration_time_s")
        if own:
            out.append(own)
        elif current is not None and lid == current_layout:
            out.append(current)
        elif healthy_predicted_s is not None and (
            healthy_layout_id is None or lid == healthy_layout_id
        ):
            out.append(healthy_predicted_s)
        else:
            out.append(by_layout.get(lid) if isinstance(lid, int) else None)
    return out


def change_points(failures: list[FailureReport]) -> list[int]:
    """Iterations at which the detector located a change point (evidence["change_point"])."""
    out = set()
    for f in failures:
        cp = f.evidence.get("change_point")
        if isinstance(cp, int | float) and not isinstance(cp, bool):
            out.add(int(cp))
        elif isinstance(cp, dict) and isinstance(cp.get("iteration"), int | float):
            out.add(int(cp["iteration"]))
    return sorted(out)


def _gapped(values: list, breaks: list[int]) -> list:
    """``values`` with a None before each index in ``breaks`` (plotly breaks the line)."""
    if not breaks:
        return list(values)
    out, cut = [], set(breaks)
    for i, v in enumerate(values):
        if i in cut:
            out.append(None)
        out.append(v)
    return out


def iteration_time_figure(
    rows: list[dict[str, Any]],
    failures: list[FailureReport] = (),
    healthy_predicted_s: float | None = None,
    healthy_layout_id: int | None = None,
    by_layout: dict[int, float] | None = None,
) -> go.Figure:
    """Observed vs predicted iteration time, change points and failures marked;
    ``by_layout``: each layout's recorded healthy time (see :func:`predicted_series`)."""
    if not rows:
        return empty_figure("waiting for the first iteration")
    its = [r["iteration"] for r in rows]
    # A trainer restarted from a checkpoint repeats iteration numbers: break the lines
    # there (no zig-zag back across the chart) and mark where the new run starts.
    restarts = [i for i in range(1, len(its)) if its[i] <= its[i - 1]]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=_gapped(its, restarts),
            y=_gapped([r["iteration_time_s"] for r in rows], restarts),
            mode="lines+markers" if len(rows) < 200 else "lines",
            name="observed",
            line={"color": "#4C78A8"},
            marker={"size": 4},
        )
    )
    pred = predicted_series(rows, failures, healthy_predicted_s, healthy_layout_id, by_layout)
    if any(p is not None for p in pred):
        fig.add_trace(
            go.Scatter(
                x=_gapped(its, restarts),
                y=_gapped(pred, restarts),
                mode="lines",
                name="predicted (healthy)",
                line={"color": "#54A24B", "dash": "dash", "shape": "hv"},
                connectgaps=False,
            )
        )
    lo, hi = min(its), max(its)
    _vertical_lines(
        fig,
        [(cp, "#e45756", "dash", None) for cp in change_points(failures) if lo <= cp <= hi]
        + [(its[i], "#888", "dot", f"run restarted at {its[i]}") for i in restarts],
        (lo, hi),
    )
    shown = [f for f in failures if lo <= f.iteration <= hi]
    if shown:
        by_it = {r["iteration"]: r["iteration_time_s"] for r in rows}
        fig.add_trace(
            go.Scatter(
                x=[f.iteration for f in shown],
                y=[by_it.get(f.iteration, max(by_it.values())) for f in shown],
                mode="markers",
                name="failure",
                marker={
                    "symbol": "x",
                    "size": 12,
                    "color": [FAILURE_COLORS.get(f.kind, "black") for f in shown],
                },
                text=[f"{f.kind} ranks {f.ranks[:8]} ({f.report_id})" for f in shown],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    fig.add_trace(  # legend entry for the change-point lines
        go.Scatter(
            x=[None],
            y=[None],
            mode="lines",
            name="change point",
            line={"color": "#e45756", "dash": "dash"},
        )
    )
    fig.update_layout(
        template=PLOT_TEMPLATE,
        title="Iteration time: observed vs DAG-predicted healthy",
        height=320,
        margin={"l": 50, "r": 20, "t": 40, "b": 40},
        xaxis_title="iteration",
        yaxis_title="seconds",
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


# ---------------------------------------------------------------- pipeline timeline


def _kind_name(k: Any) -> str:
    if isinstance(k, str):
        return k
    try:
        return ChunkKind(int(k)).name
    except ValueError:
        return str(k)


def _kind_names(kinds: list) -> np.ndarray:
    """Kind column as names (the collector writes names; packed rows use codes)."""
    arr = np.asarray(kinds, dtype=object)
    if arr.size and isinstance(arr[0], str) and all(isinstance(k, str) for k in arr[:64]):
        return arr
    try:
        codes = np.asarray(kinds, dtype=np.int64)
        if codes.size and (codes.min() < 0 or codes.max() >= len(KIND_NAMES)):
            raise ValueError
        return KIND_NAMES[codes]
    except (TypeError, ValueError):
        return np.asarray([_kind_name(k) for k in kinds], dtype=object)


def normalize_chunks(cols: dict[str, list] | None) -> dict[str, np.ndarray]:
    """Columnar chunks -> numpy columns; accepts ``duration_s`` or ``end_s``; kind as name."""
    if not cols or len(cols.get("stage", ())) == 0:  # columns: lists, or arrays from Redis
        return {}
    n = len(cols["stage"])
    start = np.asarray(cols.get("start_s", [0.0] * n), dtype=float)
    if "duration_s" in cols:
        dur = np.asarray(cols["duration_s"], dtype=float)
    else:
        dur = np.asarray(cols["end_s"], dtype=float) - start
    dp = np.asarray(cols.get("dp", [0] * n), dtype=int)
    src = np.asarray(cols.get("src_dp", [-1] * n), dtype=int)
    src = np.where(src < 0, dp, src)
    return {
        "dp": dp,
        "stage": np.asarray(cols["stage"], dtype=int),
        "src_dp": src,
        "microbatch": np.asarray(cols.get("microbatch", [0] * n), dtype=int),
        "kind": _kind_names(cols.get("kind", ["F"] * n)),
        "direction": np.asarray(cols.get("direction", [0] * n), dtype=int),
        "start_s": start,
        "duration_s": dur,
    }


def bubble_ratios(
    cols: dict[str, list] | dict[str, np.ndarray] | None,
) -> dict[tuple[int, int], float]:
    """(dp, stage) -> fraction of the iteration span the stage spends idle (no compute chunk).

    The span is the whole pipeline's (first chunk start to last chunk end), so a
    stage waiting on a slow neighbour shows the bubble the slowdown causes.
    """
    c = normalize_chunks(cols)  # idempotent; record columns from Redis are small int types
    if not c:
        return {}
    compute = np.isin(c["kind"], ["F", "B", "W"])
    t0 = float(c["start_s"].min())
    t1 = float((c["start_s"] + c["duration_s"]).max())
    span = t1 - t0
    out: dict[tuple[int, int], float] = {}
    if span <= 0:
        return out
    # One bincount over (dp, stage) keys: a 16k-GPU iteration has 2k devices x 100k+ chunks.
    pp = int(c["stage"].max()) + 1
    key = c["dp"] * pp + c["stage"]
    busy = np.bincount(key[compute], weights=c["duration_s"][compute], minlength=key.max() + 1)
    for k in np.unique(key).tolist():
        out[(k // pp, k % pp)] = max(0.0, 1.0 - float(busy[k]) / span)
    return out


def stage_bubble_ratios(cols) -> dict[int, float]:
    """stage -> mean bubble ratio over the DP replicas."""
    per = bubble_ratios(cols)
    acc: dict[int, list[float]] = defaultdict(list)
    for (_d, s), v in per.items():
        acc[s].append(v)
    return {s: float(np.mean(v)) for s, v in sorted(acc.items())}


#: Suffix naming what a P2P chunk carries, by its direction (timeline and Perfetto).
FLOW_LABELS = {1: " act", -1: " grad"}


#: Labels smaller than this (px) are hidden rather than shrunk into an unreadable smear.
TIMELINE_TEXT_MIN_PX = 8


def timeline_label_mask(c: dict[str, np.ndarray], keep: np.ndarray) -> np.ndarray:
    """Which chunks of ``keep`` carry their label: on each (dp, stage) row no two labelled
    chunks overlap in time, so no two labels are drawn over each other (bars overlay:
    a migrated chunk running beside its host's own chunks shared their space, and their
    labels were drawn on top of one another).  Migrated chunks choose first (their label
    says where the micro-batch came from), then the rest, earliest first."""
    show = np.zeros(len(c["dp"]), dtype=bool)
    idx = np.flatnonzero(keep)
    if not idx.size:
        return show
    start = c["start_s"][idx]
    end = start + np.maximum(c["duration_s"][idx], 0.0)
    migrated = (c["src_dp"] != c["dp"])[idx]
    order = np.lexsort((start, ~migrated, c["stage"][idx], c["dp"][idx]))
    # per row: the labelled intervals, disjoint, as sorted starts and their ends
    taken: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
    for j in order:
        starts, ends = taken.setdefault((int(c["dp"][idx[j]]), int(c["stage"][idx[j]])), ([], []))
        lo, hi = float(start[j]), float(end[j])
        k = bisect.bisect_right(starts, lo)
        if (k and ends[k - 1] > lo) or (k < len(starts) and starts[k] < hi):
            continue
        starts.insert(k, lo)
        ends.insert(k, hi)
        show[idx[j]] = True
    return show


def _timeline_traces(c: dict[str, np.ndarray], t0: float, dps: list[int], row_label) -> list:
    """One bar trace per (kind, migrated?): uniform styling per trace keeps big figures cheap."""
    traces = []
    keep = np.isin(c["dp"], dps)
    migrated_all = c["src_dp"] != c["dp"]
    labelled = timeline_label_mask(c, keep)
    labels: dict[tuple[int, int], str] = {}
    # P2P chunks are split by what they carry: a middle stage receives both a
    # micro-batch's activation and its gradient
    flows = [
        (k, d) for k in KIND_COLORS for d in ((1, -1, 0) if k in ("SEND", "RECV") else (None,))
    ]
    present = set(c["kind"][keep].tolist())
    for kind, flow in [(k, d) for k, d in flows if k in present]:
        label = kind + FLOW_LABELS.get(flow, "")
        for mg in (False, True):
            m = keep & (c["kind"] == kind) & (migrated_all == mg)
            if flow is not None:
                m &= c["direction"] == flow
            if not m.any():
                continue
            ys = [
                labels[(d, s)] if (d, s) in labels else labels.setdefault((d, s), row_label(d, s))
                for d, s in zip(c["dp"][m].tolist(), c["stage"][m].tolist(), strict=True)
            ]
            text = c["microbatch"][m].astype(str).astype(object)
            marker: dict[str, Any] = {
                "color": KIND_COLORS[kind],
                "line": {"color": "rgba(0,0,0,0.25)", "width": 0.5},
            }
            if mg:
                marker["line"] = {"color": "#d62728", "width": 2.5}
                marker["pattern"] = {"shape": "/"}
                text = text + "←dp" + c["src_dp"][m].astype(str).astype(object)
            text = np.where(labelled[m], text, "")
            traces.append(
                go.Bar(
                    orientation="h",
                    base=(c["start_s"][m] - t0) * 1000,
                    x=c["duration_s"][m] * 1000,
                    y=np.asarray(ys, dtype=object),
                    name=f"{label} (migrated)" if mg else label,
                    legendgroup=kind,
                    marker=marker,
                    text=text,
                    textposition="inside",
                    insidetextanchor="middle",
                    customdata=np.stack(
                        [c["microbatch"][m], c["src_dp"][m], c["duration_s"][m] * 1000], axis=-1
                    ),
                    hovertemplate=(
                        f"{label} mb %{{customdata[0]}} (owner dp%{{customdata[1]}})<br>"
                        "start %{base:.2f} ms, %{customdata[2]:.2f} ms<extra>%{y}</extra>"
                    ),
                )
            )
    return traces


def timeline_figure(
    observed: dict[str, list] | None,
    predicted: dict[str, list] | None = None,
    dps: list[int] | None = None,
    title: str = "Pipeline timeline",
    max_replicas: int = 4,
) -> go.Figure:
    """Gantt of chunks per (DP replica, stage): observed above predicted, bubbles as gaps.

    Migrated micro-batches (``src_dp != dp``) get a red outline and hatching.
    Row labels carry each stage's bubble ratio.  At most ``max_replicas`` DP
    replicas are drawn (``dps`` chooses which).
    """
    obs = normalize_chunks(observed)
    pred = normalize_chunks(predicted)
    if not obs and not pred:
        return empty_figure("no chunk timings for this iteration")
    ref = obs or pred
    all_dps = sorted(set(ref["dp"].tolist()))
    dps = [d for d in (dps or all_dps) if d in all_dps][:max_replicas] or all_dps[:max_replicas]
    panels = [("observed", obs)] + ([("predicted", pred)] if pred else [])
    fig = make_subplots(
        rows=len(panels),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=[name for name, _ in panels],
    )
    n_rows = 0
    for i, (_name, c) in enumerate(panels, start=1):
        if not c:
            continue
        bub = bubble_ratios(c)
        t0 = float(c["start_s"].min())

        def label(d, s, bub=bub):
            return f"dp{d} s{s} ({bub.get((d, s), 0.0) * 100:.0f}% bubble)"

        for tr in _timeline_traces(c, t0, dps, label):
            tr.showlegend = i == 1
            fig.add_trace(tr, row=i, col=1)
        stages = sorted(set(c["stage"].tolist()))
        order = [label(d, s) for d in dps for s in stages]
        fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], row=i, col=1)
        n_rows += len(order)
    fig.update_layout(
        template=PLOT_TEMPLATE,
        barmode="overlay",
        title=title,
        height=max(300, 120 + 26 * n_rows),
        margin={"l": 200, "r": 20, "t": 60, "b": 40},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0},
        bargap=0.15,
        # a label that does not fit its bar at a readable size is hidden, not shrunk
        uniformtext={"minsize": TIMELINE_TEXT_MIN_PX, "mode": "hide"},
    )
    fig.update_xaxes(title_text="ms since iteration start", row=len(panels), col=1)
    return fig


# ---------------------------------------------------------------- failures (recurrence)


def recurring_culprits(
    failures: list[FailureReport], devices_per_node: int, top_k: int = 10
) -> list[dict[str, Any]]:
    """Ranks blamed most often by failure reports (recoveries excluded), most frequent first."""
    count: Counter[int] = Counter()
    kinds: dict[int, set[str]] = defaultdict(set)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for f in failures:
        if f.kind == "recovery":
            continue
        for r in set(f.ranks):
            count[r] += 1
            kinds[r].add(f.kind)
            first[r] = min(first.get(r, f.detected_at_s), f.detected_at_s)
            last[r] = max(last.get(r, f.detected_at_s), f.detected_at_s)
    return [
        {
            "rank": r,
            "node": r // devices_per_node,
            "reports": n,
            "kinds": ", ".join(sorted(kinds[r])),
            "first": _ts(first[r]).strftime("%H:%M:%S"),
            "last": _ts(last[r]).strftime("%H:%M:%S"),
        }
        for r, n in count.most_common(top_k)
    ]


def recurrence_figure(failures: list[FailureReport], devices_per_node: int) -> go.Figure:
    """Blamed ranks over time: a rank that keeps reappearing forms a horizontal line."""
    pts = [(f, r) for f in failures if f.kind != "recovery" for r in f.ranks[:64]]
    if not pts:
        return empty_figure("no failures reported")
    fig = go.Figure()
    for kind in sorted({f.kind for f, _ in pts}):
        sel = [(f, r) for f, r in pts if f.kind == kind]
        fig.add_trace(
            go.Scatter(
                x=[_ts(f.detected_at_s) for f, _ in sel],
                y=[r for _, r in sel],
                mode="markers",
                name=kind,
                marker={"color": FAILURE_COLORS.get(kind, "black"), "size": 9},
                text=[f"rank {r} (node {r // devices_per_node}) {f.report_id}" for f, r in sel],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    fig.update_layout(
        template=PLOT_TEMPLATE,
        title="Culprits over time (same rank on a line = recurring)",
        height=280,
        margin={"l": 50, "r": 20, "t": 50, "b": 40},
        yaxis_title="rank",
        # ranks are whole numbers: no 3.5 tick, whatever the span
        yaxis={"tickformat": "d", "rangemode": "tozero"},
        xaxis={"tickformat": "%H:%M:%S"},
    )
    ranks = [r for _, r in pts]
    lo, hi = min(ranks), max(ranks)
    if hi - lo <= 10:
        # few ranks: a tick per rank, with a rank of room either side
        fig.update_yaxes(dtick=1, tick0=0, range=[max(lo - 1, 0) - 0.5, hi + 1.5])
    times = [f.detected_at_s for f, _ in pts]
    t_lo, t_hi = min(times), max(times)
    if t_hi - t_lo < _MIN_SPAN_S:
        # one report (or a burst): plotly would zoom to a millisecond around it
        pad = (_MIN_SPAN_S - (t_hi - t_lo)) / 2
        fig.update_xaxes(range=[_ts(t_lo - pad), _ts(t_hi + pad)])
    return fig


#: The narrowest time range "culprits over time" shows (seconds).
_MIN_SPAN_S = 120.0


# ---------------------------------------------------------------- failures


def failure_rows(failures: list[FailureReport], devices_per_node: int) -> list[dict[str, Any]]:
    out = []
    for f in failures:
        nodes = f.nodes or sorted({r // devices_per_node for r in f.ranks})
        sev = min(f.severity.values()) if f.severity else None
        out.append(
            {
                "report_id": f.report_id,
                "time": _ts(f.detected_at_s).strftime("%Y-%m-%d %H:%M:%S"),
                "detected_at_s": f.detected_at_s,
                "kind": f.kind,
                "ranks": ", ".join(map(str, f.ranks[:16])) + (" ..." if len(f.ranks) > 16 else ""),
                "nodes": ", ".join(map(str, nodes[:16])) + (" ..." if len(nodes) > 16 else ""),
                "iteration": f.iteration,
                "min_p": None if sev is None else round(sev, 3),
                "detector": f.detector_mode,
            }
        )
    return out


def filter_failures(
    failures: list[FailureReport],
    devices_per_node: int,
    kinds: list[str] | None = None,
    rank: int | None = None,
    node: int | None = None,
    since_s: float | None = None,
    until_s: float | None = None,
) -> list[FailureReport]:
    out = []
    for f in failures:
        if kinds and f.kind not in kinds:
            continue
        if rank is not None and rank not in f.ranks:
            continue
        if node is not None:
            nodes = set(f.nodes) | {r // devices_per_node for r in f.ranks}
            if node not in nodes:
                continue
        if since_s is not None and f.detected_at_s < since_s:
            continue
        if until_s is not None and f.detected_at_s > until_s:
            continue
        out.append(f)
    return out


def evidence_figure(f: FailureReport) -> go.Figure:
    """Per-rank time/predicted ratios (slowest first) or, without them, per-rank p_i
    (lowest first), beside observed vs predicted iteration time."""
    ev = f.evidence
    ratios = ev.get("rank_ratios") or ev.get("ratios") or ev.get("per_rank_ratio")
    by_ratio = isinstance(ratios, dict) and bool(ratios)
    if not by_ratio:
        ratios = f.severity
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.7, 0.3],
        subplot_titles=[
            "per-rank time / predicted (slowest first)" if by_ratio else "per-rank p_i",
            "iteration time",
        ],
    )
    if isinstance(ratios, dict) and ratios:
        sign = -1.0 if by_ratio else 1.0
        items = sorted(ratios.items(), key=lambda kv: sign * float(kv[1]))[:64]
        ys = [float(v) for _, v in items]
        fig.add_trace(
            go.Bar(
                x=[f"rank {k}" for k, _ in items],
                y=ys,
                marker_color="#ff7f0e",
                name="ratio",
                # a dead rank's p_i is 0: a bar of no height, so the value is written out
                text=None if by_ratio else [f"{v:.2f}" + (" dead" if v == 0 else "") for v in ys],
                textposition="outside",
            ),
            row=1,
            col=1,
        )
        if not by_ratio:
            fig.update_yaxes(range=[0, max(1.1, max(ys) * 1.1)], row=1, col=1)
    obs = evidence_number(f.evidence, *OBSERVED_KEYS)
    pred = evidence_number(f.evidence, *PREDICTED_KEYS)
    if obs is not None or pred is not None:
        fig.add_trace(
            go.Bar(
                x=["observed", "predicted"],
                y=[obs, pred],
                marker_color=["#4C78A8", "#54A24B"],
                name="time",
            ),
            row=1,
            col=2,
        )
    fig.update_layout(
        template=PLOT_TEMPLATE,
        height=280,
        showlegend=False,
        margin={"l": 50, "r": 20, "t": 40, "b": 60},
    )
    return fig


# ---------------------------------------------------------------- plans


def _tp_list(layout: dict[str, Any], stage: int) -> str:
    groups = layout.get("groups") or []
    return "/".join(str(len(st[stage])) for st in groups if stage < len(st))


def plan_diff_rows(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-stage and whole-job before/after rows; ``changed`` flags what the plan alters."""
    rows = []
    lb, la = before.get("layers") or [], after.get("layers") or []
    for s in range(max(len(lb), len(la))):
        b = lb[s] if s < len(lb) else "-"
        a = la[s] if s < len(la) else "-"
        rows.append(
            {"what": f"stage {s} layers", "before": str(b), "after": str(a), "changed": b != a}
        )
        tb, ta = _tp_list(before, s), _tp_list(after, s)
        rows.append(
            {"what": f"stage {s} TP per DP replica", "before": tb, "after": ta, "changed": tb != ta}
        )
    for key, name in (
        ("microbatches", "micro-batches per replica"),
        ("dead", "dead ranks"),
        ("standby", "standby ranks"),
    ):
        b = ", ".join(map(str, before.get(key) or [])) or "-"
        a = ", ".join(map(str, after.get(key) or [])) or "-"
        rows.append({"what": name, "before": b, "after": a, "changed": b != a})
    mig_b, mig_a = before.get("migrations") or [], after.get("migrations") or []

    def _mig(ms: list) -> str:
        txt = ", ".join(f"s{m[0]} dp{m[1]} mb{m[2]}->dp{m[3]}" for m in ms[:6])
        return f"{len(ms)}" + (f": {txt}" if txt else "") + (" ..." if len(ms) > 6 else "")

    rows.append(
        {
            "what": "migrated micro-batch stages",
            "before": _mig(mig_b),
            "after": _mig(mig_a),
            "changed": mig_b != mig_a,
        }
    )
    act_b, act_a = _active(before), _active(after)
    left, joined = sorted(act_b - act_a), sorted(act_a - act_b)
    rows.append(
        {"what": "ranks leaving work", "before": "", "after": _short(left), "changed": bool(left)}
    )
    rows.append(
        {
            "what": "ranks joining work",
            "before": "",
            "after": _short(joined),
            "changed": bool(joined),
        }
    )
    return rows


def _active(layout: dict[str, Any]) -> set[int]:
    return {r for st in layout.get("groups") or [] for g in st for r in g}


def _short(ranks: list[int], n: int = 16) -> str:
    return (", ".join(map(str, ranks[:n])) + (" ..." if len(ranks) > n else "")) or "-"


def predicted_text(v: float) -> str:
    """A plan's predicted iteration time in words: the planner writes -1 for a layout that
    cannot run (it holds a dead device)."""
    return "cannot run" if v < 0 else f"{v:.3f} s"


def plan_layers_figure(
    before: dict[str, Any], after: dict[str, Any], predicted: tuple[float, float]
) -> go.Figure:
    lb, la = before.get("layers") or [], after.get("layers") or []
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.7, 0.3],
        # two lines: on a phone-wide page the second title is wider than its column
        subplot_titles=["layers per stage", "predicted<br>iteration time (s)"],
    )
    fig.update_annotations(font_size=12)
    xs = [f"s{s}" for s in range(max(len(lb), len(la)))]
    fig.add_trace(go.Bar(x=xs, y=lb, name="before", marker_color="#9D9D9D"), row=1, col=1)
    fig.add_trace(go.Bar(x=xs, y=la, name="after", marker_color="#4C78A8"), row=1, col=1)
    # -1 is the planner's "cannot run": a bar at -1 reads as a time; no bar, and say so.
    fig.add_trace(
        go.Bar(
            x=["before", "after"],
            y=[v if v >= 0 else None for v in predicted],
            marker_color=["#9D9D9D", "#4C78A8"],
            showlegend=False,
        ),
        row=1,
        col=2,
    )
    for name, v in zip(("before", "after"), predicted, strict=True):
        if v < 0:
            fig.add_annotation(
                x=name,
                y=0,
                text="cannot run",
                showarrow=False,
                yanchor="bottom",
                textangle=-90,
                row=1,
                col=2,
            )
    fig.update_layout(
        template=PLOT_TEMPLATE,
        height=270,
        barmode="group",
        margin={"l": 40, "r": 20, "t": 50, "b": 40},
    )
    return fig

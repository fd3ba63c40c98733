"""Figure labels that overlapped: incident phase labels a second apart (dashboard and HTML
export), and failure lines on the throughput chart that had no legend."""

from __future__ import annotations

from dashboard.figures import merge_close_labels, throughput_figure
from resihp.schemas import FailureReport


def test_labels_closer_than_the_gap_share_one_label_and_every_line_stays():
    marks = [
        (100.0, "#555", "dash", "plan proposed"),
        (101.0, "#555", "dash", "acknowledged"),
        (101.5, "#555", "dash", "applied"),
        (400.0, "#555", "dash", "throughput recovered"),
        (100.5, "red", "dot", None),
    ]
    out = merge_close_labels(marks, (0.0, 1000.0))
    assert [m[0] for m in out] == [m[0] for m in marks]  # no line lost
    assert [m[3] for m in out] == [
        "plan proposed / acknowledged / applied",
        None,
        None,
        "throughput recovered",
        None,
    ]
    # far apart on a short axis: left alone
    assert merge_close_labels(marks[:2], (99.0, 102.0)) == marks[:2]


def _rows(n=40, t0=1000.0):
    return [
        {"iteration": i, "end_s": t0 + i, "samples_per_s": 32.0, "iteration_time_s": 1.0}
        for i in range(n)
    ]


def test_throughput_chart_names_its_failure_lines_and_joins_close_phase_labels():
    fails = [
        FailureReport(
            report_id="a",
            kind="fail_stop",
            ranks=[1],
            nodes=[0],
            detected_at_s=1010.0,
            iteration=10,
        ),
        FailureReport(
            report_id="b",
            kind="fail_slow_compute",
            ranks=[2],
            nodes=[0],
            detected_at_s=1020.0,
            iteration=20,
        ),
    ]
    phases = [("plan proposed", 1011.0), ("acknowledged", 1011.3), ("applied", 1030.0)]
    fig = throughput_figure(_rows(), fails, phases)
    names = [t.name for t in fig.data]
    assert "fail_stop reported" in names and "fail_slow_compute reported" in names
    assert fig.layout.showlegend is True
    texts = [a.text for a in fig.layout.annotations]
    assert texts == ["plan proposed / acknowledged", "applied"]
    assert len(fig.layout.shapes) == 5


def test_graphs_say_loading_from_first_paint_and_waiting_without_iterations():
    """The overview and skew heatmaps rendered as empty panels for ~6 s on first view."""
    from dash import dcc

    from dashboard import figures
    from dashboard.pages import overview, skew

    def graphs(node):
        if isinstance(node, dcc.Graph):
            yield node
        kids = getattr(node, "children", None)
        for k in kids if isinstance(kids, list) else [kids] if kids is not None else []:
            yield from graphs(k)

    for page in (overview, skew):
        found = list(graphs(page.layout(None)))
        assert found, page.__name__
        for g in found:
            texts = [a.text for a in g.figure.layout.annotations]
            assert texts == [figures.LOADING_TEXT], (page.__name__, g.id, texts)
    empty = throughput_figure([])
    assert [a.text for a in empty.layout.annotations] == ["waiting for the first iteration"]


def test_migrated_chunk_labels_on_the_timeline_never_overlap():
    """Bars overlay: a migrated micro-batch running beside its host's own chunks drew its
    "mb←dp" label over theirs.  No two labels of a row may share time; migrated ones win."""
    from dashboard.figures import timeline_figure

    # row dp0 s0: local F0 0-10 ms, migrated F0 from dp1 at 5-15 ms (overlaps both), local
    # F1 10-20 ms; row dp0 s1: two chunks far apart
    cols = {
        "dp": [0, 0, 0, 0, 0],
        "stage": [0, 0, 0, 1, 1],
        "src_dp": [0, 1, 0, 0, 0],
        "microbatch": [0, 0, 1, 0, 1],
        "kind": ["F", "F", "F", "F", "F"],
        "start_s": [0.000, 0.005, 0.010, 0.000, 0.050],
        "duration_s": [0.010, 0.010, 0.010, 0.010, 0.010],
    }
    fig = timeline_figure(cols)
    shown = []  # (row, start ms, end ms, text) of every label drawn
    for tr in fig.data:
        for y, b, x, t in zip(tr.y, tr.base, tr.x, tr.text, strict=True):
            if t:
                shown.append((y, b, b + x, t))
    texts = sorted(t for *_, t in shown)
    assert texts == ["0", "0←dp1", "1"], texts  # the two local chunks it covers lose theirs
    for i, (y, lo, hi, _) in enumerate(shown):
        for y2, lo2, hi2, _ in shown[i + 1 :]:
            assert y != y2 or hi <= lo2 or hi2 <= lo
    assert fig.layout.uniformtext.mode == "hide"  # too small for its bar: hidden, not shrunk

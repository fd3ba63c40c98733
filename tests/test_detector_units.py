"""Detector building blocks on synthetic series: config, online CPD, eq.-1 fit, fail-stop."""

from __future__ import annotations

import numpy as np
import pytest

from detector.changepoint import OnlineChangeDetector
from detector.config import DetectorConfig, parse_ranks
from detector.engine import Detector
from detector.failstop import FailStopTracker
from detector.predictor import ChunkPredictor, IterationView
from detector.synthetic import SyntheticJob
from resihp.schemas import LivenessEvent
from resihp.topology import Layout


# ------------------------------------------------------------------ config
def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="threshold"):
        DetectorConfig(threshold=0.9).validate()
    with pytest.raises(ValueError, match="mode"):
        DetectorConfig(mode="magic").validate()
    with pytest.raises(ValueError, match="warmup_iters"):
        DetectorConfig(warmup_iters=2).validate()
    with pytest.raises(ValueError, match="min_throughput_loss"):
        DetectorConfig(min_throughput_loss=0).validate()


def test_runtime_hash_applies_good_fields_and_names_bad_ones():
    cfg = DetectorConfig()
    new, errors = cfg.with_runtime(
        {
            b"threshold": b"1.4",
            b"cpd_penalty": b"12",
            b"disabled_ranks": b"[3, 5]",
            b"heartbeat_k": b"zero",
            b"warmup_iters": b"3",
            b"failslow_enabled": b"off",
        }
    )
    assert new.threshold == 1.4 and new.cpd_penalty == 12.0
    assert new.disabled_ranks == frozenset({3, 5})
    assert new.failslow_enabled is False
    assert new.heartbeat_k == cfg.heartbeat_k  # bad value keeps the old one
    assert any(e.startswith("heartbeat_k") for e in errors)
    assert any(e.startswith("warmup_iters") for e in errors)  # not runtime-tunable
    # out-of-range values are refused by validate(), not applied
    new2, errors2 = new.with_runtime({"threshold": "0.5"})
    assert new2.threshold == 1.4 and errors2
    assert DetectorConfig().runtime_dict()["heartbeat_k"] == "2"


def test_parse_ranks_forms():
    assert parse_ranks("1, 2,3") == frozenset({1, 2, 3})
    assert parse_ranks("[4]") == frozenset({4})
    assert parse_ranks("") == frozenset()
    with pytest.raises(ValueError):
        parse_ranks("[-1]")
    with pytest.raises(ValueError):
        parse_ranks("a,b")


def test_runtime_values_take_ascii_digits_only():
    """int() and float() read non-ASCII digits: disabled_ranks=٣ switched rank 3 off."""
    for bad in ("\u0663", '["\u0663"]', "3,\u0663", "+3"):
        with pytest.raises(ValueError, match="not a rank"):
            parse_ranks(bad)
    cfg = DetectorConfig()
    new, errors = cfg.with_runtime(
        {"disabled_ranks": "\u0663", "threshold": "\u0661.\u0665", "heartbeat_k": "\u0663"}
    )
    assert new == cfg and len(errors) == 3, errors
    assert parse_ranks(" 3 , 4") == frozenset({3, 4}) and parse_ranks('["5"]') == {5}


def test_runtime_errors_name_the_field_once():
    _, errors = DetectorConfig().with_runtime({"threshold": "-1", "heartbeat_k": "5000"})
    assert errors == [
        "threshold: must be in (1, 10] (got -1.0)",
        "heartbeat_k: must be <= 1000 (got 5000)",
    ]
    with pytest.raises(ValueError, match=r"^detector config field 'threshold': must be in"):
        DetectorConfig(threshold=0.5)


K_INPUTS = [
    *("1", "2", " 7 ", "007", "1000", "1001", "5000", "0", "-1", "-0", "", "abc", "1.0"),
    *("+5", "1_0", "\u0663", "\uff15", "2\n", "9" * 5000, b"3", b"\xff", "1e3", "0x10"),
]


@pytest.mark.parametrize("raw", K_INPUTS, ids=range(len(K_INPUTS)))
def test_the_collector_follows_exactly_the_heartbeat_k_the_detector_accepts(raw):
    """The collector acts on K, the detector validates it: K=5000 was refused by the
    detector (and `config show` said K=2 was applied) while the collector followed it,
    and a dead rank went unreported for minutes. The two services cannot import each
    other, so each keeps the rule; this holds them equal."""
    from collector.config import MAX_HEARTBEAT_K, parse_heartbeat_k
    from detector.config import MAX_HEARTBEAT_K as DETECTOR_MAX

    assert MAX_HEARTBEAT_K == DETECTOR_MAX
    new, errors = DetectorConfig().with_runtime({b"heartbeat_k": raw})
    try:
        k = parse_heartbeat_k(raw)
    except ValueError:
        k = None
    assert (k is None) == bool(errors), (k, errors)
    if k is not None:
        assert k == new.heartbeat_k


def test_the_collector_refuses_a_heartbeat_k_flag_the_detector_would_refuse():
    from collector.config import CollectorConfig

    with pytest.raises(ValueError, match="heartbeat_k: must be an integer <= 1000"):
        CollectorConfig(heartbeat_k=5000)
    assert CollectorConfig(heartbeat_k=1000).heartbeat_k == 1000


# -------------------------------------------------------------------- CPD
def _run(det: OnlineChangeDetector, xs, min_shift=0.0):
    hits = []
    for i, x in enumerate(xs):
        cp = det.push(i, float(x), min_shift)
        if cp is not None:
            hits.append(cp)
            det.rebase(cp.iteration, center=cp.mean_after)
    return hits


def test_cpd_finds_a_persistent_step_quickly():
    rng = np.random.default_rng(0)
    xs = np.r_[rng.normal(0, 1, 100), rng.normal(5, 1, 30)]
    det = OnlineChangeDetector(window=48, penalty=8.0, min_after=2)
    det.set_baseline(0.0, 1.0)
    hits = _run(det, xs, min_shift=2.0)
    assert hits, "a 5-sigma step must be found"
    assert 100 <= hits[0].iteration <= 101
    assert hits[0].n_after <= 4  # confirmed within a few points of the step
    assert hits[0].direction == 1 and hits[0].mean_after > 4


def test_cpd_ignores_noise_and_single_spikes():
    rng = np.random.default_rng(1)
    xs = rng.normal(0, 1, 400)
    xs[[50, 170, 300]] += 12.0  # isolated spikes
    det = OnlineChangeDetector(window=48, penalty=8.0, min_after=2)
    det.set_baseline(0.0, 1.0)
    assert _run(det, xs, min_shift=2.0) == []
    # ruptures only ran when the screen alarmed, not on every point
    assert det.segment_calls_total < 60


def test_cpd_drop_removes_points():
    det = OnlineChangeDetector(window=16)
    for i in range(10):
        det.push(i, 0.0)
    det.drop([3, 4, 5])
    assert list(det.iters) == [0, 1, 2, 6, 7, 8, 9]


# -------------------------------------------------------------- predictor
def test_alpha_beta_fit_recovers_eq1_and_predicts_microbatches():
    lay = Layout.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    job = SyntheticJob(lay, seed=3, noise=0.01)
    pred = ChunkPredictor(forget=1.0)
    views = [IterationView.from_record(job.next_record()) for _ in range(30)]
    for v in views[:20]:
        pred.observe(v)
    errs = []
    for v in views[20:]:
        p = pred.predict_compute(v)
        m = v.compute_mask()
        errs.append(np.abs(p[m] - v.duration_s[m]) / v.duration_s[m])
    mape = float(np.mean(np.concatenate(errs)))
    assert mape < 0.02, mape
    # F chunk: alpha*N + beta*sum l^2 with the generator's constants
    a, b = pred.coef[(0, 0)]
    assert a * 8192 / 1e4 == pytest.approx(2e-6 * 8192, rel=0.05)
    assert b / 1e8 == pytest.approx(2e-10, rel=0.1)


def test_iteration_prediction_tracks_workload():
    lay = Layout.uniform(tp=1, pp=4, dp=2, num_layers=8, num_microbatches=8)
    job = SyntheticJob(lay, seed=4, mean_doc=3000)
    det = Detector(DetectorConfig(warmup_iters=15), layout=lay)
    recs = [job.next_record() for _ in range(60)]
    for r in recs[:40]:
        det.handle(r)
    errs = []
    times = []
    for r in recs[40:]:
        v = IterationView.from_record(r)
        p = det.failslow.predicted_iteration_time(v)
        errs.append(abs(p - r.iteration_time_s) / r.iteration_time_s)
        times.append(r.iteration_time_s)
        det.handle(r)
    # workload swings the iteration time by far more than the prediction error
    assert np.std(times) / np.mean(times) > 0.03
    assert float(np.mean(errs)) < 0.02


def test_view_takes_the_stated_p2p_direction_and_infers_only_the_rest():
    from resihp.schemas import IterationRecord

    # stage 1 of 3 receives micro-batch 0 twice, with no compute chunk to time
    # them against: only a stated direction can tell them apart
    def rec(direction):
        ch = {
            "dp": [0, 0, 0],
            "stage": [1, 1, 2],
            "src_dp": [-1, -1, -1],
            "microbatch": [0, 0, 0],
            "kind": ["RECV", "RECV", "RECV"],
            "start_s": [1.0, 5.0, 2.0],
            "duration_s": [0.1, 0.3, 0.1],
        }
        if direction is not None:
            ch["direction"] = direction
        return IterationRecord(
            iteration=3,
            iteration_time_s=6.0,
            start_s=0.0,
            end_s=6.0,
            samples=1,
            tokens=1,
            num_ranks_reporting=3,
            chunks=ch,
        )

    v = IterationView.from_record(rec([1, -1, 0]))
    assert v.direction.tolist() == [1, -1, 1]  # last one: the last stage only receives activations
    assert v.duplicates_total == 0
    old = IterationView.from_record(rec(None))  # an older record: unknown in the middle
    assert old.direction.tolist() == [0, 0, 1] and old.duplicates_total == 0
    dup = IterationView.from_record(rec([1, 1, 0]))  # same key and direction twice: a resend
    assert dup.duplicates_total == 1


# -------------------------------------------------------------- fail-stop
def _ev(state, ranks, node=0, scope="rank", t=10.0):
    return LivenessEvent(
        scope=scope,
        node=node,
        ranks=ranks,
        state=state,
        detected_at_s=t,
        last_seen_s=t - 2.0,
        missed_beats=2,
    )


def test_failstop_tracker_dedups_and_reports_rejoin():
    tr = FailStopTracker()
    v = tr.handle(_ev("dead", [3]))
    assert v.kind == "fail_stop" and v.ranks == [3] and v.nodes == [0]
    assert tr.handle(_ev("dead", [3])) is None  # duplicate delivery
    v = tr.handle(_ev("dead", [0, 1, 2, 3], scope="node"))
    assert v.ranks == [0, 1, 2]  # only the news
    assert tr.handle(_ev("alive", [5])) is None
    v = tr.handle(_ev("rejoined", [3]))
    assert v.kind == "recovery" and v.ranks == [3]
    assert 3 not in tr.dead


def test_engine_failstop_report_carries_evidence_and_health():
    det = Detector(DetectorConfig())
    reps = det.handle(_ev("dead", [8, 9], node=1, scope="node", t=100.0), now_s=100.1)
    assert len(reps) == 1
    r = reps[0]
    assert r.kind == "fail_stop" and r.ranks == [8, 9] and r.nodes == [1]
    assert r.severity == {"8": 0.0, "9": 0.0}
    assert r.evidence["decision_latency_s"] == pytest.approx(2.0)
    assert det.health[8]["state"] == "dead"
    back = det.handle(_ev("rejoined", [8], node=1, t=130.0))
    assert back[0].kind == "recovery" and back[0].severity == {"8": 1.0}
    assert det.health[8]["state"] == "healthy"


def test_cpd_finds_a_shift_with_no_old_regime_left_in_its_window():
    # right after a rebase the window holds only the new regime: the shift is
    # measured against the baseline instead of a cut inside the window
    det = OnlineChangeDetector()
    det.set_baseline(0.0, 0.01)
    rng = np.random.default_rng(0)
    cp = None
    for i in range(20):
        cp = cp or det.push(i, 0.3 + 0.01 * rng.standard_normal(), 0.05)
    assert cp is not None and cp.iteration == 0
    assert cp.mean_before == 0.0 and cp.mean_after == pytest.approx(0.3, abs=0.01)
    # noise around the baseline alone never does
    det = OnlineChangeDetector()
    det.set_baseline(0.0, 0.01)
    assert all(det.push(i, 0.01 * rng.standard_normal(), 0.05) is None for i in range(200))


def test_peer_relative_residual_is_the_value_minus_the_median_of_its_peers():
    from detector.failslow import _peer_relative

    rng = np.random.default_rng(5)
    for n_dp in (1, 2, 3, 4, 7, 8):
        x = {(d, s): float(rng.normal()) for d in range(n_dp) for s in range(3)}
        x[(0, 1)] = x[(min(1, n_dp - 1), 1)]  # ties
        got = _peer_relative(x)
        for (d, s), val in x.items():
            peers = [v for (dd, ss), v in x.items() if ss == s and dd != d]
            want = val - float(np.median(peers)) if peers else val
            assert got[(d, s)] == pytest.approx(want, abs=1e-12)


def test_peer_relative_of_every_stage_at_once_is_the_per_stage_result():
    from detector.slowstate import _peer_relative_by_stage, _peer_relative_healthy

    rng = np.random.default_rng(4)
    for t in range(300):
        keys = [(d, s) for d in range(int(rng.integers(1, 7))) for s in range(4)]
        keys = [k for k in keys if rng.random() < 0.8]
        if t % 2:
            keys = [keys[i] for i in rng.permutation(len(keys))]  # stages in any order
        vals = np.round(rng.normal(size=len(keys)), 1 if t % 3 == 0 else 6)  # ties
        if t % 5 == 0 and len(keys):
            vals[0] = np.nan
        x = dict(zip(keys, vals.tolist(), strict=True))
        got, want = _peer_relative_healthy(x), _peer_relative_by_stage(x, set())
        assert list(got) == list(want)  # same order: the shift finder pushes in it
        assert np.array_equal(list(got.values()), list(want.values()), equal_nan=True)


def test_kind_codes_from_names_any_case_and_ints():
    from detector.predictor import _kind_codes

    assert _kind_codes(["F", "RECV", "w", "bogus", "ALLREDUCE"]).tolist() == [0, 4, 2, -1, 5]
    assert _kind_codes([0, 6, 7, -1]).tolist() == [0, 6, -1, -1]


def test_the_detectors_view_history_is_bounded_in_bytes_keeping_the_newest():
    lay = Layout.uniform(tp=1, pp=4, dp=2, num_layers=8, num_microbatches=8)
    job = SyntheticJob(lay, seed=5)
    one = IterationView.from_record(job.next_record()).nbytes
    assert one > 0
    # a budget of 10.5 views: the byte bound binds before the 48-view count does
    cfg = DetectorConfig(warmup_iters=5, view_history_mb=10.5 * one / 2**20)
    det = Detector(cfg, layout=lay)
    for _ in range(60):
        det.handle(job.next_record())
    recent = det.failslow.recent
    assert len(recent) == 10 and recent.bytes_total <= 10.5 * one
    assert recent[-1].iteration == job.iteration - 1  # the newest stays
    # never fewer than the 8 the costing stage reads, however small the budget
    det = Detector(DetectorConfig(warmup_iters=5, view_history_mb=1e-9), layout=lay)
    for _ in range(30):
        det.handle(job.next_record())
    assert len(det.failslow.recent) == 8
    with pytest.raises(ValueError, match="view_history_mb"):
        DetectorConfig(view_history_mb=0)


def test_a_view_passes_over_rows_whose_ids_are_beyond_its_bounds():
    lay = Layout.uniform(tp=1, pp=4, dp=2, num_layers=8, num_microbatches=8)
    rec = SyntheticJob(lay, seed=6).next_record()
    n = len(rec.chunks["kind"])
    rec.chunks["stage"] = list(rec.chunks["stage"])
    rec.chunks["stage"][0] = 2**31 - 1  # forged: arrays are sized by stage ids
    rec.chunks["microbatch"] = list(rec.chunks["microbatch"])
    rec.chunks["microbatch"][1] = 70_000  # would alias in the link matcher's packed key
    v = IterationView.from_record(rec)
    assert v.unusable_total == 2 and v.num_chunks <= n - 2
    assert int(v.stage.max()) < 4 and int(v.mb.max()) < 8


# ------------------------------------------------- noise, scales, what-ifs (issue 28)
def test_warmup_noise_leaves_out_an_isolated_spike_but_not_a_shift():
    from detector.slowstate import _robust

    rng = np.random.default_rng(0)
    xs = list(rng.normal(0.0, 0.015, 20))
    _, clean = _robust(xs, 0.005)
    spiked = list(xs)
    spiked[9] = 0.73  # one 2x chunk-group spike, as in a held-out warm-up
    _, sd = _robust(spiked, 0.005)
    assert sd == pytest.approx(clean, rel=0.35) and sd < 0.03, (sd, clean)
    # two adjacent outliers are a level change inside the warm-up: they count
    shifted = list(xs)
    shifted[9] = shifted[10] = 0.73
    assert _robust(shifted, 0.005)[1] > 0.1
    # a heavy-tailed series (more than 10 % of its points out) keeps its spread
    heavy = list(xs)
    for i in (2, 6, 10, 14, 18):
        heavy[i] = 0.5
    assert _robust(heavy, 0.005)[1] > 0.1


def test_one_iterations_spike_moves_a_groups_scale_at_most_rate_times_ten_percent():
    from detector.chunkfit import SCALE_STEP_MAX

    lay = Layout.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    job = SyntheticJob(lay, seed=3, noise=0.01)
    pred = ChunkPredictor(forget=1.0)
    for _ in range(20):
        v = IterationView.from_record(job.next_record())
        pred.observe(v)
        pred.update_scales(v, rate=1.0)
    before = dict(pred.scale)
    victim = lay.groups[1][0][0]
    job.rank_slow = {victim: 2.4}
    pred.update_scales(IterationView.from_record(job.next_record()), rate=0.08)
    moved = pred.scale[(1, 0)] / before[(1, 0)]
    assert 1.0 < moved <= 1.0 + 0.08 * (SCALE_STEP_MAX - 1.0) + 1e-9, moved
    assert pred.scale[(0, 0)] == pytest.approx(before[(0, 0)], rel=0.02)


def test_a_what_if_can_slow_a_stages_allreduce():
    from detector.predictor import ALLREDUCE

    lay = Layout.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    det = Detector(DetectorConfig(warmup_iters=10), layout=lay)
    job = SyntheticJob(lay, seed=5)
    recs = [job.next_record() for _ in range(12)]
    for r in recs:
        det.handle(r)
    fs = det.failslow
    for d in range(2):  # the synthetic job writes no all-reduce rows: 50 ms healthy
        for s in range(2):
            fs.pred.comm_median[(d, s, ALLREDUCE, 0)] = 0.05
    v = IterationView.from_record(recs[-1])
    base, slowed, other = fs.s.itp.critical_paths(
        lay, fs.pred, v, [None, {("allreduce", 0): 50.0}, {("allreduce", 1): 1.0}]
    )
    # stage 0's all-reduce at 2.5 s instead of 50 ms: at most 2.45 s later, and later
    assert base + 1.0 < slowed <= base + 2.45 + 1e-9, (base, slowed)
    assert other == pytest.approx(base)

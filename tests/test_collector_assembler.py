"""Iteration assembly (resihp.assembly): out-of-order, duplicates, gaps, TP max, stats."""

from __future__ import annotations

import numpy as np
import pytest

from collector.synth import iteration_rows
from resihp.assembly import IterationAssembler, KeySet, build_record
from resihp.schemas import ChunkKind, MicroBatchStats
from resihp.topology import Layout, Migration


def _layout(schedule="1f1b", tp=2, pp=2, dp=2, mb=4) -> Layout:
    return Layout.uniform(tp, pp, dp, num_layers=4, num_microbatches=mb, schedule=schedule)


def _asm(layout, **kw) -> IterationAssembler:
    a = IterationAssembler(**kw)
    a.set_layout(layout)
    return a


def _mbs(it, dp, mb, n=1024, docs=(512, 256, 256)):
    return MicroBatchStats(
        iteration=it,
        dp=dp,
        microbatch=mb,
        token_budget=n,
        num_docs=len(docs),
        sum_sq_len=float(sum(x * x for x in docs)),
        max_len=max(docs),
    )


def test_keyset_matches_a_python_set():
    rng = np.random.default_rng(1)
    ks, ref = KeySet(), set()
    for _ in range(60):
        keys = rng.integers(0, 3000, size=int(rng.integers(0, 400))).astype(np.uint64)
        mask = ks.add_new(keys)
        expect = np.zeros(len(keys), dtype=bool)
        for i, k in enumerate(keys.tolist()):
            if k not in ref:
                ref.add(k)
                expect[i] = True
        assert (mask == expect).all()
    assert len(ks) == len(ref)
    assert len(ks.runs) <= 12  # runs are merged, not accumulated


def test_out_of_order_and_duplicated_rows_give_the_clean_record():
    lay = _layout()
    rows = iteration_rows(lay, 7, t0_s=100.0, rng=np.random.default_rng(0))
    clean = build_record(7, rows, [])
    rng = np.random.default_rng(2)
    # every row once, a third of them again, all shuffled, fed in uneven slices
    messy = np.concatenate([rows, rows[rng.random(len(rows)) < 0.33]])
    messy = messy[rng.permutation(len(messy))]
    a = _asm(lay)
    dup = 0
    for lo, hi in [(0, 5), (5, 40), (40, 41), (41, len(messy))]:
        res = a.add_rows(messy[lo:hi], now_s=1.0)
        dup += res.duplicate_total
    assert dup == len(messy) - len(rows)
    (rec,) = a.poll(1.0)
    assert rec.complete
    assert rec.iteration == 7
    assert rec.iteration_time_s == pytest.approx(clean.iteration_time_s)
    cols = ("dp", "stage", "microbatch", "kind")
    assert sorted(zip(*[rec.chunks[c] for c in cols], strict=True)) == sorted(
        zip(*[clean.chunks[c] for c in cols], strict=True)
    )
    assert rec.ranks["busy_s"] == pytest.approx(clean.ranks["busy_s"])
    # a row arriving after publication is dropped, not a new iteration
    late = a.add_rows(rows[:10], now_s=2.0)
    assert late.late_total == 10 and late.accepted_total == 0
    assert a.poll(50.0) == []


def test_tp_max_iteration_time_rank_sums_and_samples():
    lay = _layout(tp=2, pp=2, dp=1, mb=2)
    rows = iteration_rows(lay, 0, t0_s=10.0, chunk_s=0.1)
    # rank 1 (TP peer of rank 0, dp 0 stage 0) is 3x slower on F of micro-batch 1
    slow = (rows["rank"] == 1) & (rows["microbatch"] == 1) & (rows["kind"] == ChunkKind.F)
    rows["end_s"][slow] = rows["start_s"][slow] + 0.3
    comm = rows[:1].copy()
    comm["kind"] = ChunkKind.SEND
    comm["start_s"], comm["end_s"], comm["compute_s"] = 5.0, 5.5, -1.0  # comm outside span
    rec = build_record(0, np.concatenate([rows, comm]), [_mbs(0, 0, 0), _mbs(0, 0, 1)])
    ch = rec.chunks
    idx = [
        i
        for i in range(len(ch["kind"]))
        if (ch["dp"][i], ch["stage"][i], ch["microbatch"][i], ch["kind"][i]) == (0, 0, 1, "F")
    ]
    assert len(idx) == 1 and ch["duration_s"][idx[0]] == pytest.approx(0.3)
    # span over compute chunks only: the early SEND does not stretch the iteration
    compute = rows["kind"] <= ChunkKind.W
    assert rec.start_s == pytest.approx(rows["start_s"][compute].min())
    assert rec.iteration_time_s == pytest.approx(
        rows["end_s"][compute].max() - rows["start_s"][compute].min()
    )
    rk = dict(zip(rec.ranks["rank"], range(len(rec.ranks["rank"])), strict=True))
    r0 = rows[rows["rank"] == 0]
    assert rec.ranks["busy_s"][rk[0]] == pytest.approx((r0["end_s"] - r0["start_s"]).sum())
    assert rec.ranks["busy_s"][rk[1]] == pytest.approx(
        rec.ranks["busy_s"][rk[0]] + 0.3 - 0.1, rel=1e-6
    )
    assert rec.ranks["compute_s"][rk[0]] == pytest.approx(r0["compute_s"].sum())
    assert rec.ranks["comm_s"][rk[0]] == pytest.approx(0.5)
    assert rec.ranks["comm_s"][rk[1]] == pytest.approx(0.0)
    assert rec.samples == 2
    assert rec.tokens == 2048
    assert rec.microbatches["sum_sq_len"] == [512.0**2 + 2 * 256.0**2] * 2
    assert rec.num_ranks_reporting == 4


def test_gap_waits_for_grace_after_every_rank_moved_on():
    lay = _layout()
    a = _asm(lay, grace_s=5.0, stale_s=100.0)
    r0 = iteration_rows(lay, 0)
    missing = (r0["rank"] == 3) & (r0["microbatch"] == 2)
    a.add_rows(r0[~missing], 0.0)
    assert a.poll(1.0) == []
    r1 = iteration_rows(lay, 1, t0_s=1.0)
    a.add_rows(r1[r1["rank"] != 5], 2.0)  # rank 5 has not started iteration 1 yet
    assert a.poll(9.0) == []
    a.add_rows(r1[r1["rank"] == 5], 10.0)  # now every rank has moved on
    (rec1,) = a.poll(10.0)  # iteration 1 is complete at once
    assert (rec1.iteration, rec1.complete) == (1, True)
    assert a.poll(14.9) == []
    (rec0,) = a.poll(15.0)
    assert (rec0.iteration, rec0.complete) == (0, False)
    assert rec0.num_ranks_reporting == 8
    busy = dict(zip(rec0.ranks["rank"], rec0.ranks["busy_s"], strict=True))
    assert busy[3] < busy[2]  # its TP peer reported micro-batch 2, rank 3 did not


def test_stale_iteration_is_published_incomplete():
    lay = _layout()
    a = _asm(lay, grace_s=1.0, stale_s=20.0)
    r0 = iteration_rows(lay, 4)
    a.add_rows(r0[r0["rank"] != 6], 0.0)  # rank 6 died: nobody moves on
    assert a.poll(19.0) == []
    (rec,) = a.poll(20.5)
    assert (rec.iteration, rec.complete, rec.num_ranks_reporting) == (4, False, 7)


def test_too_many_open_iterations_force_out_the_oldest():
    lay = _layout()
    a = _asm(lay, max_open=2, stale_s=1e9, grace_s=1e9)
    for it in range(4):
        r = iteration_rows(lay, it)
        a.add_rows(r[r["rank"] != 0], float(it))
    out = a.poll(5.0)
    assert [(r.iteration, r.complete) for r in out] == [(0, False), (1, False)]
    assert sorted(a.open) == [2, 3]


def test_backlog_whose_stats_run_ahead_of_its_rows_is_published_whole():
    # After a Redis outage the producer's round puts the stats of every buffered
    # iteration (38-59) in its first entry, with the rows of 38 to part of 49; the
    # rows of the rest of 49 to 59 come in the next entry, a few ms later.
    lay = _layout()
    a = _asm(lay, max_open=8)  # the collector's default
    its = range(38, 60)
    rows = np.concatenate([iteration_rows(lay, it, t0_s=float(it)) for it in its])
    cut = int(np.flatnonzero(rows["iteration"] == 49)[10])
    for it in its:
        for dp in range(lay.dp):
            for mb in range(4):
                assert a.add_mb_stats(_mbs(it, dp, mb), 100.0)
    res = a.add_rows(rows[:cut], 100.0)
    out = a.poll(100.0)
    res2 = a.add_rows(rows[cut:], 100.002)
    out += a.poll(100.002)
    assert res.late_total == res2.late_total == 0
    assert res.accepted_total + res2.accepted_total == len(rows)
    assert [(r.iteration, r.complete) for r in out] == [(it, True) for it in its]
    assert all(r.tokens == 8 * 1024 for r in out)
    assert a.open == {}


def test_stats_alone_are_held_up_to_a_hard_cap_furthest_ahead_given_up_first():
    lay = _layout()
    a = _asm(lay, max_open=2, max_stats_only=4, stale_s=1e9, grace_s=1e9)
    bogus = 2**40
    for k in range(100):  # a flood of absurd iteration numbers
        a.add_mb_stats(_mbs(bogus + k, 0, 0), 0.0)
    assert len(a.open) == 4
    # real iterations come before the bogus ones and push them out
    for it in range(6):
        assert a.add_mb_stats(_mbs(it, 0, 0), 1.0) == (it < 4)
    assert sorted(a.open) == [0, 1, 2, 3]
    assert a.mbstats_dropped_total == 96 + 4 + 2
    # given up on, not published: their rows still make a (stats-less) record
    a.add_rows(iteration_rows(lay, 5), 2.0)
    a.add_rows(iteration_rows(lay, 0), 2.0)
    out = a.poll(2.0)
    assert [(r.iteration, r.complete, r.tokens) for r in out] == [(0, True, 1024), (5, True, 0)]
    # iterations with rows still obey max_open; those with stats alone do not count
    for it in (1, 2, 3):
        r = iteration_rows(lay, it)
        a.add_rows(r[r["rank"] != 0], 3.0)
    out = a.poll(3.0)
    assert [(r.iteration, r.complete) for r in out] == [(1, False)]
    assert sorted(a.open) == [2, 3]
    with pytest.raises(ValueError):
        IterationAssembler(max_stats_only=0)


def test_bad_rows_are_rejected_with_reasons():
    lay = _layout()
    a = _asm(lay)
    rows = iteration_rows(lay, 0)
    bad = rows[:4].copy()
    bad["compute_s"][0] = np.nan
    bad["end_s"][1] = bad["start_s"][1] - 1.0
    bad["microbatch"][2] = -3
    idle = rows[:2].copy()
    lay2 = _layout()
    lay2.world_size = 16  # ranks 8..15 exist but run nothing
    a.set_layout(lay2)
    idle["rank"] = [9, 12]
    res = a.add_rows(np.concatenate([bad, idle, rows[10:20]]), 0.0)
    reasons = {reason: len(r) for reason, r in res.rejected}
    assert reasons == {
        "chunk rows: field out of range or absurd timing": 3,
        "chunk rows: rank not in the layout (layout_id 0)": 2,
    }
    assert res.accepted_total == 11


def test_tp_dedup_drops_peers_and_still_completes():
    lay = _layout(tp=4, pp=2, dp=1, mb=3)
    a = _asm(lay, tp_dedup=True)
    rows = iteration_rows(lay, 0)
    res = a.add_rows(rows, 0.0)
    assert res.tp_dropped_total == int((rows["rank"] % 4 != 0).sum())
    (rec,) = a.poll(0.0)
    assert rec.complete
    assert rec.ranks["rank"] == [0, 4]


def test_zero_bubble_needs_w_chunks_and_migrations_change_expectations():
    lay = _layout(schedule="zbh1", dp=2, mb=4)
    rows = iteration_rows(lay, 0)
    a = _asm(lay)
    a.add_rows(rows[rows["kind"] != ChunkKind.W], 0.0)
    assert a.poll(0.0) == []
    a.add_rows(rows[rows["kind"] == ChunkKind.W], 0.1)
    assert [r.complete for r in a.poll(0.1)] == [True]

    # replica 0 stage 1 hands micro-batch 3 to replica 1
    lay.migrations = [Migration(stage=1, src_dp=0, microbatch=3, dst_dp=1)]
    lay.validate()
    a = _asm(lay)
    rows = iteration_rows(_layout(schedule="zbh1", dp=2, mb=4), 1)
    gone = (rows["dp"] == 0) & (rows["stage"] == 1) & (rows["microbatch"] == 3)
    moved = rows[gone].copy()
    moved["dp"] = 1
    moved["src_dp"] = 0
    moved["rank"] += 2  # same TP index in replica 1's stage-1 group
    a.add_rows(rows[~gone], 0.0)
    assert a.poll(0.0) == []  # replica 1 stage 1 still owes the migrated micro-batch
    a.add_rows(moved, 0.5)
    (rec,) = a.poll(0.5)
    assert rec.complete
    assert rec.samples == 8
    assert 0 in rec.chunks["src_dp"]


def test_mb_stats_dedupe_and_late_stats_refused():
    lay = _layout()
    a = _asm(lay)
    assert a.add_mb_stats(_mbs(0, 0, 0), 0.0)
    assert a.add_mb_stats(_mbs(0, 0, 0), 0.0)  # another rank sends the same micro-batch
    assert a.add_mb_stats(_mbs(0, 1, 2, docs=(1024,)), 0.0)
    a.add_rows(iteration_rows(lay, 0), 0.0)
    (rec,) = a.poll(0.0)
    assert rec.microbatches["microbatch"] == [0, 2]
    assert rec.microbatches["sum_sq_len"] == [512.0**2 + 2 * 256.0**2, 1024.0**2]
    assert rec.tokens == 2048
    assert not a.add_mb_stats(_mbs(0, 0, 1), 1.0)


def test_without_layout_records_follow_the_ranks_seen():
    lay = _layout()
    a = IterationAssembler(grace_s=1.0)
    a.add_rows(iteration_rows(lay, 0), 0.0)
    a.add_rows(iteration_rows(lay, 1), 0.5)
    assert a.poll(1.0) == []  # every rank seen has moved on: grace starts now
    assert a.poll(1.9) == []
    (rec,) = a.poll(2.0)
    assert (rec.iteration, rec.complete, rec.num_ranks_reporting) == (0, False, 8)


def _without_rank(lay: Layout, rank: int, layout_id: int) -> Layout:
    new = lay.copy()
    for d, stages in enumerate(new.groups):
        for s, grp in enumerate(stages):
            if rank in grp:
                new.groups[d][s] = [r for r in grp if r != rank][:1]
    new.dead = [rank]
    new.layout_id = layout_id
    new.validate()
    return new


def test_iteration_rerun_after_a_fail_stop_is_assembled_under_the_new_layout():
    lay = _layout()  # TP2: ranks 6 and 7 form replica 1's stage-1 group
    a = _asm(lay, stale_s=1e9, grace_s=1e9)
    a.add_rows(iteration_rows(lay, 4), 0.0)
    assert [r.iteration for r in a.poll(0.0)] == [4]
    attempt = iteration_rows(lay, 5)
    a.add_rows(attempt[attempt["start_s"] < 0.05], 1.0)  # rank 7 dies mid-iteration
    assert a.poll(5.0) == []
    # Seconds later the scheduler's new layout drops rank 7; iteration 5 is run again.
    new = _without_rank(lay, 7, layout_id=1)
    a.set_layout(new, now_s=6.0)
    (abandoned,) = a.poll(6.0)
    assert (abandoned.iteration, abandoned.complete, abandoned.layout_id) == (5, False, 0)
    rerun = iteration_rows(new, 5, t0_s=10.0)
    a.add_rows(rerun, 10.5)
    (rec,) = a.poll(10.5)
    assert (rec.iteration, rec.complete, rec.layout_id) == (5, True, 1)
    assert 7 not in rec.ranks["rank"]
    assert rec.start_s == pytest.approx(10.0)  # the re-run only, not the abandoned attempt
    # A complete iteration is never reopened.
    assert a.add_rows(rerun[:5], 11.0).late_total == 5


def test_layout_change_between_iterations_keeps_an_iteration_in_progress():
    lay = _layout()
    a = _asm(lay, stale_s=1e9, grace_s=1e9)
    new = lay.copy()
    new.layout_id = 3
    rows = iteration_rows(new, 8)
    a.add_rows(rows[: len(rows) // 2], 20.0)
    a.set_layout(new, now_s=20.2)  # rows arrived 0.2 s ago: still running
    assert a.poll(20.2) == []
    a.add_rows(rows[len(rows) // 2 :], 20.5)
    (rec,) = a.poll(20.5)
    assert (rec.iteration, rec.complete, rec.layout_id) == (8, True, 3)


def _reference_fresh(batches):
    seen, out = set(), []
    for b in batches:
        keys = list(
            zip(
                *(b[c].tolist() for c in ("rank", "stage", "microbatch", "kind", "src_dp")),
                strict=True,
            )
        )
        mask = []
        for k in keys:
            mask.append(k not in seen)
            seen.add(k)
        out.append(np.array(mask))
    return out, seen


def test_dense_and_sparse_dedup_agree_with_a_python_set():
    lay = _layout(tp=2, pp=2, dp=2, mb=4)
    lay.migrations = [Migration(stage=1, src_dp=0, microbatch=3, dst_dp=1)]
    lay.validate()
    rng = np.random.default_rng(7)
    base = iteration_rows(_layout(tp=2, pp=2, dp=2, mb=4), 2)
    odd = base[:40].copy()
    odd["src_dp"] = rng.integers(-1, 2, size=40)  # migrated rows: sparse path
    odd["microbatch"][:10] += 4  # beyond the dense range: sparse path
    pool = np.concatenate([base, odd])
    batches = [pool[rng.integers(0, len(pool), size=int(rng.integers(1, 60)))] for _ in range(40)]
    expect, keys = _reference_fresh(batches)
    for with_layout in (True, False):
        a = IterationAssembler()
        if with_layout:
            a.set_layout(lay)
        got = 0
        for b, e in zip(batches, expect, strict=True):
            res = a.add_rows(b, 0.0)
            assert res.accepted_total == int(e.sum())
            got += res.accepted_total
        assert got == len(keys)


def test_duplicates_across_a_layout_change_are_still_duplicates():
    lay = _layout()
    a = _asm(lay, stall_s=100.0)
    rows = iteration_rows(lay, 0)
    first = rows[: len(rows) // 2]
    assert a.add_rows(first, 0.0).accepted_total == len(first)
    new = lay.copy()
    new.layout_id = 9  # same ranks, new layout id: the dense index is rebuilt
    a.set_layout(new, now_s=0.5)
    res = a.add_rows(np.concatenate([first, rows[len(rows) // 2 :]]), 0.6)
    assert res.duplicate_total == len(first)
    assert res.accepted_total == len(rows) - len(first)
    (rec,) = a.poll(0.6)
    assert rec.complete and rec.layout_id == 9


def test_tp_reduction_matches_a_python_reference(monkeypatch):
    import resihp.assembly as asm

    lay = _layout(tp=4, pp=2, dp=3, mb=5)
    rows = iteration_rows(lay, 1, rng=np.random.default_rng(3))
    moved = rows[rows["microbatch"] == 4].copy()
    moved["src_dp"] = (moved["dp"] + 1) % 3  # as if migrated here from another replica
    rows = np.concatenate([rows, moved])
    rows["end_s"] += np.random.default_rng(4).random(len(rows)) * 0.01
    ref: dict[tuple, tuple[float, float]] = {}
    for r in rows:
        key = (
            int(r["dp"]),
            int(r["stage"]),
            int(r["src_dp"]),
            int(r["microbatch"]),
            int(r["kind"]),
        )
        d, s0 = float(r["end_s"] - r["start_s"]), float(r["start_s"])
        old = ref.get(key, (-1.0, float("inf")))
        ref[key] = (max(old[0], d), min(old[1], s0))

    def as_dict(rec):
        ch = rec.chunks
        names = [k.name for k in ChunkKind]
        return {
            (
                ch["dp"][i],
                ch["stage"][i],
                ch["src_dp"][i],
                ch["microbatch"][i],
                names.index(ch["kind"][i]),
            ): (
                ch["duration_s"][i],
                ch["start_s"][i],
            )
            for i in range(len(ch["kind"]))
        }

    for grid_max in (asm._GRID_MAX, 0):  # dense grid + sort for migrated; sort only
        monkeypatch.setattr(asm, "_GRID_MAX", grid_max)
        got = as_dict(build_record(1, rows, []))
        assert set(got) == set(ref)
        for k, (d, s0) in ref.items():
            assert got[k][0] == pytest.approx(d, abs=1e-7)
            assert got[k][1] == s0


def test_activation_and_gradient_p2p_rows_of_a_microbatch_are_both_kept():
    # A middle stage receives each micro-batch twice: its activation from the
    # previous stage and its gradient from the next.  Same (rank, stage,
    # microbatch, kind): only the direction tells them apart.
    from trainer.sim import SimConfig, simulate_run

    cfg = SimConfig(model="llama2-7b", microbatches=6, seq_len=4096, seed=1, pp=4, dp=1)
    (step,) = simulate_run(cfg, iterations=1)
    rows = step.chunk_rows
    recv = rows["kind"] == int(ChunkKind.RECV)
    assert set(rows["direction"][recv].tolist()) == {-1, 1}
    lay = cfg.initial_layout()
    a = _asm(lay)
    res = a.add_rows(rows, 0.0)
    assert res.duplicate_total == 0 and res.accepted_total == len(rows)
    # a real resend is still a duplicate, row for row
    assert a.add_rows(rows, 0.0).duplicate_total == len(rows)
    (rec,) = a.flush()
    ch = rec.chunks
    got = {
        (s, m, d)
        for s, m, k, d in zip(
            ch["stage"], ch["microbatch"], ch["kind"], ch["direction"], strict=True
        )
        if k == "RECV"
    }
    # stage 0 only receives gradients, the last stage only activations
    want = {(s, m, d) for s in range(4) for m in range(6) for d in (1, -1)}
    want -= {(0, m, 1) for m in range(6)} | {(3, m, -1) for m in range(6)}
    assert got == want
    # the sparse path (no layout: KeySet only) agrees
    b = IterationAssembler()
    assert b.add_rows(rows, 0.0).duplicate_total == 0
    (rec_b,) = b.flush()
    assert len(rec_b.chunks["kind"]) == len(ch["kind"])


# ------------------------------------------------------------ communication rows


def _sim(comm_rows: str = "all", iterations: int = 4):
    """A simulated TP2 x PP2 x DP2 job's layout and per-iteration rows, in the order
    the simulator sends them: compute, then RECV, then ALLREDUCE."""
    from trainer.sim import SimConfig, simulate_run

    cfg = SimConfig(
        model="llama2-7b",
        microbatches=4,
        seq_len=1024,
        seed=1,
        tp=2,
        pp=2,
        dp=2,
        comm_rows=comm_rows,
    )
    return cfg.initial_layout(), [s.chunk_rows for s in simulate_run(cfg, iterations=iterations)]


def _is_comm(rows: np.ndarray) -> np.ndarray:
    return rows["kind"] > ChunkKind.W


def _chunk_set(rec) -> list[tuple]:
    cols = ("dp", "stage", "src_dp", "microbatch", "kind", "direction")
    return sorted(zip(*[rec.chunks[c] for c in cols], strict=True))


def test_comm_rows_after_the_compute_rows_are_in_the_record_from_the_second_iteration():
    lay, steps = _sim()
    a = _asm(lay, comm_wait_s=1.0, grace_s=1e9, stale_s=1e9)
    recs, late = [], []
    for k, rows in enumerate(steps):
        t = 10.0 * k
        comm = _is_comm(rows)
        assert comm.any() and set(rows["kind"][comm].tolist()) == {4, 5}  # RECV, ALLREDUCE
        late.append(a.add_rows(rows[~comm], t).late_total)
        got = a.poll(t)
        if k == 0:
            # nothing learned yet: published as soon as the compute chunks are in
            assert [(r.iteration, r.complete) for r in got] == [(0, True)]
        else:
            assert got == []  # waiting for the communication rows the last one had
        # the comm rows come a moment later (a resent round of the first one too)
        late[-1] += a.add_rows(rows[comm], t + 0.01).late_total
        if k == 0:
            late[-1] += a.add_rows(rows[comm], t + 0.02).late_total
        got += a.poll(t + 0.02)
        assert [(r.iteration, r.complete) for r in got] == [(k, True)]
        recs += got
    n_comm = int(_is_comm(steps[0]).sum())
    assert late == [2 * n_comm, 0, 0, 0]
    # every record after the first holds the whole iteration, comm_s included
    first = build_record(0, steps[0][~_is_comm(steps[0])], [])
    assert _chunk_set(recs[0]) == _chunk_set(first)
    for rec, rows in zip(recs[1:], steps[1:], strict=True):
        whole = build_record(rec.iteration, rows, [])
        assert _chunk_set(rec) == _chunk_set(whole)
        assert rec.ranks["comm_s"] == pytest.approx(whole.ranks["comm_s"])
        assert min(rec.ranks["comm_s"]) > 0
    assert a.open == {}


def test_a_rank_that_stops_sending_a_comm_row_delays_one_record_by_comm_wait_s():
    lay, steps = _sim(iterations=3)
    a = _asm(lay, comm_wait_s=1.0, grace_s=0.2, stale_s=1e9)
    a.add_rows(steps[0], 0.0)
    assert [(r.iteration, r.complete) for r in a.poll(0.0)] == [(0, True)]
    # from iteration 1 on, rank 3 sends no ALLREDUCE row
    silent = [(s["rank"] == 3) & (s["kind"] == ChunkKind.ALLREDUCE) for s in steps]
    assert all(int(m.sum()) == 1 for m in silent)
    a.add_rows(steps[1][~silent[1]], 10.0)
    assert a.poll(10.0) == []
    # every rank moves on to iteration 2 (compute rows only so far): the grace of 0.2 s
    # does not turn a compute-complete iteration incomplete
    r2 = steps[2][~silent[2]]
    a.add_rows(r2[~_is_comm(r2)], 10.1)
    assert a.poll(10.5) == []
    assert a.poll(10.99) == []
    (rec1,) = a.poll(11.0)
    assert (rec1.iteration, rec1.complete) == (1, True)
    assert len(rec1.chunks["kind"]) == len(build_record(1, steps[1][~silent[1]], []).chunks["kind"])
    # the lower count is learned: iteration 2 is not held at all
    a.add_rows(r2[_is_comm(r2)], 11.05)
    (rec2,) = a.poll(11.05)
    assert (rec2.iteration, rec2.complete) == (2, True)
    assert _chunk_set(rec2) == _chunk_set(build_record(2, r2, []))


def test_a_layout_change_resets_what_comm_rows_are_expected():
    lay, steps = _sim(iterations=4)
    a = _asm(lay, comm_wait_s=5.0, grace_s=1e9, stale_s=1e9)
    for k in (0, 1):
        a.add_rows(steps[k], float(k))
        assert [r.iteration for r in a.poll(float(k))] == [k]
    # the same layout again (a re-read) keeps what was learned ...
    a.set_layout(lay.copy(), now_s=1.5)
    r2 = steps[2]
    a.add_rows(r2[~_is_comm(r2)], 2.0)
    assert a.poll(2.0) == []
    a.add_rows(r2[_is_comm(r2)], 2.01)
    assert [r.iteration for r in a.poll(2.01)] == [2]
    # ... a new one forgets it: its first iteration is published at compute-complete
    new = lay.copy()
    new.layout_id = 1
    a.set_layout(new, now_s=2.5)
    rows3 = steps[3].copy()
    rows3["iteration"] = 3
    comm = _is_comm(rows3)
    a.add_rows(rows3[~comm], 3.0)
    (rec3,) = a.poll(3.0)
    assert (rec3.iteration, rec3.complete, rec3.layout_id) == (3, True, 1)
    # its comm rows, late, teach the next iteration under the new layout
    assert a.add_rows(rows3[comm], 3.01).late_total == int(comm.sum())
    rows4 = steps[3].copy()
    rows4["iteration"] = 4
    a.add_rows(rows4[~comm], 4.0)
    assert a.poll(4.0) == []
    a.add_rows(rows4[comm], 4.01)
    (rec4,) = a.poll(4.01)
    assert (rec4.iteration, rec4.complete) == (4, True)
    assert _chunk_set(rec4) == _chunk_set(build_record(4, rows4, []))


@pytest.mark.parametrize("comm_rows", ["none", "allreduce"])
def test_only_the_comm_rows_a_trainer_sends_are_waited_for(comm_rows):
    lay, steps = _sim(comm_rows=comm_rows)
    a = _asm(lay, comm_wait_s=30.0, grace_s=1e9, stale_s=1e9)
    for k, rows in enumerate(steps):
        t = float(k)
        comm = _is_comm(rows)
        assert set(rows["kind"][comm].tolist()) == ({5} if comm_rows == "allreduce" else set())
        assert a.add_rows(rows[~comm], t).late_total == 0
        got = a.poll(t)
        if comm_rows == "none" or k == 0:
            # no comm row ever (or nothing learned yet): no wait at all
            assert [(r.iteration, r.complete) for r in got] == [(k, True)]
        else:
            assert got == []  # the ALLREDUCE rows, not RECV rows it never sends
            assert a.add_rows(rows[comm], t + 0.01).late_total == 0
            got = a.poll(t + 0.01)
            assert [(r.iteration, r.complete) for r in got] == [(k, True)]
            assert _chunk_set(got[0]) == _chunk_set(build_record(k, rows, []))
        if k == 0 and comm.any():
            assert a.add_rows(rows[comm], t + 0.01).late_total == int(comm.sum())
    assert a.open == {}


def test_comm_wait_never_makes_a_record_incomplete_and_zero_disables_it():
    lay, steps = _sim(iterations=3)
    # more open iterations than max_open: the oldest, only waiting for comm rows, is
    # forced out complete
    a = _asm(lay, comm_wait_s=100.0, max_open=1, grace_s=1e9, stale_s=1e9)
    a.add_rows(steps[0], 0.0)
    assert len(a.poll(0.0)) == 1
    for k in (1, 2):
        a.add_rows(steps[k][~_is_comm(steps[k])], float(k))
    out = a.poll(2.0)
    assert [(r.iteration, r.complete) for r in out] == [(1, True)]
    # a shutdown publishes what is compute-complete as complete
    assert [(r.iteration, r.complete) for r in a.flush()] == [(2, True)]
    # comm_wait_s=0: published at compute-complete, as before the wait existed
    b = _asm(lay, comm_wait_s=0.0)
    for k, rows in enumerate(steps):
        b.add_rows(rows[~_is_comm(rows)], float(k))
        assert [r.iteration for r in b.poll(float(k))] == [k]
    with pytest.raises(ValueError):
        IterationAssembler(comm_wait_s=-1.0)

"""The detector's view builder: reusing what the layout fixes gives the views a full build gives."""

from __future__ import annotations

from collections import deque
from dataclasses import fields

import numpy as np
import pytest

from detector.chunkfit import _CommHistory
from detector.commtime import comm_stats
from detector.groupstats import grouped_median, grouped_sum, grouping, kept_grouped_median
from detector.view import IterationView, ViewBuilder
from resihp.assembly import IterationAssembler
from resihp.schemas import RECORD_CHUNK_DTYPE, unpack_record_chunks
from resihp.wire import decode_entry, encode_one
from trainer.sim.config import SimConfig
from trainer.sim.core import ClusterSim


def _sim_records(n: int = 6) -> list:
    """Packed records as the detector reads them: simulator rows through the assembler."""
    cfg = SimConfig(
        model="llama2-7b", seq_len=2048, microbatches=4, tp=1, pp=4, dp=2, iterations=n, seed=3
    )
    cfg.speed = 0.0
    sim = ClusterSim(cfg, None)
    asm = IterationAssembler()
    asm.set_layout(cfg.initial_layout())
    recs = []
    while sim.iteration < n:
        st = sim.step()
        for m in st.mb_stats_messages():
            asm.add_mb_stats(m, 0.0)
        asm.add_rows(st.chunk_rows, 0.0)
        recs += asm.poll(0.0)
    recs += asm.flush()
    return [decode_entry(encode_one(r))[0][0] for r in recs]


def _same_view(a: IterationView, b: IterationView) -> None:
    for f in fields(a):
        if f.name.startswith("_"):
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, f.name
            assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), f.name
        else:
            assert x == y, f.name
    # read on first use: a planned view's from what its plan fixed, a full build's from its rows
    assert list(a.mb_stats.items()) == list(b.mb_stats.items())
    assert list(comm_stats(a).items()) == list(comm_stats(b).items())
    (ra, ia), (rb, ib) = a.compute_ids(), b.compute_ids()
    assert np.array_equal(ra, rb) and np.array_equal(ia.group_key, ib.group_key)
    for x, y in zip(ia.runs(), ib.runs(), strict=True):
        assert (x is None and y is None) or np.array_equal(x, y)


def _edited(rec, **cols):
    """A copy of ``rec`` whose chunk / micro-batch columns are replaced (``mb_<name>``)."""
    out = decode_entry(encode_one(rec))[0][0]
    for k, v in cols.items():
        if k.startswith("mb_"):
            out.microbatches = {**out.microbatches, k[3:]: v}
        else:
            out.chunks = {**out.chunks, k: v}
    return out


def test_reused_row_plans_give_the_views_a_full_build_gives():
    recs = _sim_records()
    b = ViewBuilder()
    views = [b.build(r) for r in recs]
    assert b.plans_built_total == 1 and b.plans_reused_total == len(recs) - 1
    assert any((v.kind == 4).any() for v in views)  # RECV rows: sender rows were paired
    for r, v in zip(recs, views, strict=True):
        _same_view(v, IterationView.from_record(r))
    r = recs[-1]
    ch, n = r.chunks, len(r.chunks["kind"])
    dur = ch["duration_s"].copy()
    dur[3] = np.nan  # a time the plan cannot take: built whole, row dropped
    odd_dp = ch["dp"].copy()
    odd_dp[5] = 1 - odd_dp[5]  # another row set: a new plan
    no_dir = ch["direction"].copy()
    no_dir[:] = 0  # producers that do not state P2P directions: built whole every time
    mbs = r.microbatches
    tok = list(mbs["token_budget"])
    tok[0] = -1.0  # an unusable statistics row
    dup_mb = list(mbs["microbatch"])
    dup_mb[1] = dup_mb[0]  # two rows for one micro-batch: the first usable one counts
    cases = [
        _edited(r, duration_s=dur),
        _edited(r, dp=odd_dp),
        _edited(r, direction=no_dir),
        _edited(r, mb_token_budget=tok),
        _edited(r, mb_token_budget=tok, mb_microbatch=dup_mb),
        r,
    ]
    for rec in cases:
        _same_view(b.build(rec), IterationView.from_record(rec))
    assert IterationView.from_record(cases[0]).unusable_total == 1
    assert n > 0 and b.plans_built_total > 1


def test_a_plan_is_not_reused_after_the_record_it_came_from_is_changed():
    rec = _sim_records(2)[0]
    b = ViewBuilder()
    b.build(rec)
    stage = rec.chunks["stage"]
    stage[0] = 1 - stage[0]  # the caller's array edited in place after the build
    _same_view(b.build(rec), IterationView.from_record(rec))
    assert b.plans_built_total == 2


def test_grouped_median_matches_a_sort_by_key_and_value():
    rng = np.random.default_rng(0)
    for t in range(300):
        n, g = int(rng.integers(1, 200)), int(rng.integers(1, 30))
        keys = rng.integers(0, g, n).astype(np.int64) * int(rng.integers(1, 10**6))
        vals = rng.normal(size=n)
        if t % 3 == 0:
            vals[rng.random(n) < 0.1] = np.inf
        if t % 4 == 0:
            vals[rng.random(n) < 0.1] = np.nan
        order = np.lexsort((vals, keys))
        k, x = keys[order], vals[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        ends = np.r_[starts[1:], len(k)]
        want = (x[starts + (ends - starts - 1) // 2] + x[starts + (ends - starts) // 2]) / 2
        got_k, got = grouped_median(keys, vals)
        assert np.array_equal(got_k, k[starts])
        assert np.array_equal(got, want, equal_nan=True)


def _median_by_sort(keys, vals):
    order = np.lexsort((vals, keys))
    k, x = keys[order], vals[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    ends = np.r_[starts[1:], len(k)]
    return k[starts], (x[starts + (ends - starts - 1) // 2] + x[starts + (ends - starts) // 2]) / 2


def test_grouped_reductions_reuse_a_key_column_only_while_it_is_equal():
    rng = np.random.default_rng(1)
    columns = [
        np.repeat(np.arange(64), 128),  # a layout's rows: grouped, equal groups
        rng.permutation(np.repeat(np.arange(50), 100)),
        np.sort(rng.integers(0, 300, 6000)),  # unequal groups
    ]
    for keys in columns:
        keys = keys.astype(np.int64) * 4099 + 7
        for t in range(4):  # calls after the first reuse what it derived from the keys
            if t == 3:  # the same array edited in place: same length and ends, other groups
                keys[1:-1] = keys[1:-1][::-1].copy()
            vals = rng.normal(size=len(keys))
            if t == 2:
                vals[:: len(keys) // 7] = np.nan
            got = grouped_median(keys, vals)
            want = _median_by_sort(keys, vals)
            assert np.array_equal(got[0], want[0])
            assert np.array_equal(got[1], want[1], equal_nan=True)
            uk, inv = np.unique(keys, return_inverse=True)
            sk, sums = grouped_sum(keys, vals)
            assert np.array_equal(sk, uk)
            assert np.array_equal(sums, np.bincount(inv, weights=vals), equal_nan=True)


def test_a_kept_rows_median_is_the_median_of_the_rows_kept():
    rng = np.random.default_rng(2)
    for t in range(200):
        n, g = int(rng.integers(1, 300)), int(rng.integers(1, 40))
        keys = rng.integers(0, g, n).astype(np.int64) * 977
        if t % 2:
            keys.sort()  # grouped rows (a layout's), or scattered
        vals = rng.normal(size=n)
        if t % 5 == 0:
            vals[rng.random(n) < 0.1] = np.inf
        if t % 7 == 0:
            vals[rng.random(n) < 0.05] = np.nan  # the general path
        keep = rng.random(n) < rng.uniform(0.0, 1.0)
        grp = grouping(keys)
        at, got = kept_grouped_median(grp, vals, keep)
        if not keep.any():
            assert len(at) == len(got) == 0
            continue
        want_k, want = _median_by_sort(keys[keep], vals[keep])
        assert np.array_equal(grp.distinct()[at], want_k)
        assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_comm_history_medians_are_each_keys_last_64_statistics(seed):
    rng = np.random.default_rng(seed)
    keys = [(d, s, 3, 1) for d in range(3) for s in range(4)]
    hist, ref = _CommHistory(), {}
    for it in range(150):
        stats = {k: float(rng.normal()) for k in keys if rng.random() < 0.8}  # keys come and go
        hist.add(stats)
        for k, v in stats.items():
            ref.setdefault(k, deque(maxlen=64)).append(v)
        if it == 100:
            for k in hist.drop_stages({2}):
                del ref[k]
        assert hist.keys == list(ref)
        want = [(sorted(q)[(len(q) - 1) // 2] + sorted(q)[len(q) // 2]) / 2 for q in ref.values()]
        assert hist.medians().tolist() == want


def test_decoded_kind_names_are_read_only_and_shared_while_equal():
    rows = np.zeros(5000, dtype=RECORD_CHUNK_DTYPE)
    rows["kind"] = np.arange(5000) % 3
    a = unpack_record_chunks(rows.tobytes())["kind"]
    b = unpack_record_chunks(rows.tobytes())["kind"]
    assert a is b and not a.flags.writeable and a[:3].tolist() == ["F", "B", "W"]
    with pytest.raises(ValueError):
        a[0] = "B"
    rows["kind"][0] = 1
    c = unpack_record_chunks(rows.tobytes())["kind"]
    assert c is not a and c[0] == "B" and a[0] == "F"

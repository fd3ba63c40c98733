"""Single-process parts of the torch trainer: real-document packing, per-document
attention isolation, pipeline action lists, whole-layout chunk orders with
migrations (and their deadlock check), local recovery plans, the state-move
planner (which shards go where on a layout change) and CLI validation."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch_harness import CROSS_PLANS, cross_plan

from resihp.topology import Layout, Migration
from trainer.data.corpus import IGNORE_INDEX, PackedCorpus
from trainer.torch_trainer.model import ModelConfig, StageModule
from trainer.torch_trainer.parallel import UnsupportedLayout, check_runnable
from trainer.torch_trainer.recovery import local_plan, migrate_plan, restore_plan, shrink_tp_plan
from trainer.torch_trainer.schedule import SCHEDULES, actions, find_deadlock, stage_orders
from trainer.torch_trainer.state import plan_pieces, stage_param_names

EMAIL = Path(sysconfig.get_paths()["stdlib"]) / "email"


# ------------------------------------------------------------------ corpus


def test_packing_fills_budget_with_real_document_segments():
    c = PackedCorpus(EMAIL, token_budget=300, seed=3)
    text = b"".join(p.read_bytes() for p in c.files)
    for g in range(20):
        mb = c.microbatch(g)
        assert mb.tokens.shape == (300,) and sum(mb.doc_lens) == 300
        assert mb.sum_sq_len == sum(n * n for n in mb.doc_lens) and mb.max_len == max(mb.doc_lens)
        pos = 0
        for n in mb.doc_lens:
            seg = mb.tokens[pos : pos + n]
            assert bytes(seg.astype(np.uint8)) in text  # a real piece of a real file
            assert (mb.targets[pos : pos + n - 1] == seg[1:]).all()
            assert mb.targets[pos + n - 1] == IGNORE_INDEX  # no target across documents
            pos += n
    # Several documents share a micro-batch somewhere: sum l^2 really varies.
    sq = [c.microbatch(g).sum_sq_len for g in range(20)]
    assert min(sq) < 300**2 == max(sq)


def test_packing_is_deterministic_and_indexable_out_of_order():
    a = PackedCorpus(EMAIL, token_budget=128, seed=1)
    b = PackedCorpus(EMAIL, token_budget=128, seed=1)
    in_order = [a.microbatch(g) for g in range(8)]  # a: read 0..7 in order
    late = b.microbatch(7)  # b: fresh, micro-batch 7 read first
    assert (in_order[7].tokens == late.tokens).all()
    assert (in_order[7].targets == late.targets).all()
    assert in_order[7].doc_lens == late.doc_lens
    early = b.microbatch(2)  # and going back after a later one
    assert (in_order[2].tokens == early.tokens).all() and in_order[2].doc_lens == early.doc_lens
    other = PackedCorpus(EMAIL, token_budget=128, seed=2)
    assert not (other.microbatch(0).tokens == a.microbatch(0).tokens).all()


def test_cache_eviction_repacks_identically():
    a = PackedCorpus(EMAIL, token_budget=64, seed=4, cache_window=3)
    first = [a.microbatch(g) for g in range(8)]
    assert len(a._packed) == 3
    again = a.microbatch(1)  # evicted: repacked from the start
    assert (again.tokens == first[1].tokens).all() and again.doc_lens == first[1].doc_lens
    assert a.microbatch(7).doc_lens == first[7].doc_lens


def test_variable_budgets_and_repeat():
    c = PackedCorpus(EMAIL, token_budgets=(64, 128), seed=0)
    sizes = {c.microbatch(g).token_budget for g in range(30)}
    assert sizes == {64, 128}
    r = PackedCorpus(EMAIL, token_budget=64, repeat_index=0)
    assert r.microbatch(5) is r.microbatch(0)


def test_bad_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        PackedCorpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="no files matching"):
        PackedCorpus(tmp_path)


def test_attention_is_per_document():
    """A document's outputs do not depend on the documents packed before it,
    and its RoPE positions restart at its first token."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=64)
    m = StageModule(cfg, [0, 1], first=True, last=True, dtype=torch.float64)
    doc = torch.randint(0, 256, (40,))
    a, b = torch.randint(0, 256, (25,)), torch.randint(0, 256, (60,))
    out_a = m(torch.cat([a, doc]), (25, 40))[25:]
    out_b = m(torch.cat([b, doc]), (60, 40))[60:]
    alone = m(doc, (40,))
    torch.testing.assert_close(out_a, alone)
    torch.testing.assert_close(out_b, alone)
    # one 65-token causal document is a different computation
    joined = m(torch.cat([a, doc]), (65,))[25:]
    assert not torch.allclose(joined, alone)


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zbh1"])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (4, 4), (4, 2), (3, 7)])
def test_action_lists_are_complete_and_ordered(kind, pp, m):
    for s in range(pp):
        acts = actions(kind, s, pp, m)
        kinds = ("F", "B", "W") if kind == "zbh1" else ("F", "B")
        assert sorted(acts) == sorted((k, j) for k in kinds for j in range(m))
        pos = {a: i for i, a in enumerate(acts)}
        for j in range(m):
            assert pos[("F", j)] < pos[("B", j)]
            if kind == "zbh1":
                assert pos[("B", j)] < pos[("W", j)]
        if kind != "gpipe":
            # 1F1B memory bound: never more than pp - s micro-batches in flight
            live = peak = 0
            for k, _ in acts:
                live += k == "F"
                live -= k == "B"
                peak = max(peak, live)
            assert peak <= pp - s


def test_zbh1_defers_w_on_early_stages_only():
    last = actions("zbh1", 3, 4, 6)
    assert last[:3] == [("F", 0), ("B", 0), ("W", 0)]
    first = actions("zbh1", 0, 4, 6)
    # stage 0 postpones 3 W chunks into its cool-down
    assert first[-3:] == [("W", 3), ("W", 4), ("W", 5)]
    assert actions("1f1b", 0, 4, 6) == [a for a in first if a[0] != "W"]


# ------------------------------------------------ whole-layout orders (migrations)


def legacy_orders(lay: Layout) -> dict:
    """The engine's order before the fix: own micro-batches first, migrated-in after."""
    moved = {(m.stage, m.src_dp, m.microbatch) for m in lay.migrations}
    out = {}
    for d in range(lay.dp):
        for s in range(lay.pp):
            if not lay.groups[d][s] or not lay.microbatches[d]:
                continue
            own = [(d, j) for j in range(lay.microbatches[d]) if (s, d, j) not in moved]
            foreign = sorted(
                (m.src_dp, m.microbatch) for m in lay.migrations if m.stage == s and m.dst_dp == d
            )
            tasks = own + foreign
            out[(d, s)] = [(k, *tasks[i]) for k, i in actions(lay.schedule, s, lay.pp, len(tasks))]
    return out


@pytest.mark.parametrize("name", sorted(CROSS_PLANS))
@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_cross_migration_plans_get_an_order_without_cyclic_waits(name, schedule):
    lay = cross_plan(name, schedule)
    # the old order waits in a cycle: replica 0 stage 0 needs a gradient from replica 1
    # stage 1, which needs an activation replica 0 stage 0 only sends later
    why = find_deadlock(lay, legacy_orders(lay))
    assert why and why.startswith("cyclic wait:"), why
    assert "replica 0 stage 0 waits" in why and "replica 1 stage 1 waits" in why
    orders = stage_orders(lay)
    assert find_deadlock(lay, orders) is None
    check_runnable(lay)  # accepted
    # each device keeps its own micro-batches in their schedule order
    for (d, s), order in orders.items():
        own = [(k, j) for k, e, j in order if e == d]
        ref = [a for a in actions(schedule, s, lay.pp, lay.microbatches[d]) if a in set(own)]
        assert own == ref


def test_check_runnable_refuses_an_order_that_waits_in_a_cycle(monkeypatch):
    import trainer.torch_trainer.parallel as par

    lay = cross_plan("slow-link")
    monkeypatch.setattr(par, "stage_orders", lambda layout: legacy_orders(layout))
    with pytest.raises(UnsupportedLayout, match="would hang: cyclic wait: replica 0 stage 0"):
        check_runnable(lay)


def test_find_deadlock_names_broken_orders():
    lay = Layout.uniform(1, 2, 1, num_layers=2, num_microbatches=2)
    good = stage_orders(lay)
    assert good == {(0, s): [(k, 0, j) for k, j in actions("1f1b", s, 2, 2)] for s in range(2)}
    assert find_deadlock(lay, good) is None
    swapped = {**good, (0, 1): [("B", 0, 0), ("F", 0, 0), ("F", 0, 1), ("B", 0, 1)]}
    assert "runs B of micro-batch 0 of replica 0 before its F" in find_deadlock(lay, swapped)
    short = {**good, (0, 1): good[(0, 1)][:-1]}
    assert "chunks missing [('B', 0, 1)]" in find_deadlock(lay, short)
    # stage 0 running its backwards first waits on stage 1, which waits on stage 0's forwards
    gp = {**good, (0, 0): [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]}
    gp[(0, 1)] = [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]
    assert find_deadlock(lay, gp).startswith("cyclic wait: replica 0 stage ")


def test_check_runnable_refuses_double_migrations_and_unknown_schedules():
    lay = Layout.uniform(1, 2, 2, num_layers=2, num_microbatches=2)
    twice = lay.copy()
    twice.migrations = [Migration(0, 0, 1, 1), Migration(0, 0, 1, 1)]
    with pytest.raises(UnsupportedLayout, match="migrated twice"):
        check_runnable(twice)
    inter = lay.copy()
    inter.schedule = "interleaved"
    with pytest.raises(UnsupportedLayout, match="not one this trainer runs"):
        check_runnable(inter)


@st.composite
def migrated_layouts(draw):
    """Random layouts with migrations in any direction, uneven micro-batch counts, TP
    degrees and layers, and (replica, stage)s whose every micro-batch moved away."""
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(2, 4))
    schedule = draw(st.sampled_from(SCHEDULES))
    mbs = draw(st.lists(st.integers(0, 5), min_size=dp, max_size=dp))
    hosts = [d for d in range(dp) if mbs[d]]
    if len(hosts) < 2:
        mbs[0], mbs[1] = max(mbs[0], 1), max(mbs[1], 2)
        hosts = [d for d in range(dp) if mbs[d]]
    layers = draw(st.lists(st.integers(1, 3), min_size=pp, max_size=pp))
    groups, r = [], 0
    for _ in range(dp):
        row = []
        for _ in range(pp):
            k = draw(st.sampled_from([1, 2]))
            row.append(list(range(r, r + k)))
            r += k
        groups.append(row)
    # a (replica, stage) that lost its devices: all its micro-batches run elsewhere
    empty = set()
    for s in range(pp):
        for d in hosts:
            others = [h for h in hosts if h != d and (h, s) not in empty]
            if others and draw(st.integers(0, 5)) == 0:
                empty.add((d, s))
    migs = []
    for s in range(pp):
        for e in hosts:
            dsts = [h for h in hosts if h != e and (h, s) not in empty]
            for j in range(mbs[e]):
                if (e, s) in empty:
                    migs.append(Migration(s, e, j, draw(st.sampled_from(dsts))))
                elif dsts and draw(st.booleans()):
                    migs.append(Migration(s, e, j, draw(st.sampled_from(dsts))))
    for d, s in empty:
        groups[d][s] = []
    lay = Layout(
        world_size=r,
        devices_per_node=r,
        num_layers=sum(layers),
        groups=groups,
        layers=layers,
        microbatches=mbs,
        migrations=migs,
        schedule=schedule,
    )
    lay.validate()
    return lay


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(migrated_layouts())
def test_every_migration_set_gets_deadlock_free_orders(lay):
    orders = stage_orders(lay)
    # replaying the blocking receives and non-blocking sends of every device ends, and
    # every send is received by the device that expects it
    assert find_deadlock(lay, orders) is None
    check_runnable(lay)
    moved = {(m.stage, m.src_dp, m.microbatch) for m in lay.migrations}
    touched = {m.src_dp for m in lay.migrations} | {m.dst_dp for m in lay.migrations}
    for (d, s), order in orders.items():
        own = [(k, j) for k, e, j in order if e == d]
        sched = [
            a
            for a in actions(lay.schedule, s, lay.pp, lay.microbatches[d])
            if (s, d, a[1]) not in moved
        ]
        assert own == sched  # own micro-batches keep their schedule order
        if d not in touched:
            assert order == [
                (k, d, j) for k, j in actions(lay.schedule, s, lay.pp, lay.microbatches[d])
            ]
    # the same layout always gets the same orders (every rank derives them alone)
    assert stage_orders(Layout.from_dict(lay.to_dict())) == orders


# ------------------------------------------------------------------- plans


def test_local_plan_drops_hit_replica_and_keeps_global_batch():
    lay = Layout.uniform(2, 2, 2, num_layers=4, num_microbatches=3)
    new = local_plan(lay, {5})  # rank 5 = tp1, dp0... of stage 1
    assert new.dp == 1 and new.total_microbatches == 6 and 5 in new.dead
    assert all(5 not in g for st in new.groups for g in st)
    assert set(new.standby) == {r for st in lay.groups[lay.coords()[5][0]] for r in st} - {5}


def test_local_plan_single_replica_shrinks_tp():
    lay = Layout.uniform(2, 2, 1, num_layers=4, num_microbatches=2)
    new = local_plan(lay, {1})
    assert new.groups[0] == [[0], [2, 3]]
    with pytest.raises(UnsupportedLayout):
        local_plan(Layout.uniform(1, 2, 1, num_layers=4, num_microbatches=2), {1})


def test_state_moves_reshard_tp_and_follow_layers():
    cfg = ModelConfig(hidden=32, num_layers=4, num_heads=4, ffn_hidden=64)
    old = Layout.uniform(2, 2, 2, num_layers=4, num_microbatches=2)
    # rank 1 (dp0 stage0 tp1) dies; replica 1 survives whole. New layout: replica 0's
    # stage 0 runs TP1 on rank 0 and layers move: [1, 3].
    new = old.copy()
    new.dead = [1]
    new.groups[0][0] = [0]
    new.layers = [1, 3]
    new.groups = [new.groups[0]]
    new.microbatches = [4]
    new.standby = [2, 3, 6, 7]
    new.validate()
    survivors = set(range(8)) - {1}
    pieces, counts = plan_pieces(cfg, old, new, survivors)
    assert counts["from_disk"] == 0
    # rank 0 needs the full attn.wq of layer 0 (TP1): both halves from replica 1 (ranks 2, 3)
    wq = [p for p in pieces if p.dst == 0 and p.name == "layers.0.attn.wq.weight"]
    assert sorted((p.src, p.src_lo, p.src_hi, p.dim) for p in wq) == [(2, 0, 16, 1), (3, 0, 16, 1)]
    # layer 1 moves to stage 1 (ranks 4, 5 at TP2); its only complete old holder is
    # replica 1's stage 0 (TP2 on ranks 2, 3): rank 5's half comes from rank 3 alone
    l1 = [p for p in pieces if p.dst == 5 and p.name == "layers.1.mlp.w_down.weight"]
    assert [(p.src, p.src_lo, p.src_hi, p.dim) for p in l1] == [(3, 0, 32, 2)]
    needed = {
        (r, n) for r, (d, s, _t) in new.coords().items() for n in stage_param_names(cfg, new, s)
    }
    got = {(p.dst, p.name) for p in pieces}
    assert got <= needed and counts["kept"] + len({(p.dst, p.name) for p in pieces}) == len(needed)


def test_migrate_plan_moves_lost_stage_round_robin():
    lay = Layout.uniform(1, 2, 3, num_layers=4, num_microbatches=4)
    # rank = d + 3*s: rank 4 is replica 1, stage 1
    new = migrate_plan(lay, {4})
    assert new.groups[1][1] == [] and new.groups[1][0] == [1]
    moved = sorted((m.stage, m.src_dp, m.microbatch, m.dst_dp) for m in new.migrations)
    assert moved == [(1, 1, 0, 0), (1, 1, 1, 2), (1, 1, 2, 0), (1, 1, 3, 2)]
    # a TP group that keeps a survivor cannot be migrated away: fall back to exclusion
    tp2 = Layout.uniform(2, 2, 2, num_layers=4, num_microbatches=2)
    with pytest.raises(UnsupportedLayout):
        migrate_plan(tp2, {0})
    assert local_plan(tp2, {0}, "migrate").dp == 1


def test_restore_plan_brings_back_replica_of_rejoined_ranks():
    lay = Layout.uniform(1, 2, 2, num_layers=4, num_microbatches=3)
    down = local_plan(lay, {1})
    assert down.dp == 1 and down.microbatches == [6]
    up = restore_plan(down, lay, alive={0, 1, 2, 3})
    assert up.groups == lay.groups and up.microbatches == [3, 3] and not up.dead
    still = restore_plan(down, lay, alive={0, 2, 3})  # rank 1 not back: nothing to restore
    assert still.groups == down.groups and 3 in still.standby


def test_restore_plan_fills_the_stages_migration_emptied():
    """PP2 x DP2 under the migrate policy: rank 1 (replica 1, stage 0) then rank 2
    (replica 0, stage 1) die, each replica running its lost stage on the other.  When both
    re-join, the re-join's layout kept both holes and dropped their migrations: invalid,
    and the job ended.  Each stage gets its launch group back."""
    lay = Layout.uniform(1, 2, 2, num_layers=4, num_microbatches=2)
    down = migrate_plan(migrate_plan(lay, {1}), {2})
    assert down.groups == [[[0], []], [[], [3]]] and len(down.migrations) == 4
    up = restore_plan(down, lay, alive={0, 1, 2, 3})
    assert up.groups == lay.groups and up.migrations == [] and not up.dead, up.summary()
    # only rank 1 back: its hole is filled, rank 2's still migrates
    half = restore_plan(down, lay, alive={0, 1, 3})
    assert half.groups == [[[0], []], [[1], [3]]] and half.dead == [2]
    assert {(m.stage, m.src_dp) for m in half.migrations} == {(1, 0)}


def test_shrink_tp_plan_keeps_power_of_two_survivors():
    lay = Layout.uniform(4, 1, 2, num_layers=2, num_microbatches=2)
    new = shrink_tp_plan(lay, {1})
    assert new.groups[0][0] == [0, 2] and new.standby == [3] and new.groups[1][0] == [4, 5, 6, 7]
    assert local_plan(lay, {1}, "shrink_tp").groups == new.groups


# --------------------------------------------------------------------- cli


def test_cli_rejects_bad_flags_and_scenarios(tmp_path, capsys):
    from trainer.torch_trainer import main

    assert main(["--tp", "3"]) == 2
    assert "tp must be a power of two" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "events:\n  - {at_iteration: 1, action: kill_device, rank: 0}\n"
        "  - {at_iteration: 2, action: explode, rank: 0}\n"
    )
    assert main(["--scenario", str(bad)]) == 2
    assert f"{bad}:3:" in capsys.readouterr().out  # names the bad line
    far = tmp_path / "far.yaml"
    far.write_text("events:\n  - {at_iteration: 1, action: kill_device, rank: 9}\n")
    assert main(["--pp", "2", "--scenario", str(far)]) == 2
    assert "rank 9 outside" in capsys.readouterr().out


@pytest.mark.redis
def test_idle_rank_probe_is_timed_and_sent_as_a_device_probe(r):
    from resihp.keys import JobKeys
    from resihp.producer import TelemetryProducer
    from resihp.schemas import DeviceProbe
    from resihp.wire import decode_entry
    from trainer.torch_trainer.telemetry import RankTelemetry, probe_seconds

    t = probe_seconds(torch.device("cpu"))
    assert 0 < t < 1.0
    keys = JobKeys("probe")
    prod = TelemetryProducer(None, keys, client=r).start()
    tel = RankTelemetry(prod, rank=7, node=1)
    tel.probe(10, 2 * t, t)
    assert prod.flush()
    got = []
    for _, fields in r.xrange(keys.telemetry):
        good, bad = decode_entry(fields)
        assert not bad
        got += [m for m in good if isinstance(m, DeviceProbe)]
    assert got == [DeviceProbe(rank=7, node=1, iteration=10, probe_s=2 * t, reference_s=t)]
    prod.close()


@pytest.mark.parametrize(
    "argv,why",
    [
        (["--tp", "2", "--num-heads", "6"], "hidden (64) must be divisible by num_heads (6)"),
        (["--hidden", "63"], "hidden (63) must be divisible by num_heads (4)"),
        (
            ["--hidden", "12", "--num-heads", "4"],
            "head dimension hidden/num_heads = 3 must be even",
        ),
        (["--num-heads", "0"], "num_heads must be >= 1, got 0"),
        (["--num-heads", "-4"], "num_heads must be >= 1, got -4"),
        (["--ffn-hidden", "0"], "ffn_hidden must be >= 1, got 0"),
        (["--threads-per-worker", "0"], "threads_per_worker must be >= 1, got 0"),
        (["--devices-per-node", "0"], "devices_per_node must be >= 1, got 0"),
        (["--devices-per-node", "-2"], "devices_per_node must be >= 1, got -2"),
        (["--tp", "4", "--devices-per-node", "2"], "spans nodes"),
        (["--store-timeout-s", "0"], "store_timeout_s must be a finite number > 0"),
        (["--store-timeout-s", "inf"], "store_timeout_s must be a finite number > 0"),
        (["--pg-timeout-s", "nan"], "pg_timeout_s must be a finite number > 0"),
        (["--heartbeat-interval-s", "0"], "heartbeat_interval_s must be a finite number > 0"),
        (["--heartbeat-interval-s", "-1"], "heartbeat_interval_s must be a finite number > 0"),
        (["--slow-factor", "inf", "--slow-rank", "0"], "slow_factor must be a finite number >= 1"),
        (["--slow-factor", "nan", "--slow-rank", "0"], "slow_factor must be a finite number >= 1"),
        (["--slow-factor", "0", "--slow-rank", "0"], "slow_factor must be a finite number >= 1"),
        (["--slow-factor", "3"], "slow_factor needs slow_rank"),
        (["--slow-comm-s", "-1", "--slow-comm-rank", "0"], "slow_comm_s must be a finite number"),
        (["--slow-comm-s", "inf", "--slow-comm-rank", "0"], "slow_comm_s must be a finite number"),
        (["--slow-comm-s", "0.1"], "slow_comm_s needs slow_comm_rank"),
        (["--slow-rank", "99"], "slow_rank 99 outside world of 1"),
        (["--pp", "2", "--slow-comm-rank", "99"], "slow_comm_rank 99 outside world of 2"),
        (["--kill-rank", "-5", "--kill-at-iteration", "1"], "kill_rank -5 outside world of 1"),
        (["--kill-rank", "8", "--kill-at-iteration", "1"], "kill_rank 8 outside world of 1"),
        (["--kill-at-iteration", "5"], "kill_rank and kill_at_iteration go together"),
        (["--kill-rank", "0"], "kill_rank and kill_at_iteration go together"),
        (["--kill-rank", "0", "--kill-at-iteration", "20"], "kill_at_iteration 20 is past"),
        (["--rejoin-at-iteration", "-3"], "rejoin_at_iteration must be -1 (off) or >= 0"),
        (["--slow-at-iteration", "-1"], "slow_at_iteration must be >= 0"),
        (["--repeat-microbatch", "-2"], "repeat_microbatch must be -1 (off) or >= 0"),
        (["--lr", "-0.1"], "lr must be a finite number >= 0"),
        (["--lr", "nan"], "lr must be a finite number >= 0"),
        (["--weight-decay", "-1"], "weight_decay must be a finite number >= 0"),
        (["--grad-clip-norm", "inf"], "grad_clip_norm must be a finite number >= 0"),
        (["--link-base-delay-s", "-1"], "link_base_delay_s must be a finite number >= 0"),
        (
            ["--data-dir", "/nonexistent/corpus"],
            "data_dir '/nonexistent/corpus' is not a directory",
        ),
    ],
)
def test_cli_refuses_values_a_worker_would_crash_on_or_ignore(argv, why, capsys, monkeypatch):
    import trainer.torch_trainer.launcher as launcher
    from trainer.torch_trainer import main

    def no_launch(cfg):
        raise AssertionError(f"{argv} was accepted: a job would start")

    monkeypatch.setattr(launcher, "launch", no_launch)
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: ") and why in out, out
    assert out.count("\n") <= 1


def test_cli_refusal_is_one_line_and_exit_2_from_a_process(tmp_path):
    import subprocess
    import sys

    for argv, why in [
        (["--tp", "2", "--num-heads", "6"], "must be divisible by num_heads (6)"),
        (["--devices-per-node", "0"], "devices_per_node must be >= 1"),
    ]:
        p = subprocess.run(
            [sys.executable, "-m", "trainer", "torch", *argv, "--out-dir", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert p.stdout.startswith("error: ") and why in p.stdout
        assert "Traceback" not in p.stdout + p.stderr
        assert not (tmp_path / "o").exists()  # refused before anything started

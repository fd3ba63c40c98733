"""Layout: uniform launch, heterogeneous TP, uneven layers, and refusals of impossible layouts."""

import pytest

from resihp.topology import Layout, LayoutError, Migration


def test_uniform_layout_megatron_order():
    lay = Layout.uniform(tp=4, pp=2, dp=2, num_layers=32, num_microbatches=8)
    assert lay.world_size == 16 and lay.num_nodes == 2
    assert lay.groups[0][0] == [0, 1, 2, 3] and lay.groups[1][0] == [4, 5, 6, 7]
    assert lay.groups[0][1] == [8, 9, 10, 11]
    assert lay.coords()[9] == (0, 1, 1)
    assert lay.dp_group(1) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert lay.layers == [16, 16]


def test_heterogeneous_tp_and_uneven_layers_round_trip():
    lay = Layout.uniform(tp=4, pp=3, dp=2, num_layers=12, num_microbatches=4)
    lay.groups[0][1] = [8, 9]  # TP 4 -> 2 after two failures
    lay.dead = [10, 11]
    lay.layers = [5, 2, 5]
    lay.migrations = [Migration(stage=1, src_dp=0, microbatch=3, dst_dp=1)]
    lay.validate()
    back = Layout.from_dict(lay.to_dict())
    assert back.tp_degree(0, 1) == 2 and back.tp_degree(1, 1) == 4
    assert back.layers == [5, 2, 5] and back.migrations == lay.migrations


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (lambda L: L.groups[0][0].__setitem__(slice(None), [0, 1, 2]), "power of two"),
        (lambda L: L.dead.append(0), "dead rank 0"),
        (lambda L: L.layers.__setitem__(0, 1), "sum to"),
        (lambda L: L.groups[1][0].__setitem__(0, 0), "two TP groups"),
        (lambda L: L.groups[0][0].__setitem__(slice(None), [6, 7, 8, 9]), "spans nodes"),
        (lambda L: L.groups[0].__setitem__(0, []), "not migrated"),
    ],
)
def test_impossible_layouts_are_refused(mutate, msg):
    lay = Layout.uniform(tp=4, pp=2, dp=2, num_layers=8, num_microbatches=2)
    mutate(lay)
    with pytest.raises(LayoutError, match=msg):
        lay.validate()


def test_stage_without_devices_is_valid_when_all_its_work_migrates():
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=2)
    lay.dead = list(lay.groups[0][1])
    lay.groups[0][1] = []
    lay.migrations = [Migration(1, 0, j, 1) for j in range(2)]
    lay.validate()


def test_migrations_into_a_replica_without_micro_batches_are_flagged():
    lay = Layout.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=2)
    lay.microbatches = [4, 0]
    lay.migrations = [Migration(1, 0, 3, 1)]
    lay.validate()  # the engine runs it
    assert lay.idle_host_migrations() == [Migration(1, 0, 3, 1)]
    lay.microbatches = [3, 1]
    lay.migrations = [Migration(1, 0, 2, 1)]
    assert lay.idle_host_migrations() == []


@pytest.mark.parametrize("schedule", ["bogus", "", "ZBH1", "\uff11f1b", "1F1B", "zbh"])
def test_a_layout_with_an_unknown_schedule_is_refused(schedule):
    """from_dict took any string ('bogus', '', a fullwidth digit): a ZB-H1 trace with a
    typo was predicted as 1F1B without a word."""
    d = Layout.uniform(tp=1, pp=2, dp=1, num_layers=2, num_microbatches=2).to_dict()
    d["schedule"] = schedule
    with pytest.raises(LayoutError, match=f"unknown schedule {schedule!r}: one of gpipe, 1f1b"):
        Layout.from_dict(d)


def test_the_schedules_a_layout_may_name_are_the_pipeline_engines():
    from resihp.pipeline import SCHEDULE_KINDS
    from resihp.topology import SCHEDULES

    assert SCHEDULES == SCHEDULE_KINDS
    for s in SCHEDULES:
        d = Layout.uniform(tp=1, pp=2, dp=1, num_layers=2, num_microbatches=2).to_dict()
        d["schedule"] = s
        assert Layout.from_dict(d).schedule == s

"""GradSync: the one typed value that says how a parameter's gradient is synchronised."""
import pytest

from autopar.errors import PlanError
from autopar.record.grad_sync import SUMS, ZERO2_SUMS, GradSync


def test_data_parallel_and_zero2_syncs():
    dp = GradSync.all_reduce([0, 1], 1024)
    assert dp == GradSync("all_reduce", False, (0, 1), 1024) and dp.axes == (0, 1)
    assert dp.collectives == ("all_reduce",) and dp.name == "all_reduce" and not dp.split
    for sum_by in ZERO2_SUMS:
        z = GradSync.zero2(sum_by, (1,), 64)
        assert z.split and z.collectives == (sum_by, "all_gather") and z.name == f"{sum_by}+all_gather"
    assert set(ZERO2_SUMS) == set(SUMS)
    assert dp.on((1,)) == GradSync.all_reduce((1,), 1024)


@pytest.mark.parametrize("sync", [GradSync.all_reduce((0,), 8), GradSync.zero2("all_to_all", (0, 2), 4096), None])
def test_json_round_trip(sync):
    d = None if sync is None else sync.to_json()
    assert GradSync.from_json(d) == sync


@pytest.mark.parametrize("legacy, want", [
    (["all_reduce", [0], 8], GradSync.all_reduce((0,), 8)),
    (["reduce_scatter+all_gather", [1], 8], GradSync.zero2("reduce_scatter", (1,), 8)),
    (["all_to_all+all_gather", [0, 1], 8], GradSync.zero2("all_to_all", (0, 1), 8)),
])
def test_schema_4_spellings_read(legacy, want):
    assert GradSync.from_json(legacy) == want


@pytest.mark.parametrize("args, words", [
    (("broadcast", True, (0,), 8), "gradient sync by 'broadcast'"),
    (("reduce_scatter", False, (0,), 8), "summed whole is summed by an all_reduce"),
])
def test_impossible_syncs_are_refused(args, words):
    with pytest.raises(PlanError, match=words):
        GradSync(*args)
    with pytest.raises(PlanError, match="is not one this autopar runs"):
        GradSync.from_json(["all_reduce+scatter", [0], 8])

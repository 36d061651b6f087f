"""Live pricing on 2 gloo ranks: the host's figures are measured, cached and read back, and a failure
on rank 0 reaches every rank as a typed error instead of leaving them waiting."""
import math

import pytest

from autopar.runtime.launch import spawn


def rank_main(rank, world, directory):
    import autopar
    from autopar.compose import live_profile
    from autopar.runtime.process_groups import MeshGroups

    groups = MeshGroups(autopar.Mesh((2,)))
    first = live_profile.live_overheads("cpu", groups=groups, directory=directory)
    again = live_profile.live_overheads("cpu", groups=groups, directory=directory)
    try:
        live_profile._on_rank0(lambda: 1 / 0)
        error = None
    except autopar.AutoparError as err:
        error = f"{type(err).__name__}: {err}"
    return {"first": first, "again": again, "error": error}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(rank_main, 2, args=(str(tmp_path_factory.mktemp("live")),), timeout_s=300)


def test_host_figures_are_measured_and_cached(results):
    for r in results:
        f = r["first"]
        assert f == r["again"]  # the second call read the cache
        assert f["rank_contention"] >= 1 and 0 <= f["comm_overlap"] <= 1
        for key in ("op_overhead_s", "backward_op_overhead_s", "optimizer_s_per_element", "optimizer_s_per_tensor",
                    "collective_overhead_s"):
            assert math.isfinite(f[key]) and 0 <= f[key] < 0.1, (key, f[key])
    assert results[0]["first"] == results[1]["first"]  # every rank prices with the same figures


def test_a_failure_on_rank_0_reaches_every_rank(results):
    for r in results:
        assert r["error"] is not None and r["error"].startswith("PlanError: profiling on rank 0 failed: ZeroDivisionError")

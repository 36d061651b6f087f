"""spawn: results in rank order, failures and hangs become RankError without hanging the caller;
MeshGroups checks the world size. (Ranks started by torchrun, srun or mpirun: test_world.py.)"""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from autopar.errors import ConfigError, MeshError, RankError
from autopar.runtime.launch import spawn
from autopar.runtime.process_groups import MeshGroups
from autopar.sharding_spec import Mesh


# ---- rank functions (module level, so spawn can pickle them) ------------------------------------
def report(rank, world_size, tag):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    try:
        MeshGroups(Mesh((2, 2)))
        mesh_error = None
    except MeshError as err:
        mesh_error = str(err)
    device_mesh = Mesh((world_size,), axis_names=("dp",)).to_device_mesh()
    try:
        Mesh((2, 2)).to_device_mesh()
        device_mesh_error = None
    except MeshError as err:
        device_mesh_error = str(err)
    return {
        "device_mesh": (tuple(device_mesh.mesh.tolist()), device_mesh.mesh_dim_names),
        "device_mesh_error": device_mesh_error,
        "mesh_from_torch": Mesh.from_torch(device_mesh) == Mesh((world_size,), axis_names=("dp",)),
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "sum": total.item(),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "env_rank": os.environ.get("RANK"),
        "mesh_error": mesh_error,
    }


def fail_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("boom 42 from the test")
    if rank == 0:
        dist.barrier()  # waits on rank 1, which never arrives
    time.sleep(3600)  # rank 2: hangs outside any collective


def hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def die(rank, world_size):
    os._exit(3)


def unpicklable_result(rank, world_size):
    return lambda: None


# ---- tests ------------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_results_come_back_in_rank_order_and_mesh_size_is_checked():
    results = spawn(report, 3, args=("hello",), timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, r in enumerate(results):
        assert r["world_size"] == 3 and r["tag"] == "hello" and r["sum"] == 3.0
        assert r["threads"] == 1 and r["omp"] == "1" and r["env_rank"] == str(rank)
        assert r["mesh_error"] is not None and "needs 4 ranks" in r["mesh_error"] and "has 3" in r["mesh_error"]
        assert r["device_mesh"] == ((0, 1, 2), ("dp",)) and r["mesh_from_torch"]
        assert "needs 4 ranks" in r["device_mesh_error"]


@pytest.mark.multirank
def test_a_raising_rank_is_reported_and_the_others_are_killed():
    with pytest.raises(RankError) as info:
        spawn(fail_on_rank_1, 3, timeout_s=60, grace_s=2)
    text = str(info.value)
    assert info.value.rank == 1
    assert text.startswith("rank 1 of 3 failed")
    assert "ValueError: boom 42 from the test" in text and "Traceback" in text
    assert "timed out" not in text  # ended by the failure, not by the timeout
    assert info.value.stuck == [2] and "ranks [2] were killed" in text
    assert set(info.value.failures) <= {0, 1}  # rank 0 may fail too: its peer vanished mid-barrier


@pytest.mark.multirank
def test_a_hanging_rank_times_out():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"timed out after 10s") as info:
        spawn(hang_on_rank_1, 2, timeout_s=10)
    assert 1 in info.value.stuck and not info.value.failures
    assert time.monotonic() - start < 40


@pytest.mark.multirank
def test_a_rank_that_dies_silently_is_reported():
    with pytest.raises(RankError, match=r"rank 0 died \(exit code 3\)"):
        spawn(die, 1, timeout_s=60)


@pytest.mark.multirank
def test_an_unpicklable_result_is_reported():
    with pytest.raises(RankError, match="rank 0 of 1 failed") as info:
        spawn(unpicklable_result, 1, timeout_s=60)
    assert "pickle" in str(info.value).lower()


@pytest.mark.multirank
def test_a_port_taken_meanwhile_is_retried(monkeypatch):
    from autopar.runtime import launch

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    handed_out = []

    def port():  # the taken port first, then free ones
        handed_out.append(taken.getsockname()[1] if not handed_out else real())
        return handed_out[-1]

    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", port)
    try:
        assert spawn(hang_on_rank_1, 1, timeout_s=60) == [0]
    finally:
        taken.close()
    assert len(handed_out) == 2


def test_an_unpicklable_function_is_a_config_error():
    with pytest.raises(ConfigError, match="module-level function"):
        spawn(lambda rank, world_size: rank, 2)


def test_mesh_groups_need_a_process_group():
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    with pytest.raises(MeshError, match="init_process_group"):
        MeshGroups(Mesh((2,)))

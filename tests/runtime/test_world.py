"""Ranks started by a launcher (``autopar.runtime.world``): torchrun's, SLURM's ``srun``'s and
OpenMPI's ``mpirun``'s variables read as torch's rendezvous wants them; ``autopar.init()`` starts
the group and says rank, local rank and device, so a script builds on the right device first.
Real processes with the variables srun / mpirun would set (the variables are the interface: no
scheduler needed), and a real ``mpirun`` (Debian's openmpi-bin, which ``.ci/run`` installs)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.errors import ConfigError
from autopar.runtime.launch import free_port
from autopar.runtime.world import first_host, launch_env, resolve_device, tasks_per_node

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("launched_rank.py")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def _base_env() -> dict:
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_"))}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")  # (CPU ranks, even on a GPU host)
    return base


def _launched(env_of_rank, world: int, *args: str) -> list[dict]:
    """Start ``world`` processes of launched_rank.py with the environments a launcher would give
    them, collect their JSON lines."""
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(world), *args], env={**_base_env(), **env_of_rank(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


# ---- the variables, read -------------------------------------------------------------------------
def test_srun_tasks_are_read_as_torch_rendezvous_wants_them():
    step = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "1234",
            "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu3", "SLURM_NTASKS_PER_NODE": "4(x4)"}
    assert launch_env(step) == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 1234 % 10000)}
    # 2 nodes x 2 tasks, hosts named with a suffix; the step's own node list and tasks per node
    two = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_JOB_NODELIST": "n[1-4]-ib",
           "SLURM_STEP_NODELIST": "n[1-2]-ib", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x4)"}
    env = launch_env(two)
    assert env["MASTER_ADDR"] == "n1-ib" and env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
    # each step of one job its own port: two steps of an allocation running at once do not collide
    ports = {launch_env({**two, "SLURM_STEP_ID": str(s)})["MASTER_PORT"] for s in range(8)}
    assert len(ports) == 8 and all(20000 <= int(p) < 30000 for p in ports)
    assert launch_env({**two, "MASTER_PORT": "4242"})["MASTER_PORT"] == "4242"
    # uneven nodes: this node's entry; without a list, the tasks over the nodes
    uneven = {**two, "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "2"}
    assert launch_env(uneven)["LOCAL_WORLD_SIZE"] == "1"
    bare = {k: v for k, v in two.items() if "TASKS_PER_NODE" not in k}
    assert launch_env({**bare, "SLURM_NNODES": "2"})["LOCAL_WORLD_SIZE"] == "2"
    assert "LOCAL_WORLD_SIZE" not in launch_env(bare)


def test_a_batch_script_of_several_tasks_without_srun_is_refused_at_once():
    """Inside an allocation of 4 tasks, ``python train.py`` without srun is one process that would
    wait for 3 others until the rendezvous timed out; it is told so instead."""
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "9",
             "SLURM_JOB_NODELIST": "n1"}
    with pytest.raises(ConfigError, match="not started by srun.*srun python train.py"):
        launch_env(batch)
    one = {**batch, "SLURM_NTASKS": "1"}  # an allocation of one task: this process is the job
    assert launch_env(one)["WORLD_SIZE"] == "1"
    torchrun_inside = {**batch, "RANK": "1", "WORLD_SIZE": "2"}  # torchrun's variables win
    assert launch_env(torchrun_inside)["RANK"] == "1"


def test_openmpi_and_torchrun_variables():
    ompi = launch_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                       "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "1234"})
    assert ompi == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
                    "MASTER_PORT": "1234"}
    with pytest.raises(ConfigError, match="MASTER_ADDR"):  # across nodes mpirun names no master
        launch_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    assert launch_env(torchrun) == torchrun and launch_env({}) is None


@pytest.mark.parametrize("nodes, first", [
    ("node1,node2", "node1"), ("a[1-2]", "a1"), ("gpu[07-09,12],cpu3", "gpu07"), ("n[1-2]-ib", "n1-ib"),
    ("rack[1-2]-n[03-04],x", "rack1-n03"), ("n[5,7-8]-ib,m1", "n5-ib"), ("solo", "solo"), ("", None)])
def test_the_first_host_of_a_slurm_node_list(nodes, first):
    assert first_host(nodes) == first


def test_tasks_per_node_lists_expand():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]
    assert tasks_per_node("") == [] and tasks_per_node("two") == []


def test_the_device_follows_the_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda", "nccl") == torch.device("cuda", 3)  # "cuda" without an index
    assert resolve_device("cuda:1", "nccl") == torch.device("cuda", 1)
    assert resolve_device(None, "gloo") == torch.device("cpu")
    assert resolve_device("cpu", None) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device(None, None) == torch.device("cpu")


# ---- real processes ------------------------------------------------------------------------------
def test_init_under_srun_2_nodes_x_2_tasks_starts_the_group_and_trains_exactly():
    """Four processes with the variables srun gives 2 nodes x 2 tasks ("n[1-2]-ib"; the master
    address given, as these hosts do not exist here): ``autopar.init()`` says each one's rank,
    local rank and node size and the CPU device, and they train exactly."""
    port = free_port()

    def env(r):
        return {"SLURM_PROCID": str(r), "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0",
                "SLURM_LOCALID": str(r % 2), "SLURM_NODEID": str(r // 2), "SLURM_JOB_ID": "77",
                "SLURM_STEP_NODELIST": "n[1-2]-ib", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}

    lines = _launched(env, 4, "init")
    assert [x["rank"] for x in lines] == [0, 1, 2, 3] and all(x["worst"] <= 1e-5 for x in lines), lines
    assert [x["launched"]["local_rank"] for x in lines] == [0, 1, 0, 1]
    assert all(x["launched"]["local_world_size"] == 2 and x["launched"]["world_size"] == 4 for x in lines)
    assert all(x["launched"]["device"] == "cpu" and x["launched"]["backend"] == "gloo" for x in lines)


def test_parallelize_starts_the_group_itself_from_the_launchers_variables():
    port = free_port()
    env = lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",  # noqa: E731
                     "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": str(port)}
    lines = _launched(env, 2)
    assert sorted(x["rank"] for x in lines) == [0, 1] and all(x["worst"] <= 1e-5 for x in lines), lines
    assert lines[0]["families"].get("dp", 0) > 0 and lines[0]["launched"] is None


def test_without_a_launcher_init_is_a_world_of_one_and_parallelize_says_how_to_start_ranks():
    code = ("import autopar, torch.distributed as dist\n"
            "w = autopar.init()\n"
            "print(w.rank, w.world_size, w.local_rank, w.device, w.backend, dist.get_world_size())\n"
            "print(autopar.init() == w)\n")
    run = subprocess.run([sys.executable, "-c", code], env=_base_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["0 1 0 cpu gloo 1", "True"]
    code = ("import autopar\n"
            "from autopar import models\n"
            "model, x = models.build('gpt', layers=1)\n"
            "autopar.parallelize(model, autopar.Mesh((4,)), x)\n")
    run = subprocess.run([sys.executable, "-c", code], env=_base_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "ConfigError" in run.stderr
    assert "runs inside each rank (the mesh has 4): start them with torchrun" in run.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed (.ci/run installs openmpi-bin)")
def test_a_real_mpirun_of_4_ranks_trains_exactly(tmp_path):
    env = {**_base_env(), "MASTER_PORT": str(free_port()), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    # each rank's output in a file of its own (mpirun interleaves the ranks' lines on its stdout)
    run = subprocess.run(["mpirun", "-np", "4", "--output-filename", str(tmp_path), "-x", "MASTER_PORT", "-x", "PYTHONPATH",
                          "-x", "OMP_NUM_THREADS", sys.executable, str(SCRIPT), "4", "init"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    outputs = sorted(p for p in tmp_path.rglob("stdout"))
    lines = [json.loads(f.read_text().strip().splitlines()[-1]) for f in outputs]
    assert sorted(x["rank"] for x in lines) == [0, 1, 2, 3] and all(x["worst"] <= 1e-5 for x in lines), lines
    assert sorted(x["launched"]["local_rank"] for x in lines) == [0, 1, 2, 3]
    assert all(x["launched"]["local_world_size"] == 4 for x in lines)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed (.ci/run installs openmpi-bin)")
def test_the_readme_quick_start_runs_under_mpirun(tmp_path):
    """The README's quick start as a user copies it (two steps in place of a hundred), under
    ``mpirun -np 4``: it trains and rank 0 prints the plan."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n# train.py")
    script = text[start + len("```python\n"): text.index("```", start + 3)]
    assert "autopar.init()" in script and "range(100)" in script
    (tmp_path / "train.py").write_text(script.replace("range(100)", "range(2)"))
    env = {**_base_env(), "MASTER_PORT": str(free_port()), "AUTOPAR_CACHE_DIR": str(tmp_path / "cache"),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    run = subprocess.run(["mpirun", "-np", "4", "--output-filename", str(tmp_path / "out"), "-x", "MASTER_PORT",
                          "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "AUTOPAR_CACHE_DIR",
                          sys.executable, str(tmp_path / "train.py")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    printed = [f.read_text() for f in (tmp_path / "out").rglob("stdout")]
    assert sum("plan for GPT2LMHeadModel on mesh 4" in p for p in printed) == 1, printed  # rank 0 alone


def test_mpirun_inside_a_slurm_allocation_is_read_as_mpirun():
    """Ranks mpirun starts inside an allocation inherit SLURM's variables (a batch step's: no step
    id): OpenMPI's are read first."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n1",
           "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert launch_env(env)["RANK"] == "2" and launch_env(env)["WORLD_SIZE"] == "4"


def test_jobs_whose_ids_differ_by_a_hundred_get_other_ports():
    step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n1"}
    ports = {launch_env({**step, "SLURM_JOB_ID": str(job)})["MASTER_PORT"] for job in (1200, 1300, 1400, 2200)}
    assert len(ports) == 4


def test_a_gpu_is_picked_among_those_the_process_sees(monkeypatch):
    """Four tasks on a node each bound to its own GPU (``srun --gpus-per-task=1``) see one GPU
    each: cuda:0, whatever their local rank; with all four visible, their own."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device(None, "nccl") == resolve_device("cuda", "nccl") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device(None, None) == torch.device("cuda", 3)
    assert resolve_device(None, "gloo") == torch.device("cpu")  # gloo asked for: the CPU

"""This process's place in a job: which launcher started it, its rank, and the device it computes on.

``autopar.init()`` is the first line of a training script under torchrun, SLURM's ``srun`` or
OpenMPI's ``mpirun``: it reads the launcher's variables (``launch_env``), starts the default
process group (NCCL on GPUs, gloo on CPUs) and returns a ``World`` -- rank, world size, local rank,
and the device to build the model and data on (``cuda:LOCAL_RANK`` where GPUs exist)::

    world = autopar.init()
    model = build_model().to(world.device)
    pmodel = autopar.parallelize(model, autopar.Mesh((world.world_size,)), example_inputs)

``autopar.parallelize`` calls it when the script did not. Run without a launcher, it makes a
world of one process.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re

import torch
import torch.distributed as dist

from autopar.errors import ConfigError

DEFAULT_MASTER_PORT = 29500
# srun's ranks agree on a port from the job and step ids: below the kernel's ephemeral ports
# (32768 and up), one per step of a job, so two steps of one allocation do not collide
_SLURM_PORTS = (20000, 10000)
DEFAULT_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class World:
    """What ``init`` returns: this process's rank among ``world_size``, its rank and the number of
    ranks on its node, the device it computes on and the process group's backend."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str


def init(backend: str | None = None, device=None, timeout=None) -> World:
    """Start the default process group from the launcher's variables (``launch_env``), once:
    ``backend`` (default: NCCL where the device is a GPU, else gloo), ``device`` (default:
    ``cuda:LOCAL_RANK`` where CUDA is available and the backend is not gloo, else the CPU; "cuda"
    without an index means ``cuda:LOCAL_RANK``), ``timeout`` (seconds or a timedelta) for its
    collectives. Called again, or after the script started the group itself, it starts nothing and
    says where this process stands."""
    if dist.is_initialized():
        return _world(dist.get_backend(), device)
    env = launch_env()
    if env is not None:
        os.environ.update(env)
    device = resolve_device(device, backend)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S if timeout is None else float(timeout)) \
        if not isinstance(timeout, datetime.timedelta) else timeout
    if env is None:  # no launcher: a world of this one process (no rendezvous, nothing set for children)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return _world(backend, device)


def _world(backend: str, device) -> World:
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                 int(os.environ.get("LOCAL_WORLD_SIZE", "1")), resolve_device(device, backend), backend)


def resolve_device(device, backend: str | None) -> torch.device:
    """The device this rank computes on (see ``init``): a GPU by its local rank among the GPUs this
    process sees (one GPU per task, as ``srun --gpus-per-task=1`` binds them: that one)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        return torch.device("cuda", local_rank % gpus) if gpus and backend != "gloo" else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank % gpus if gpus else local_rank)
    return device


# ---- launchers' environments ---------------------------------------------------------------------
def launch_env(environ=None) -> dict[str, str] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT of this process
    as torch's ``env://`` rendezvous reads them, from the launcher that started it: torchrun (they
    are set), OpenMPI's ``mpirun`` (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
    MASTER_ADDR from the environment, or 127.0.0.1 when every rank is on this node; read before
    SLURM's, whose variables its ranks inherit inside an allocation) or SLURM's ``srun``
    (``_slurm_env``). None when no launcher's variables are there."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        out = {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k in env}
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:  # (mpirun inside a SLURM allocation too)
        local_size = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
        one_node = local_size == env["OMPI_COMM_WORLD_SIZE"]
        if "MASTER_ADDR" not in env and not one_node:
            raise ConfigError("ranks started by mpirun across nodes need MASTER_ADDR (the first rank's host): "
                              "mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port> ...")
        out = {"RANK": env["OMPI_COMM_WORLD_RANK"], "WORLD_SIZE": env["OMPI_COMM_WORLD_SIZE"],
               "LOCAL_RANK": env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"), "LOCAL_WORLD_SIZE": local_size,
               "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
               "MASTER_PORT": env.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))}
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        out = _slurm_env(env)
    else:
        return None
    out.setdefault("LOCAL_RANK", "0")
    out.setdefault("MASTER_ADDR", "127.0.0.1")
    out.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    return out


def _slurm_env(env) -> dict[str, str]:
    """A task of an ``srun`` step: SLURM_PROCID among the step's tasks (SLURM_STEP_NUM_TASKS, else
    SLURM_NTASKS), SLURM_LOCALID among its node's (the node's entry of SLURM_STEP_TASKS_PER_NODE
    or SLURM_TASKS_PER_NODE, by SLURM_NODEID), the step's first node as the master, a port from the
    job and step ids unless MASTER_PORT is set. A batch script of several tasks not started by
    ``srun`` (no step id: only one process exists, which would wait for the others until the
    timeout) is refused at once."""
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if step is None and tasks > 1:
        raise ConfigError(f"this process runs in a SLURM allocation of {tasks} tasks but was not started by srun, "
                          "so no other rank will join it: run `srun python train.py` inside the allocation (or "
                          "torchrun / mpirun)")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    job = env.get("SLURM_JOB_ID", "0")
    if env.get("MASTER_PORT"):
        port = env["MASTER_PORT"]
    else:
        step_id = int(step) if step is not None and step.isdigit() else 0
        mixed = int(job) + 7919 * step_id if job.isdigit() else 0  # (a prime: steps of one job spread apart)
        port = str(_SLURM_PORTS[0] + mixed % _SLURM_PORTS[1])
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(tasks), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
           "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes) or "127.0.0.1", "MASTER_PORT": port}
    local = _tasks_on_node(env)
    if local is not None:
        out["LOCAL_WORLD_SIZE"] = str(local)
    return out


def _tasks_on_node(env) -> int | None:
    """This node's number of tasks: its entry (SLURM_NODEID) of SLURM_STEP_TASKS_PER_NODE or
    SLURM_TASKS_PER_NODE ("2(x3),1": 2 on each of the first three nodes, 1 on the fourth), else
    SLURM_NTASKS_PER_NODE, else the tasks over the nodes where they divide evenly."""
    node = int(env.get("SLURM_NODEID", "0") or 0)
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = tasks_per_node(env.get(key, ""))
        if counts:
            return counts[min(node, len(counts) - 1)]
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if per_node.isdigit():
        return int(per_node)
    tasks, nodes = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS"), env.get("SLURM_NNODES")
    if tasks and nodes and tasks.isdigit() and nodes.isdigit() and int(nodes) and int(tasks) % int(nodes) == 0:
        return int(tasks) // int(nodes)
    return None


def tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks-per-node list expanded: "2(x3),1" -> [2, 2, 2, 1]; [] when absent or not of that form."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if m is None:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list, each bracketed range at its first value:
    "gpu[07-09,12],cpu3" -> "gpu07", "n[1-2]-ib" -> "n1-ib", "rack[1-2]-n[3-4]" -> "rack1-n3"."""
    depth, end = 0, len(nodelist)
    for k, ch in enumerate(nodelist):  # the first entry ends at a comma outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = k
            break
    entry = nodelist[:end].strip()
    if not entry:
        return None
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], entry)

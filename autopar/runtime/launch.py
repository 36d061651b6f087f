"""Run a function on N local processes, each a rank of one process group.

For tests, the demo, and users on one machine::

    from autopar.runtime.launch import spawn

    def rank_main(rank, world_size, mesh_shape):      # module level, so it can be pickled
        mesh = autopar.Mesh(mesh_shape)
        groups = MeshGroups(mesh)                     # the process group already exists here
        ...
        return loss.item()                            # anything picklable comes back

    losses = spawn(rank_main, 4, args=((2, 2),))      # [loss of rank 0, ..., loss of rank 3]

``spawn`` starts ``world_size`` processes with the "spawn" start method, so ``fn`` and ``args`` must
be picklable (a module-level function, not a lambda or closure) and a script that calls it needs the
usual ``if __name__ == "__main__":`` guard. Each rank runs with one OpenMP/torch thread (ranks
share the machine's cores), ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``
set, and the default process group initialised over TCP on 127.0.0.1 with ``timeout_s`` as its
timeout. Return values come back in rank order.

If a rank raises, ``spawn`` raises ``RankError`` naming the rank whose failure came first, with its
traceback; the other ranks get ``grace_s`` seconds to finish or fail, then are killed, so a rank
stuck in a collective with a dead peer never hangs the caller. At ``timeout_s`` every rank still
running is killed and ``RankError("timed out after ...")`` names them.

Under torchrun, SLURM's ``srun`` or OpenMPI's ``mpirun`` there is nothing to spawn: the launcher
starts the processes, and ``autopar.init()`` (``autopar.runtime.world``; ``parallelize`` calls it
when nothing else has) initialises the default group from its environment::

    if __name__ == "__main__":
        world = autopar.init()
        rank_main(world.rank, world.world_size, (2, 2))
        dist.destroy_process_group()
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.errors import ConfigError, RankError

# Environment each rank starts with: one thread per library, since ranks share the cores.
_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
_PORT_ATTEMPTS = 3


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- inside each rank ----------------------------------------------------------------------------
def _send(conn, status: str, payload) -> None:
    conn.send_bytes(pickle.dumps((status, time.time(), payload)))


def _worker(rank: int, world_size: int, fn, args, backend: str, port: int, timeout_s: float, conn) -> None:
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as err:
        in_use = "address already in use" in str(err).lower() or "eaddrinuse" in str(err).lower()
        _send(conn, "port_in_use" if in_use else "error", traceback.format_exc())
        _die(conn)
    try:
        payload = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:
        _send(conn, "error", traceback.format_exc())
        _die(conn)
    conn.send_bytes(pickle.dumps(("ok", time.time(), payload)))
    # Keep rank 0 (the TCP store) alive until every rank is done with the group, then tear down.
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    conn.close()
    # Run atexit handlers, then skip the interpreter's teardown of torch: with several ranks on few
    # cores it takes seconds per process and does nothing a finished rank needs.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die(conn) -> None:
    """Exit now, without waiting on peers that may be stuck in a collective with this rank."""
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# ---- in the parent -----------------------------------------------------------------------------
@contextlib.contextmanager
def _thread_env():
    old = {k: os.environ.get(k) for k in _THREAD_ENV}
    os.environ.update(_THREAD_ENV)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(fn: Callable[..., Any], world_size: int, *, args: tuple = (), backend: str = "gloo",
          timeout_s: float = 120.0, grace_s: float = 3.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes, each inside the default
    process group; return their return values in rank order. See the module docstring."""
    if int(world_size) < 1:
        raise ConfigError(f"spawn needs world_size >= 1, got {world_size}")
    for _ in range(_PORT_ATTEMPTS):
        outcome = _spawn_once(fn, int(world_size), tuple(args), backend, float(timeout_s), float(grace_s))
        if outcome != "port_in_use":
            return outcome
    raise RankError(f"could not bind a free TCP port for the process group after {_PORT_ATTEMPTS} tries")


def _spawn_once(fn, world_size, args, backend, timeout_s, grace_s):
    ctx = mp.get_context("spawn")
    port = free_port()
    start = time.monotonic()
    deadline = start + timeout_s
    procs, readers = [], {}
    try:
        with _thread_env():
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, name=f"autopar-rank{rank}",
                                args=(rank, world_size, fn, args, backend, port, timeout_s, writer))
                try:
                    p.start()
                except (pickle.PicklingError, AttributeError, TypeError) as err:
                    raise ConfigError(
                        f"spawn could not send {fn!r} and its args to a new process ({err}); pass a "
                        "module-level function and picklable args"
                    ) from err
                finally:
                    writer.close()
                procs.append(p)
                readers[reader] = rank
        return _collect(procs, readers, deadline, timeout_s, grace_s)
    finally:
        _stop(procs)
        for r in readers:
            r.close()


def _collect(procs, readers, deadline, timeout_s, grace_s):
    """Wait for one message per rank; a failure starts the grace period, the deadline ends all."""
    results: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}
    pending = dict(readers)  # reader -> rank, for ranks that have not reported
    grace_end = None
    while pending:
        now = time.monotonic()
        if now >= deadline or (grace_end is not None and now >= grace_end):
            break
        end = deadline if grace_end is None else min(deadline, grace_end)
        for reader in wait(list(pending), timeout=min(end - now, 1.0)):
            rank = pending.pop(reader)
            try:
                status, when, payload = pickle.loads(reader.recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(timeout=1.0)
                code = procs[rank].exitcode
                failures[rank] = (time.time(), f"rank {rank} died (exit code {code}) without reporting a result or an error\n")
                grace_end = grace_end or time.monotonic() + grace_s
                continue
            if status == "ok":
                try:
                    results[rank] = pickle.loads(payload)
                except Exception:
                    failures[rank] = (when, f"rank {rank}'s return value could not be unpickled:\n{traceback.format_exc()}")
                    grace_end = grace_end or time.monotonic() + grace_s
            elif status == "port_in_use" and not failures:
                return "port_in_use"
            else:
                failures[rank] = (when, payload)
                grace_end = grace_end or time.monotonic() + grace_s
    if failures:
        first = min(failures, key=lambda r: failures[r][0])
        lines = [f"rank {first} of {len(procs)} failed:\n{failures[first][1].rstrip()}"]
        others = sorted(r for r in failures if r != first)
        for r in others:
            last = failures[r][1].strip().splitlines()[-1] if failures[r][1].strip() else "?"
            lines.append(f"rank {r} also failed: {last}")
        stuck = sorted(pending.values())
        if stuck:
            lines.append(f"ranks {stuck} were killed after a {grace_s:g}s grace period")
        raise _rank_error("\n".join(lines), first, {r: t for r, (_, t) in failures.items()}, stuck)
    if pending:
        stuck = sorted(pending.values())
        err = (
            f"timed out after {timeout_s:g}s: ranks {stuck} of {len(procs)} had not finished "
            f"(ranks {sorted(results)} had); all were killed"
        )
        raise _rank_error(err, stuck[0], {}, stuck)
    # Every rank reported; give them a moment to leave the group and exit.
    for p in procs:
        p.join(timeout=max(0.0, min(grace_s, deadline - time.monotonic())))
    return [results[r] for r in range(len(procs))]


def _rank_error(message: str, rank: int, failures: dict[int, str], stuck: list[int]) -> RankError:
    """RankError with ``rank`` (the first to fail, or the first still running at the timeout),
    ``failures`` (rank -> its traceback text) and ``stuck`` (ranks killed while still running)."""
    err = RankError(message)
    err.rank, err.failures, err.stuck = rank, failures, stuck
    return err


def _stop(procs) -> None:
    """Terminate, then kill, every process still alive; reap them all."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    end = time.monotonic() + 2.0
    for p in alive:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
    for p in procs:  # reap the ones that had exited already
        p.join(timeout=0)

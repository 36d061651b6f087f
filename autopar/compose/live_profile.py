"""Pricing from the live job: every rank measures, together, what a training step on this machine
and these process groups costs, so that the planner's figures are the runtime's.

    live_cluster(mesh, groups)      alpha-beta links per mesh axis (``profile_comm``) plus
                                    ``live_overheads``: a ClusterSpec named "...+live"
    live_op_table(graph, mesh, dev) every (op, shard shape) the planner's candidates can run, timed
    calibrated(model, ..., mesh)    the cluster with ``in_situ_factor``: the model's own forward and
                                    backward, timed on every rank at once, over their profiled price

Everything is cached under the profile cache directory (``autopar.cost_model.cache``): the
communication profile per mesh shape and backend, the host's figures (rank contention, per-op
overheads, AdamW) per device and number of ranks on it, the collective skew per mesh shape too, and
the op table per device and ranks on it; later calls read them. The host's figures are checked
first when their last check is ``HOST_CHECK_S`` old: a short measurement of the rank contention and
of the host's pace, and where either moved by ``HOST_DRIFT`` the host is measured again (and the op
table, cached per contention, with it). All functions here are collectives: call them on every rank.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, ConfigError, PlanError
from autopar.sharding_spec.mesh import Mesh

log = logging.getLogger(__name__)


def _say(level: int, message: str, *args) -> None:
    """Log what every rank would say alike, once: by rank 0."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.log(level, message, *args)

# The short communication profile taken when the mesh has no cluster: 3 sizes, 5
# timed calls each, every collective kind on every mesh axis (~2 s on 4 CPU gloo ranks). A full
# profile (``autopar profile --mesh``, cached in the same directory) is used instead when present.
# The largest is about a gradient bucket's size: fitted to 8 MiB at most, a 65 MiB all-gather on gloo
# was priced 104 ms and ran 144.
PROFILE_SIZES = (4 << 10, 256 << 10, 32 << 20)
PROFILE_REPEATS = 5
PROFILE_SUBDIR = "parallelize"
# 2: rank_contention is the slowest rank's (was the median rank's)
# 3: the ranks' mean, median over CONTENTION_ROUNDS rounds (one round's slowest rank moved 2.1-3.0)
# 4: the host's memory bandwidth (``measure_overheads``), for gradient accumulation
# 5, 6: measured_spread, the contention rounds' spread (6: the median's standard error)
# 7: AdamW and the memory bandwidth measured on every rank at once, AdamW past the caches
HOST_PROFILE_VERSION = 8
# the expected range of n normal draws in standard deviations (d2 of control charts)
_RANGE_TO_SIGMA = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326, 6: 2.534, 7: 2.704}
CONTENTION_ROUNDS = 5
# A cached host profile is checked against a short measurement when it was last checked longer ago
# than this (jobs started in a row reuse it as is) and measured again where the host has drifted:
# one measured at 10:40 while other jobs loaded the VM said rank contention 3.43 where it was 2.0
# at 15:45; planned with it, the bench's GPT and LLaMA took 4-stage pipelines and came out 40%
# slower than predicted.
HOST_CHECK_S = 600.0
HOST_CHECK_ROUNDS = 2
HOST_DRIFT = 1.3  # contention or pace (a fixed workload's time on one rank) this far off, either way
# Untimed forward + backward passes: a process's first passes run faster than its steady state (the
# quick start's GPT-2: 0.84 s a pass after one, 0.92 after four, as a training loop's steps run)
IN_SITU_WARMUP = 3
# Timed in IN_SITU_ROUNDS rounds of IN_SITU_REPEATS passes at least, each about IN_SITU_WINDOW_S
# long (at most 200 passes); the median round. One round of 3 passes of the bench's 10M LLaMA
# measured 0.65 s a pass once and 0.78 s minutes later, and the cached factor kept the outlier.
IN_SITU_ROUNDS = 3
IN_SITU_VERSION = 3  # 2: the median of IN_SITU_ROUNDS rounds (1: one round); 3: three warm-ups, each round's slowest
# rank, gradients added into .grad
IN_SITU_REPEATS = 2  # passes a round at least, where a pass is shorter than the window
IN_SITU_WINDOW_S = 0.35
IN_SITU_RANGE = (1 / 3, 3.0)  # a factor outside means a broken measurement: clamp it (logged)
LIVE_SUFFIX = "+live"
# A candidate doing this many times the work of its op's least-work one is priced by scaling that
# one's timing (``profile_ops(scale_above=)``): the ops a plan runs split are timed as they run.
SCALE_OPS_ABOVE = 2.0


def is_live(mesh: Mesh) -> bool:
    """Whether the mesh's cluster came from ``live_cluster``."""
    return mesh.resolved_cluster().name.endswith(LIVE_SUFFIX)


def live_op_table(graph, mesh: Mesh, device, force=None, *, directory=None):
    """The op table the planner prices compute with: every (op, local shapes) its candidates can
    run (on every view of the mesh it may try), timed on rank 0 alone (steady, comparable figures
    for the ILP to choose between) and scaled by the cluster's ``rank_contention`` (ranks sharing
    cores slow each other: that is the speed the plan will see); cached per device and number of
    ranks on it. A collective."""
    from autopar.cost_model.profile_ops import OpTiming, default_table_path, profile_ops
    from autopar.solver.intra_op import idle_candidates, view_mesh
    from autopar.solver.layout import Layout
    from autopar.solver.problem import node_choices

    device = torch.device(device)
    factor = mesh.resolved_cluster().rank_contention
    cached = cached_live_op_table(device, factor, directory=directory)

    def profile():
        views = [mesh] if isinstance(force, Layout) else [view_mesh(mesh, idle) for idle in idle_candidates(mesh, "auto")]
        pairs = []
        for view in views:  # each view's local shapes differ
            try:  # a forced family may not exist on a view with idle axes: profile every strategy there
                choices = node_choices(graph, view, force=None if isinstance(force, Layout) else force)
            except ConfigError:
                choices = node_choices(graph, view)
            pairs += [(graph.nodes[n], s, view) for n, c in choices.items() if graph.nodes[n].op == "call_function"
                      for s in c.strategies]
        new = profile_ops(graph, mesh, pairs, device, repeats=5, cache=False, label=cached.device,
                          select=lambda key: key not in cached, scale_above=SCALE_OPS_ABOVE)
        return {k: OpTiming(t.forward_s * factor, {m: b * factor for m, b in t.backward_s.items()})
                for k, t in new.entries.items()}

    added = _on_rank0(profile)
    if added:
        cached.entries.update(added)
        if dist.get_rank() == 0:
            cached.save(default_table_path(cached.device, cached.torch_version, directory))
    return cached


def cached_live_op_table(device, contention: float, *, directory=None):
    """What ``live_op_table`` has cached for this device, this many ranks on the host and this
    ``rank_contention`` (its timings are scaled by it: a host profile measured again, with another
    figure, gets a table of its own)."""
    from autopar.cost_model.profile_ops import load_op_table

    return load_op_table(torch.device(device), directory, f"{_host_label(device)}-c{contention:.3f}")


def _ranks_on_host() -> int:
    """Ranks sharing this machine (torchrun sets LOCAL_WORLD_SIZE; spawned ranks are all local)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's; else the world (spawn runs every rank here)
    return int(local) if local else dist.get_world_size()


def live_overheads(device, *, groups=None, directory=None) -> dict:
    """What the live cluster adds to the profiled links, measured in the ranks. A collective.

    rank_contention   how much slower an op runs while every rank on the host computes than on
                      one rank alone (``contention_workload``, per iteration: all ranks at once,
                      their mean, the median of ``CONTENTION_ROUNDS`` rounds, against the median
                      of as many rounds of rank 0 alone); 1 on GPUs (a rank per device)
    op / backward op overheads (``measure_overheads``): timed on rank 0 alone, times ``rank_contention``
    AdamW per element and per tensor, on CPU the memory bandwidth, warm and into new tensors
                      (``measure_memory_work``): timed
                      on every rank at once (they share the host's memory bandwidth), the ranks' mean
    collective_overhead_s  with ``groups``: the extra wall time of a collective reached from compute
                      (``measure_collective_overhead``) on the mesh's axis groups, median over ranks
    comm_overlap      on CPU, whether a core is left for gloo's threads (1 when the ranks' threads
                      fill at most half the cores, 0 when they fill them all, linear between); 1 on GPUs

    The host's figures are cached per device and ranks on the host (the op table, scaled by the
    same contention, is too), and checked against a short measurement when their last check is
    older than ``HOST_CHECK_S`` (see the module docstring); the collective skew per mesh shape as well.
    """
    from autopar.cost_model.profile_runtime import measure_collective_overhead, measure_memory_work, measure_overheads

    device = torch.device(device)

    def host():
        contention, pace, spread = _contention(device, CONTENTION_ROUNDS) if device.type != "cuda" else (1.0, None, 0.0)
        # compute-bound overheads: one rank alone, stretched by the contention of ranks sharing the host
        out = {k: v * contention for k, v in _on_rank0(lambda: measure_overheads(device)).items()}
        # memory-bound work: every rank at once, as a step's optimizers run (they share the bandwidth)
        dist.barrier()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, measure_memory_work(device))
        out.update({k: statistics.fmean(r[k] for r in everyone) for k in everyone[0]})
        return dict(out, rank_contention=contention, measured_spread=spread, pace_s=pace, checked_at=time.time())

    what = f"host-v{HOST_PROFILE_VERSION}"
    out = dict(_cached(what, device, directory, host))
    if device.type != "cuda" and _on_rank0(lambda: time.time() - out.get("checked_at", 0.0) > HOST_CHECK_S):
        contention, pace, _ = _contention(device, HOST_CHECK_ROUNDS)
        drift = max(contention / out["rank_contention"], out["rank_contention"] / contention,
                    *((pace / out["pace_s"], out["pace_s"] / pace) if out.get("pace_s") else ()))
        if drift > HOST_DRIFT:
            _say(logging.WARNING, "the host drifted from its cached profile (rank contention %.2f, now %.2f): "
                 "measuring it again", out["rank_contention"], contention)
            out = host()
        out["checked_at"] = time.time()
        _store(what, device, directory, out)
    for key in ("pace_s", "checked_at"):
        out.pop(key, None)
    if groups is not None:
        def skew():
            pgs = [groups.group((a,)) for a, n in enumerate(groups.mesh.shape) if n > 1]
            parts = [None] * dist.get_world_size()
            world = groups.group(tuple(range(len(groups.mesh.shape))))
            dist.all_gather_object(parts, measure_collective_overhead(pgs, device, world))
            return {"collective_overhead_s": statistics.median(parts)}

        shape = "x".join(map(str, groups.mesh.shape))
        out.update(_cached(f"skew-v4-mesh{shape}", device, directory, skew))  # v4: the world's wall time, the axes in turn
    if device.type == "cuda":
        out["comm_overlap"] = 1.0
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        busy = _ranks_on_host() * torch.get_num_threads() / max(cores, 1)
        out["comm_overlap"] = min(1.0, max(0.0, 2.0 - 2.0 * busy))
    return out


def calibrated(model, graph, example, mesh: Mesh, device, *, directory=None) -> Mesh:
    """``mesh`` with its (live) cluster's ``in_situ_factor`` measured on ``model``: every rank
    runs the model's forward and backward on its data-parallel share of the example batch
    (``example``: (inputs, kwargs)), all at once as in a step; the slowest rank's time (a step waits
    for it at its first collective: the ranks' mean priced the quick start's compute 15-20% under
    what its steps ran), the median over rounds, over the price
    the cost model gives the same work (the data-parallel plan's compute and per-op overheads, from
    the live op table). Op-by-op profiles miss what a model's ops do to each other (allocation,
    caches, dispatch): on 4 ranks of 2 cores a 10M GPT ran 0.98-1.14x, a 0.1M one 1.3-1.9x its ops'
    sum.
    The per-op overheads are scaled by the same factor. Cached per model graph, mesh size and host
    profile. A collective; ``mesh`` unchanged where nothing can be timed (a meta model, a model on
    another device, no batch to split evenly, no output that needs gradients)."""
    from autopar.solver.layout import Layout
    from autopar.solver.microbatches import batch_size, microbatch_inputs

    cluster = mesh.resolved_cluster()
    device = torch.device(device)
    world = mesh.size
    params = list(model.parameters())
    try:
        batch = batch_size(*example)
    except AutoparError:
        batch = 0
    if (world < 2 or not batch or batch % world or any(p.is_meta for p in params)
            or any(p.device.type != device.type for p in params)):
        return mesh
    inputs, kwargs = microbatch_inputs(*example, world)
    # the same devices in a line (the data-parallel plan's compute does not depend on the links)
    flat = Mesh((world,), cluster=cluster.with_axis_links(mesh.links()[:1]))

    def measure():
        seconds = _forward_backward_s(model, inputs, kwargs, device)
        together = [None] * dist.get_world_size()
        dist.all_gather_object(together, seconds)
        none = {"factor": 1.0, "measured_s": None, "predicted_s": None}
        if any(t is None for t in together):
            return none
        try:  # (collectives: an error reaches every rank alike)
            table = live_op_table(graph, flat, device, Layout(dp=world), directory=directory)
            predicted = _on_rank0(lambda: _dp_compute_s(model, flat, graph, world, table))
        except AutoparError as err:
            _say(logging.INFO, "no in-situ factor: the data-parallel plan could not be priced (%s)", err)
            return none
        # a step waits for its slowest rank at its first collective: each round's slowest, the median round
        measured = statistics.median(max(rounds) for rounds in zip(*together))
        return {"factor": measured / predicted if predicted > 0 else 1.0, "measured_s": measured, "predicted_s": predicted}

    key = f"insitu-v{IN_SITU_VERSION}-{graph.fingerprint()[:16]}-w{world}-c{cluster.rank_contention:.3f}"
    got = _cached(key, device, directory, measure)
    if got["measured_s"] is None:
        return mesh
    lo, hi = IN_SITU_RANGE
    factor = min(hi, max(lo, got["factor"]))
    if factor != got["factor"]:
        _say(logging.WARNING, "in-situ factor %.2f (model %.3g s, its ops %.3g s) clamped to %.2f", got["factor"],
                    got["measured_s"], got["predicted_s"], factor)
    source = (f"{cluster.source}; in situ x{factor:.2f}: the model's forward+backward on {world} ranks "
              f"{got['measured_s']:.3g} s vs its profiled ops {got['predicted_s']:.3g} s")
    return mesh.with_cluster(dataclasses.replace(
        cluster, in_situ_factor=factor, op_overhead_s=cluster.op_overhead_s * factor,
        backward_op_overhead_s=cluster.backward_op_overhead_s * factor, source=source))


def _dp_compute_s(model, mesh: Mesh, graph, world: int, table) -> float:
    """The cost model's compute and per-op overheads of the data-parallel plan on ``mesh``."""
    from autopar.solver.api import plan
    from autopar.solver.layout import Layout

    p = plan(model, mesh, graph=graph, force=Layout(dp=world), pipeline=False, op_table=table, memory_budget=None)
    return p.predicted["compute_s"] + p.predicted["overhead_s"]


def _forward_backward_s(model, inputs, kwargs, device) -> list[float] | None:
    """Seconds per forward and backward of the model (gradients of its scalar outputs, else of
    every output's sum, added into its parameters' ``.grad``, which are put back as they were), run back to
    back on every rank in ``IN_SITU_ROUNDS`` rounds of about ``IN_SITU_WINDOW_S`` (the same count on
    every rank), each round's mean: ranks sharing cores each get their share of them only over such
    a window (a short pass runs at full speed or not at all). Buffers (batch norm's statistics) and
    the random streams are left as they were. None when no output needs a gradient or the model
    fails. A collective."""
    from autopar.cost_model.cache import synchronizer

    params = [p for p in model.parameters() if p.requires_grad]
    buffers = list(model.buffers())
    saved = [b.detach().clone() for b in buffers]
    grads = [p.grad for p in params]  # the caller's, put back after: each pass adds into its own
    sync = synchronizer(device)
    devices = [device.index or 0] if device.type == "cuda" else []

    def once():
        outs = [t for t in _tensors(model(*inputs, **kwargs)) if t.requires_grad and t.is_floating_point()]
        scalars = [t for t in outs if t.dim() == 0]
        if not outs or not params:
            raise ValueError("no output needs a gradient")
        # into gradients kept from pass to pass, as a step's backward hands each to its bucket
        torch.autograd.backward(sum(t.float().sum() for t in scalars or outs), inputs=params)
        sync()

    try:
        with torch.random.fork_rng(devices=devices):
            for _ in range(IN_SITU_WARMUP):
                t0 = time.perf_counter()
                once()
            warm = time.perf_counter() - t0  # the last warm-up pass's length
            error = None
    except Exception as err:  # a model that does not run on its share of the batch: no factor, on every rank
        warm, error = None, err
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, warm)
    try:
        if any(w is None for w in every):
            _say(logging.INFO, "no in-situ factor: the model's forward and backward on its share of the batch failed (%s)", error)
            return None
        longest = max(max(every), 1e-6)  # a pass longer than the window is a window: one a round
        count = 1 if longest > IN_SITU_WINDOW_S else max(IN_SITU_REPEATS, min(200, math.ceil(IN_SITU_WINDOW_S / longest)))
        rounds = []
        with torch.random.fork_rng(devices=devices):
            for _ in range(IN_SITU_ROUNDS):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(count):
                    once()
                rounds.append((time.perf_counter() - t0) / count)
        return rounds
    except Exception as err:  # (after the warm-ups ran: the caller's gather still hears None from here)
        log.info("no in-situ factor: the model failed while timed on this rank (%s)", err)
        return None
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved):
                b.copy_(v)
        for p, g in zip(params, grads):
            p.grad = g


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _contention(device, rounds: int) -> tuple[float, float, float]:
    """(rank contention, the workload's seconds on rank 0 alone, its spread):
    ``contention_workload`` on every rank at once, the ranks' mean, the median over ``rounds``
    rounds, over rank 0's median alone. The spread is the median's standard error relative to it,
    estimated from the rounds' range (sigma ~ range / 2.33 for five rounds, the median's error
    ~ 1.25 sigma / sqrt(rounds)): how far this moment's figure may be off. The same on every rank.
    A collective."""
    from autopar.cost_model.profile_runtime import contention_workload

    together = []
    for _ in range(rounds):
        dist.barrier()
        times = [None] * dist.get_world_size()
        dist.all_gather_object(times, contention_workload(device))
        # The ranks' mean: over a step of many windows like this the kernel evens out the cores'
        # shares. One window's slowest rank is luck (1.3x-3.0x in one round when 3 ranks landed on
        # one core); priced by it, the 10M GPT and LLaMA of make bench came out 10-30% over their
        # measured steps. The median over rounds drops outliers.
        together.append(statistics.fmean(times))
    alone = _on_rank0(lambda: statistics.median(contention_workload(device) for _ in range(rounds)))
    middle = statistics.median(together)
    sigma = (max(together) - min(together)) / _RANGE_TO_SIGMA.get(rounds, 2.33)
    return max(1.0, middle / alone), alone, 1.2533 * sigma / math.sqrt(rounds) / middle


def _store(what: str, device, directory, value: dict) -> None:
    """Rank 0 writes ``value`` where ``_cached`` reads ``what``."""
    from autopar.cost_model.cache import write_json

    if dist.get_rank() == 0:
        write_json(_cache_path(what, device, directory), value)


def _cache_path(what: str, device, directory):
    from autopar.cost_model.cache import cache_dir, slug

    return cache_dir(directory) / PROFILE_SUBDIR / f"{what}-{slug(_host_label(device))}-torch{slug(torch.__version__)}.json"


def _cached(what: str, device, directory, measure) -> dict:
    """``measure()`` (a collective returning the same dict on every rank), or what rank 0 has cached
    for ``what`` on this device, ranks on the host and torch version."""
    from autopar.cost_model.cache import read_json, write_json

    path = _cache_path(what, device, directory)
    box = [read_json(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        box[0] = measure()
        if dist.get_rank() == 0:
            write_json(path, box[0])
    return box[0]


def _host_label(device) -> str:
    """The device's name, with the number of ranks sharing it on CPU (they slow each other)."""
    from autopar.cost_model.cache import device_name

    device = torch.device(device)
    return device_name(device) + ("" if device.type == "cuda" else f"-{_ranks_on_host()}ranks")


def _on_rank0(fn):
    """``fn()`` run on rank 0 while the other ranks wait (idle, in a broadcast); its value on every
    rank, or its error raised on every rank (none is left waiting for a result that never comes)."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # every rank must hear of it
            box[0] = ("error", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status != "ok":
        raise PlanError(f"profiling on rank 0 failed: {value}; pass cluster= or profile=False to price without it")
    return value


def live_cluster(mesh: Mesh, groups, *, directory=None, device="cpu"):
    """A ClusterSpec with one alpha-beta link per mesh axis fitted to collectives timed on the live
    ``groups`` (``autopar.cost_model.profile_comm``); a collective: call it on every rank.

    A full profile cached for this mesh shape and backend (``autopar profile --mesh``) is read if
    rank 0 has one; else a short profile (``PROFILE_SIZES`` x ``PROFILE_REPEATS``) is taken, or
    read back from ``cache_dir()/parallelize/`` where the first call left it. ``directory``
    overrides the cache directory."""
    from autopar.cost_model import profile_comm
    from autopar.cost_model.cache import cache_dir

    backend = str(dist.get_backend())
    base = _base_cluster(backend)
    root = cache_dir(directory)
    box = [None]
    if dist.get_rank() == 0:
        box[0] = profile_comm.load_profile(mesh.shape, backend, root) is not None
    dist.broadcast_object_list(box, src=0)
    if box[0]:  # a full profile: read, never re-measured here
        cluster = profile_comm.profile_mesh(mesh, groups, base_cluster=base, directory=root)
    else:
        cluster = profile_comm.profile_mesh(mesh, groups, PROFILE_SIZES, PROFILE_REPEATS, base_cluster=base,
                                            directory=root / PROFILE_SUBDIR)
    return dataclasses.replace(cluster, name=cluster.name + LIVE_SUFFIX,
                               **live_overheads(device, groups=groups, directory=directory))


def _base_cluster(backend: str) -> str:
    """The preset whose non-link fields (FLOP/s, memory) a profiled cluster keeps."""
    if backend != "nccl":
        return "cpu-gloo"
    name = torch.cuda.get_device_name().upper()
    return "h100-80g" if any(k in name for k in ("H100", "H200", "H800")) else "a100-80g"

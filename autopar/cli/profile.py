"""`autopar profile`: measure this machine so plans are priced from profiles, not presets.

    autopar profile --mesh 2x2          spawn 4 local gloo ranks, time collectives per mesh axis,
                                        fit alpha/beta per axis, cache the fit
    autopar profile --ops gpt --mesh 2x2
                                        time the ops of a model at every candidate's shard shapes
                                        on this device, cache the op table
"""
from __future__ import annotations

import warnings

from autopar.errors import ConfigError


def _comm_rank(rank, world_size, shape, refresh):
    from autopar.cost_model.profile_comm import measure_mesh, profile_path
    from autopar.runtime.process_groups import MeshGroups
    from autopar.sharding_spec.mesh import Mesh

    mesh = Mesh(shape)
    prof = measure_mesh(mesh, MeshGroups(mesh), refresh=refresh)
    if rank != 0:
        return None
    return prof.to_dict(), [prof.fit_error(a, min_bytes=64 << 10) for a in range(mesh.ndim)], str(profile_path(shape, prof.backend))


def profile_comm(shape, refresh: bool = True) -> str:
    from autopar.cost_model.profile_comm import CommProfile
    from autopar.runtime.launch import spawn

    data, errors, path = spawn(_comm_rank, _size(shape), args=(shape, refresh), timeout_s=300)[0]
    prof = CommProfile.from_dict(data)
    links = prof.cluster.links_for(prof.mesh_shape)
    lines = [f"collectives on a live {'x'.join(map(str, shape))} {prof.backend} mesh ({len(prof.measurements)} timings)", ""]
    lines.append(f"{'axis':>4} {'size':>5} {'alpha (us)':>11} {'bandwidth (GB/s)':>17} {'fit error >=64KiB':>18}")
    for a, (link, err) in enumerate(zip(links, errors)):
        lines.append(f"{a:>4} {shape[a]:>5} {link.alpha * 1e6:>11.1f} {link.bandwidth / 1e9:>17.3f} {err:>17.0%}")
    if prof.factors:
        lines.append("per-collective factors (alpha, beta): " + ", ".join(f"{k} ({fa:.2f}, {fb:.2f})" for k, (fa, fb) in sorted(prof.factors.items())))
    if prof.cluster.scalar_all_reduce_alphas is not None:
        lines.append(f"an all_reduce of one value: {prof.cluster.scalar_all_reduce_alphas:.2f} alphas "
                     f"(the ring model: {2 * max(shape) - 1} on the largest axis)")
    lines.append(f"\ncached in {path}; `autopar.parallelize` and `autopar explain --profiled` read it")
    return "\n".join(lines)


def profile_model_ops(model_spec: str, shape, repeats: int = 3) -> str:
    from autopar import ir
    from autopar.cli.model_spec import load_model
    from autopar.cost_model.profile_ops import default_table_path, profile_ops
    from autopar.sharding_spec.mesh import Mesh
    from autopar.solver.problem import node_choices

    model, inputs, kwargs = load_model(model_spec)
    graph = ir.trace(model, inputs, kwargs)
    mesh = Mesh(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        choices = node_choices(graph, mesh)
    pairs = [(name, s) for name, c in choices.items() for s in c.strategies]
    table = profile_ops(graph, mesh, pairs, repeats=repeats)
    return (f"timed {len(table.entries)} (op, shard shape) entries of {graph.model_name} for mesh "
            f"{'x'.join(map(str, shape))} on {table.device}\ncached in {default_table_path(table.device)}; "
            "`autopar explain --profiled` uses it")


def _size(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run(args) -> int:
    if args.ops:
        print(profile_model_ops(args.ops, args.mesh or (1,)))
        if args.mesh and _size(args.mesh) >= 2:
            print()
            print(profile_comm(args.mesh))
        return 0
    if not args.mesh:
        raise ConfigError("give --mesh (e.g. --mesh 2x2) to profile collectives, and/or --ops MODEL to profile ops")
    if _size(args.mesh) < 2:
        raise ConfigError(f"a mesh of {_size(args.mesh)} rank has no collectives to profile; use at least 2 ranks")
    print(profile_comm(args.mesh))
    return 0

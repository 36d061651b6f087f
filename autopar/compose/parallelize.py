"""``autopar.parallelize``: inside each rank, turn a model into this rank's ParallelModule.

In order, on every rank (the same calls everywhere, since several are collective):

1. trace the model (every rank needs the graph to lower it; a meta-device model is traced on meta
   copies of the example inputs);
2. process groups for every set of mesh axes (``MeshGroups``), with the collective timeout;
3. plan: price the mesh with its cluster, else with a profile of these live groups and of this
   machine (``autopar.compose.live_profile``: every rank takes part; cached), else cpu-gloo; rank 0
   runs ``autopar.plan`` and broadcasts the Plan
   as JSON, so every rank runs the same plan; or check a given ``plan=`` against the graph;
4. lower the plan to the rank's program (``autopar.codegen.lower``);
5. build only this rank's parameter shards (``materialize``: from ``state_dict=``, the real model,
   or a meta model plus its init);
6. wrap them in a ``ParallelModule`` called like the original model, with what it needs to build
   programs for the other mode and other input shapes on first use (a weightless copy of the
   model, the pricing mesh and the planner's keywords: ``autopar.compose.programs``).
"""
from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist

from autopar.compose.live_profile import calibrated, is_live, live_cluster, live_op_table
from autopar.errors import ConfigError, PlanError, TraceError
from autopar.ir.precision import working_call, working_model
from autopar.sharding_spec.mesh import Mesh
from autopar.solver.config import PlanConfig

DEFAULT_MAX_PROGRAMS = 8


def parallelize(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs=(),
    *,
    example_kwargs: dict | None = None,
    config: PlanConfig | None = None,
    plan=None,
    state_dict: dict | None = None,
    init_fn=None,
    device=None,
    groups=None,
    profile: bool = True,
    timeout=None,
    max_programs: int = DEFAULT_MAX_PROGRAMS,
    **options,
):
    """This rank's part of ``model`` parallelized on ``mesh``: an ``nn.Module`` called like the
    original (the same inputs, whole on every rank; the same output structure), whose
    ``parameters()`` are this rank's shards. Call it on every rank (torchrun, ``autopar.launch``).

    example_inputs / example_kwargs: what the model is traced with (a full batch).
    config: an ``autopar.PlanConfig``, the planning options ``autopar.plan`` takes (memory_budget,
        cluster, pipeline, force, optimizer, idle_axes, identical_axes, bucket_bytes, time_limit_s,
        solver; its docstring says what each does). Here the cluster defaults to the mesh's, else a
        profile of the live groups when ``profile``, else cpu-gloo; ``bucket_bytes`` is also the
        runtime's gradient bucket size.
    options: any ``PlanConfig`` field as a keyword, applied over ``config``
        (``parallelize(model, mesh, x, pipeline=False)``).
    plan: a Plan (or a path to a plan JSON) to run instead of planning; checked against the model.
    state_dict: full (unsharded) tensors to load, original keys; else the model's own values, or
        for a meta-device model its modules' ``reset_parameters()`` then ``init_fn(module)``.
    device: where the shards live (default: the model's device; for a meta model cuda:LOCAL_RANK
        under NCCL, else cpu).
    groups: an existing ``MeshGroups`` for this mesh (to share it between modules).
    profile: price with a profile of the live groups (cached) when no cluster is given.
    timeout: seconds (or a timedelta) after which a collective whose peer is dead or stuck raises
        instead of hanging; default: the default process group's timeout (600 s when parallelize
        creates the default group from torchrun's, SLURM's or OpenMPI's environment).
    max_programs: how many programs calls in another mode or with other input shapes may build
        (each costs a trace and a plan on first use; see ``autopar.compose.programs``).

    The module trains in the plain loop (``loss = pmodel(...).loss; loss.backward();
    opt.step()``, clipping, ``no_sync()`` accumulation, ``eval()``); ``pmodel.train_step(...)``
    runs forward and backward of a batch in one call.
    """
    from autopar.codegen.lower import lower
    from autopar.compose.programs import VariantBuilder, constants_of, plan_on_rank0
    from autopar.ir import trace
    from autopar.runtime.materialize import in_precision, local_state
    from autopar.runtime.module import ParallelModule
    from autopar.runtime.process_groups import MeshGroups
    from autopar.solver.plan import Plan

    config = PlanConfig.of(config, **options)
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"mesh must be an autopar.Mesh, got {type(mesh).__name__}")
    on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    trace_inputs, trace_kwargs = tuple(inputs), dict(example_kwargs or {})
    if on_meta:
        trace_inputs, trace_kwargs = _to_meta((trace_inputs, trace_kwargs))
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    precision = _precision(config, plan)
    real_call = (trace_inputs, trace_kwargs)
    traced = model  # what is traced: the model as it computes (a weightless working copy under a precision)
    if precision is not None:
        traced, (trace_inputs, trace_kwargs) = working_call(model, real_call, precision)
    try:
        graph = trace(traced, trace_inputs, trace_kwargs or None)
    except TraceError as err:  # every rank fails alike: rank 0 says why, the others say where to look
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank != 0:
            raise TraceError(f"rank {rank}: torch.export could not trace {type(model).__name__}; rank 0's "
                             "error says why") from None
        raise err from err.__cause__
    _check_outputs(graph)
    if plan is not None:
        check_plan(plan, graph, mesh)  # before any collective: a bad plan fails on every rank alike

    from autopar.runtime.world import resolve_device

    wanted = device if device is not None else _model_device(model, on_meta)  # None: where the world computes
    if not dist.is_initialized():  # ranks started by torchrun, srun or mpirun: take the launcher's word
        _start_world(mesh, wanted, timeout)
    device = resolve_device(wanted, dist.get_backend())
    if dist.get_backend() == "nccl" and device.type != "cuda":
        raise ConfigError(f"the process group runs NCCL but the model's shards would live on {device}: move the "
                          "model to its GPU first (model.to(autopar.init().device)), or pass device=")
    mesh.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    _check_same_inputs(graph)
    groups = groups if groups is not None else MeshGroups(mesh, timeout=timeout)
    bucket_bytes = config.bucket_bytes
    pricing = config.replace(cluster=None)  # the pricing mesh carries the cluster
    if plan is None:
        plan_mesh = _pricing_mesh(mesh, config.cluster, groups, profile, device)
        if plan_mesh.cluster is not None and is_live(plan_mesh) and config.op_table is None:
            pricing = pricing.replace(op_table=live_op_table(graph, plan_mesh, device, config.force))
            computing, call = _computing(model, real_call, precision)
            plan_mesh = calibrated(computing, graph, call, plan_mesh, device)
        plan = plan_on_rank0(traced, plan_mesh, graph, pricing, (trace_inputs, trace_kwargs or None))
        check_plan(plan, graph, mesh)
    else:
        plan_mesh = mesh.with_cluster(config.cluster) if config.cluster is not None else mesh
    # a weightless copy of the model as it computes, to trace other modes and shapes on first use
    skeleton = traced if precision is not None else working_model(model)
    if plan.pipeline is not None:
        from autopar.compose.pipeline import build_stage

        return build_stage(model, traced, skeleton, graph, plan, mesh, (trace_inputs, trace_kwargs), (inputs, example_kwargs or {}),
                           device=device, timeout=timeout, state_dict=state_dict, init_fn=init_fn,
                           bucket_bytes=bucket_bytes, signature=_signature(model), requires_grad=_requires_grad,
                           plan_config=pricing, precision=precision)

    lowered = lower(graph, plan, mesh, device=device)
    shards = local_state(model, graph, plan, mesh, rank, state_dict=state_dict, init_fn=init_fn, device=device)
    shards = in_precision(shards, graph, precision)
    requires_grad = {ph: _requires_grad(model, fqn, graph) for fqn, ph in graph.params.items()}
    constants = constants_of(graph, device)
    builder = VariantBuilder(skeleton, plan, mesh, plan_mesh, pricing, device, max_programs)
    order = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return ParallelModule(
        graph=graph, plan=plan, lowered=lowered, groups=groups, shards=shards,
        state_keys=list(model.state_dict(keep_vars=True).keys()), signature=_signature(model),
        requires_grad=requires_grad, constants=constants, order=order, builder=builder, mode=model.training,
        device=device, example=(inputs, example_kwargs or {}), bucket_bytes=bucket_bytes, precision=precision,
    )


def _precision(config: PlanConfig, plan):
    """The ``MixedPrecision`` to run (or None): the config's, or a given plan's; the two must agree."""
    from autopar.ir.precision import MixedPrecision

    of_plan = MixedPrecision.from_dict(plan.precision) if plan is not None and plan.precision else None
    if plan is not None and config.precision is not None and config.precision != of_plan:
        raise ConfigError(f"precision={config.precision.name!r} differs from the given plan's "
                          f"({of_plan.name if of_plan else 'the model dtypes'}); drop one, or plan again")
    return config.precision if config.precision is not None else of_plan


def _computing(model, call, precision):
    """(model, call) as the plan computes them, real tensors: a working copy of the model in the
    precision's dtype (``model.to(dtype)`` on a copy) with its floating inputs cast; as they are
    without a precision. For timing the model in situ."""
    import copy

    from autopar.ir.precision import cast_floats

    if precision is None:
        return model, call
    return copy.deepcopy(model).to(precision.param_dtype), cast_floats(call, precision.param_dtype)


# ---- steps ------------------------------------------------------------------------------------------
def check_plan(plan, graph, mesh) -> None:
    """The plan is for this graph and mesh, and the runtime can run every choice in it (a
    pipelined plan's fingerprint is its microbatch graph's: checked when that is traced)."""
    if plan.pipeline is None:
        plan.check_model(graph.fingerprint(), graph.model_name)
    elif plan.model_name != graph.model_name:
        raise PlanError(f"this plan is for {plan.model_name}, not {graph.model_name}")
    if tuple(plan.mesh["shape"]) != mesh.shape:
        raise PlanError(f"the plan is for a mesh of shape {tuple(plan.mesh['shape'])}, not {mesh}")


def _model_device(model, on_meta) -> torch.device | None:
    """Where the model's tensors are; None for a meta model (its shards go where the world computes)."""
    if on_meta:
        return None
    t = next(iter(list(model.parameters()) + list(model.buffers())), None)
    return t.device if t is not None else torch.device("cpu")


def _start_world(mesh: Mesh, device, timeout) -> None:
    """``autopar.init()`` for a script that did not call it: the launcher's process group (NCCL for
    CUDA shards, gloo for CPU ones)."""
    from autopar.runtime.world import DEFAULT_TIMEOUT_S, init, launch_env

    if mesh.size > 1 and launch_env() is None:
        raise ConfigError(
            f"autopar.parallelize runs inside each rank (the mesh has {mesh.size}): start them with torchrun, srun "
            "(SLURM), mpirun (OpenMPI) or autopar.runtime.launch.spawn, or call autopar.init() / "
            "torch.distributed.init_process_group first"
        )
    init(device=device, timeout=DEFAULT_TIMEOUT_S if timeout is None else timeout)


def _pricing_mesh(mesh: Mesh, cluster, groups, profile: bool, device=None) -> Mesh:
    """The mesh the planner prices: with ``cluster``, else the mesh's own, else (``profile`` and
    more than one rank) the live groups' profile, else the cpu-gloo preset (the planner's default)."""
    if cluster is not None:
        return mesh.with_cluster(cluster)
    if mesh.cluster is not None or not profile or mesh.size == 1:
        return mesh
    return mesh.with_cluster(live_cluster(mesh, groups, device=device))


def _check_same_inputs(graph) -> None:
    """Every rank traced the same call (the full batch, the same shapes): else a ConfigError on
    every rank naming what differs, before any rank plans or waits in a collective."""
    mine = [(name, str(graph.nodes[name].meta)) for name in graph.inputs]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (graph.model_name, mine))
    if all(x == everyone[0] for x in everyone):
        return
    differs = [f"rank {r}: {', '.join(f'{n} {m}' for n, m in inputs)}" for r, (_, inputs) in enumerate(everyone)
               if (_, inputs) != everyone[0]]
    first = ", ".join(f"{n} {m}" for n, m in everyone[0][1])
    raise ConfigError(f"the ranks called parallelize with different inputs: rank 0: {first}; {'; '.join(differs[:4])}. "
                      "Every rank passes the same full batch (each keeps its own shard of it)")


def _check_outputs(graph) -> None:
    from torch.export.graph_signature import OutputKind

    other = [s for s in graph.exported.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if other:
        kinds = sorted({s.kind.name for s in other})
        raise ConfigError(
            f"{graph.model_name}'s forward mutates state ({', '.join(kinds)}: a buffer or input replaced as a whole); "
            "parallelize does not support that yet: update such buffers in place (buf.copy_(new)) or remove the mutation"
        )


def _to_meta(tree):
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, tree)


def _requires_grad(model, fqn, graph) -> bool:
    named = dict(model.named_parameters(remove_duplicate=False))
    for a in graph.param_aliases.get(fqn, (fqn,)):
        if a in named:
            return named[a].requires_grad
    return True


def _signature(model):
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None

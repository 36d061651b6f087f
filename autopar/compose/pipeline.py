"""Build this rank's module of a pipelined plan: trace the microbatch graph, cut it into stages,
make every block's groups, lower this rank's stages (several under interleaved 1F1B), shard their
parameters, and hand the module a ``PipelineRunner`` (``autopar.runtime.pipeline``) for
``train_step``."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from autopar.codegen.stages import cut_stages, lower_stage, sent_specs, shared_params
from autopar.errors import ConfigError
from autopar.ir.losses import loss_position
from autopar.runtime.pipeline import PipelineRunner, make_stage_groups
from autopar.runtime.programs import Program
from autopar.sharding_spec.mesh import Mesh


def build_stage(model, graph, plan, mesh: Mesh, trace_call, example_call, *, device, timeout, state_dict, init_fn,
                bucket_bytes, signature, requires_grad):
    """This rank's ``ParallelModule`` of a pipelined ``plan``: its stages' programs and shards,
    with a ``PipelineRunner`` for ``train_step``. ``graph`` is the whole batch's trace (to tell
    which inputs the microbatches split); the stages run on the microbatch graph, traced here."""
    from autopar import ir
    from autopar.compose.programs import constants_of
    from autopar.runtime.materialize import local_state
    from autopar.runtime.module import ParallelModule
    from autopar.solver.pipeline import microbatch_inputs

    count = plan.pipeline.microbatches
    mb_args, mb_kwargs = microbatch_inputs(*trace_call, count)
    micro = ir.trace(model, mb_args, mb_kwargs or None)
    plan.check_model(micro.fingerprint(), micro.model_name)
    batch_dims = [tuple(graph.nodes[a].meta.shape[:1]) != tuple(micro.nodes[b].meta.shape[:1])
                  for a, b in zip(graph.inputs, micro.inputs)]
    cuts = cut_stages(micro, plan)
    shared = shared_params(micro, cuts)
    loss_index = loss_position(micro)
    blocks = len(plan.pipeline.stages) // plan.pipeline.virtual_stages
    blocks_of = {ph: frozenset(st % blocks for st in stages) for ph, stages in shared.items()}
    sg = make_stage_groups(plan, mesh, {b for b in blocks_of.values() if len(b) > 1}, timeout)
    groups = sg.groups
    specs = sent_specs(micro, plan, cuts)
    lowered = {}
    for st in sg.stages:  # this rank's stages (several under interleaved 1F1B)
        lowered[st] = lower_stage(micro, plan, cuts, specs, st, groups.mesh, device)
    state = list(dict.fromkeys(ph for low in lowered.values() for ph in low.state))
    stage_plan = _merged(plan, sg.stages)
    shards = local_state(model, micro, stage_plan, groups.mesh, groups.rank, state_dict=state_dict, init_fn=init_fn,
                         device=device, placeholders=set(state))
    fqn_of = {ph: fqn for fqn, ph in {**micro.params, **micro.buffers}.items()}
    mine = {fqn_of[ph] for ph in state if ph in fqn_of}
    canonical = {a: canon for canon, names in micro.param_aliases.items() for a in names}
    all_keys = list(model.state_dict(keep_vars=True).keys())
    # A parameter several blocks hold counts in the gradient norm once: in the first of them.
    not_in_norm = frozenset(ph for ph, b in blocks_of.items() if sg.block != min(b))
    ex_args, ex_kwargs = microbatch_inputs(*example_call, count)
    first = lowered[sg.stages[0]]
    pm = ParallelModule(
        graph=micro, plan=stage_plan, lowered=first, groups=groups, shards=shards,
        state_keys=[k for k in all_keys if canonical.get(k, k) in mine], signature=signature,
        requires_grad={ph: requires_grad(model, fqn, micro) for fqn, ph in micro.params.items()},
        constants=constants_of(micro, device), order=[n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()],
        builder=None, mode=model.training, device=device, example=(ex_args, ex_kwargs), bucket_bytes=bucket_bytes,
        norm_group=dist.group.WORLD, not_in_norm=not_in_norm, state=state,
    )
    slot_of = {ph: i for i, ph in enumerate(state)}
    programs = {st: Program(micro, plan.pipeline.stages[st].plan, low, [slot_of[ph] for ph in low.state], {},
                            pm._ap.in_spec, pm._ap.out_spec) for st, low in lowered.items()}
    numbering = {fqn: i for i, fqn in enumerate(micro.params)}
    pm._ap.clip.index = {id(p): numbering[fqn] for fqn, p in pm.local_state().items() if fqn in numbering}
    pm._ap.clip.n_index = len(numbering)
    pm._ap.plan_full = plan
    pm._ap.all_state_keys = all_keys
    pm._ap.pipeline = PipelineRunner(pm, micro, plan, programs, cuts, sg, shared, device, loss_index, batch_dims)
    return pm


def _merged(plan, stages: list[int]):
    """The intra-op plan of one rank's stages: the first's, with every stage's parameters (a
    parameter two of them read must be stored alike)."""
    plans = [plan.pipeline.stages[st].plan for st in stages]
    params = {}
    for p in plans:
        for fqn, pp in p.params.items():
            if fqn in params and params[fqn].storage != pp.storage:
                raise ConfigError(f"{fqn} is read by two stages on the same ranks and stored differently in them "
                                  f"({params[fqn].storage} and {pp.storage}); plan it again")
            params.setdefault(fqn, pp)
    return dataclasses.replace(plans[0], params=params)

"""Build this rank's module of a pipelined plan: trace the microbatch graph, cut it into stages,
make every block's groups, lower this rank's stages (several under interleaved 1F1B), shard their
parameters, and hand the module a ``PipelineRunner`` (``autopar.runtime.pipeline``) for
``train_step`` and calls. A call in the other mode or with inputs of other shapes gets stages of
its own on first use (``PipelineVariants``): traced again, each stage planned on its sub-mesh with
every parameter it holds pinned where the plan stores it, cut on the plan's layers, lowered."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from autopar.codegen.stages import cut_stages, lower_stage, sent_specs, shared_params
from autopar.errors import ConfigError
from autopar.ir.losses import loss_position
from autopar.runtime.pipeline import PipelineRunner, make_stage_groups
from autopar.runtime.programs import Program
from autopar.sharding_spec.mesh import Mesh


def build_stage(model, traced, skeleton, graph, plan, mesh: Mesh, trace_call, example_call, *, device, timeout,
                state_dict, init_fn, bucket_bytes, signature, requires_grad, plan_config, precision):
    """This rank's ``ParallelModule`` of a pipelined ``plan``: its stages' programs and shards,
    with a ``PipelineRunner`` for ``train_step``. ``graph`` is the whole batch's trace of
    ``traced`` (the model as it computes, under ``precision``) on ``trace_call``, to tell which
    inputs the microbatches split; the stages run on the microbatch graph, traced here.
    ``skeleton``: a weightless copy of ``traced`` (``ir.precision.working_model``) for other calls."""
    from autopar.compose.programs import constants_of
    from autopar.ir import trace
    from autopar.runtime.materialize import in_precision, local_state
    from autopar.runtime.module import ParallelModule
    from autopar.solver.microbatches import microbatch_inputs
    from autopar.solver.receives import with_received

    count = plan.pipeline.microbatches
    mb_args, mb_kwargs = microbatch_inputs(*trace_call, count)
    micro = trace(traced, mb_args, mb_kwargs or None)
    plan.check_model(micro.fingerprint(), micro.model_name)
    plan = with_received(plan, micro)  # a plan file of schema version 3 or older has no receiving steps
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
    shards = in_precision(shards, micro, precision)
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
        norm_group=dist.group.WORLD, not_in_norm=not_in_norm, state=state, precision=precision, read_world=True,
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
    pm._ap.pipeline.variants = PipelineVariants(skeleton, plan, micro, pm, device, plan_config)
    return pm


@dataclasses.dataclass
class PipelineVariants:
    """Stages for calls the plan's do not fit (module docstring)."""

    skeleton: object  # the model without weights (``ir.precision.working_model``)
    plan: object  # the pipelined Plan
    micro: object  # the plan's microbatch graph
    pmodel: object
    device: object
    config: object  # the PlanConfig the plan was made under (its cluster is the plan mesh's)

    def build(self, training: bool, flat: list, rows: int):
        """A ``StageSet`` for a call in mode ``training`` on ``flat`` (the user inputs, flattened)
        cut into microbatches of ``rows`` samples; None where the trace is the plan's own graph."""
        import torch.utils._pytree as pytree

        from autopar.compose.programs import constants_of
        from autopar.ir.precision import fake_inputs
        from autopar.errors import TraceError
        from autopar.ir import trace
        from autopar.runtime.pipeline_call import StageSet

        runner = self.pmodel._ap.pipeline
        batch_dims = runner.batch_dims
        micro_flat = [x[:rows] if split else x for x, split in zip(flat, batch_dims)]
        args, kwargs = pytree.tree_unflatten(fake_inputs(self.skeleton, micro_flat), self.pmodel._ap.in_spec)
        was = self.skeleton.training
        self.skeleton.train(training)
        try:
            graph = trace(self.skeleton, tuple(args), dict(kwargs) or None)
        except TraceError as err:
            raise ConfigError(f"cannot trace {self.micro.model_name} in {'train' if training else 'eval'} mode for these "
                              f"inputs: {err}") from None
        finally:
            self.skeleton.train(was)
        if graph.fingerprint() == self.micro.fingerprint():
            return None
        plan = self._plan(graph)
        cuts = cut_stages(graph, plan)
        specs = sent_specs(graph, plan, cuts)
        groups = runner.sg.groups
        pm = self.pmodel
        programs = {}
        consts = constants_of(graph, self.device)
        for st in runner.sg.stages:
            low = lower_stage(graph, plan, cuts, specs, st, groups.mesh, self.device, synced_as=pm._ap.plan)
            slots = self._slots(graph, low)
            constants = {i: consts[ph] for i, ph in enumerate(low.state) if slots[i] is None}
            programs[st] = Program(graph, plan.pipeline.stages[st].plan, low, slots, constants, pm._ap.in_spec,
                                   pm._ap.out_spec)
        out_node = next(n for n in graph.nodes.values() if n.op == "output")
        from autopar.codegen.loss_weights import loss_denominators
        from autopar.ir.graph import needs_grad

        return StageSet(graph, plan, cuts, specs, programs, list(batch_dims), needs_grad(graph),
                        loss_denominators(graph, out_node.inputs[loss_position(graph)]))

    def _plan(self, graph):
        """The plan's stages over ``graph``: each stage planned on its sub-mesh (rank 0, sent to
        every rank) with the parameters it holds pinned, restricted to its layers' nodes."""
        from autopar.compose.programs import _pin, on_rank0
        from autopar.ir.blocks import unit_of_nodes
        from autopar.ir.graph import Role
        from autopar.solver import plan as make_plan
        from autopar.solver.pipeline import restrict
        from autopar.solver.receives import with_received

        def make():
            unit = unit_of_nodes(graph)
            stages = []
            for k, st in enumerate(self.plan.pipeline.stages):
                pins = {}
                for fqn, pp in st.plan.params.items():
                    node = (graph.buffers if pp.buffer else graph.params).get(fqn)
                    if node is not None:
                        pins[node] = _pin(pp.storage, pp.family)
                config = self.config.replace(force=pins, pipeline=None, memory_budget=None,
                                             idle_axes=tuple(st.plan.idle_axes), identical_axes=())
                whole = make_plan(self.skeleton, Mesh.from_dict(st.plan.mesh), graph=graph, config=config)
                nodes = {n for n, u in unit.items() if st.layers[0] <= u <= st.layers[1]}
                if k == 0:  # state nothing reads is held by the first stage (as cut_stages holds it)
                    nodes |= {n for n, node in graph.nodes.items()
                              if node.op == "placeholder" and node.role != Role.INPUT and not node.users}
                stages.append(dataclasses.replace(st, plan=restrict(whole, graph, nodes, st.time_per_microbatch_s,
                                                                     st.memory_bytes), received=None))
            return with_received(dataclasses.replace(self.plan, model_fingerprint=graph.fingerprint(),
                                                     pipeline=dataclasses.replace(self.plan.pipeline, stages=stages)),
                                 graph)

        return on_rank0(make)

    def _slots(self, graph, lowered) -> list:
        """The module slot feeding each of a program's state inputs (by the parameter it is)."""
        from autopar.ir.graph import Role

        fqn_of = {ph: fqn for fqn, ph in {**graph.params, **graph.buffers}.items()}
        slot_of = self.pmodel._ap.slot_of_fqn
        out = []
        for ph in lowered.state:
            if graph.nodes[ph].role == Role.CONSTANT:
                out.append(None)  # a lifted constant of this trace: the program's own
                continue
            if fqn_of.get(ph) not in slot_of:
                raise ConfigError(f"{fqn_of.get(ph, ph)} is read by the new trace but held by no stage of this rank")
            out.append(slot_of[fqn_of[ph]])
        return out


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

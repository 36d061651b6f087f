"""Building the programs a ParallelModule runs (``autopar.runtime.programs`` picks and feeds them).

``parallelize`` traces, plans and lowers the model for its example inputs in the model's mode:
the main program. A call in the other mode (``pmodel.eval()``: dropout off, batch norm on running
statistics, whatever the model's code does when ``self.training`` is False) or with inputs of
other shapes (a last partial batch, an evaluation batch) needs a program of its own, built on
first use and cached, like ``torch.compile``'s recompilation:

    trace       a weightless skeleton of the model (same modules, fake tensors: no memory) in that
                mode, on fake copies of the call's inputs;
    plan        rank 0 solves the layout with every parameter and buffer pinned to the storage the
                main plan gave it (so the shards stay where they are and the gradient reducer is
                unchanged), the main plan's idle axes, pricing mesh and op table; every rank
                receives the same plan. Shapes the main layout cannot split evenly simply get
                other (e.g. replicated) strategies for the ops they touch;
    lower       the program, whose state inputs map onto the main program's slots by name.

A new program costs one trace and one small ILP solve (seconds for the built-in models); the
number of programs is bounded by ``max_programs`` (a ConfigError beyond it says how to avoid it).
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist
import torch.nn as nn

from autopar.errors import ConfigError, PlanError, TraceError
from autopar.ir.graph import Role
from autopar.ir.precision import fake_inputs
from autopar.runtime.programs import Program

def plan_on_rank0(model, mesh, graph, config, example=((), None)):
    """Rank 0 plans ``graph`` (the trace of ``model`` called on ``example``: (inputs, kwargs)) under
    ``config``; every rank receives the same Plan (as JSON), or rank 0's error."""
    from autopar.solver import plan as make_plan

    return on_rank0(lambda: make_plan(model, mesh, example[0], example_kwargs=example[1], graph=graph, config=config))


def on_rank0(make):
    """``make()`` (a Plan) run on rank 0; every rank receives the same Plan (as JSON), or rank 0's
    error, of the same type where it is autopar's. A collective."""
    from autopar.solver.plan import Plan

    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", make().to_json())
        except Exception as err:  # every rank must hear of it, or they wait forever
            box[0] = ("error", (type(err).__name__, str(err)))
    dist.broadcast_object_list(box, src=0)
    status, payload = box[0]
    if status != "ok":  # the same error on every rank, of the same type where it is autopar's
        import autopar.errors

        name, message = payload
        cls = getattr(autopar.errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, autopar.errors.AutoparError)):
            cls, message = PlanError, f"planning failed on rank 0: {name}: {message}"
        raise cls(message)
    return Plan.from_json(payload)


def constants_of(graph, device) -> dict:
    """Lifted tensor constants (placeholders of role CONSTANT): their values, replicated."""
    from torch.export.graph_signature import InputKind

    out = {}
    for s in graph.exported.graph_signature.input_specs:
        if s.kind == InputKind.CONSTANT_TENSOR and s.arg.name in graph.nodes:
            value = graph.exported.constants[s.target]
            out[s.arg.name] = value.to(device) if device is not None else value
        elif s.kind == InputKind.CUSTOM_OBJ and s.arg.name in graph.nodes:
            raise ConfigError(f"{graph.model_name} uses a custom object ({s.target}); parallelize does not support it")
    return out


@dataclasses.dataclass
class VariantBuilder:
    """Everything needed to build the programs of calls the main program does not fit."""

    skeleton: nn.Module
    main_plan: object
    mesh: object  # the mesh the programs run on
    pricing_mesh: object  # the mesh (with its cluster) the main plan was priced on
    config: object  # the PlanConfig the main plan was made under (its cluster is the pricing mesh's)
    device: object
    max_programs: int  # built programs allowed beyond the main one (``parallelize(max_programs=)``)

    def build(self, mode: bool, args, kwargs, slot_of_fqn: dict, n_programs: int) -> Program | None:
        """The program for a call in ``mode`` with these inputs; None when its trace is the main
        program's own graph (a model whose code does not depend on the mode). ``n_programs``: how
        many are built already."""
        from autopar.codegen.lower import lower
        from autopar.ir import trace

        if n_programs >= self.max_programs:
            raise ConfigError(
                f"this call needs a new program (mode {'train' if mode else 'eval'}, new input shapes) but "
                f"{n_programs} are built already (max_programs={self.max_programs}); give the data loader fixed "
                "shapes (drop_last=True, padding to a few bucket lengths) or pass a larger max_programs to parallelize"
            )
        self.skeleton.train(mode)
        fake_args, fake_kwargs = fake_inputs(self.skeleton, (tuple(args), dict(kwargs)))
        try:
            graph = trace(self.skeleton, fake_args, fake_kwargs or None)
        except TraceError as err:
            raise ConfigError(f"cannot trace the model in {'train' if mode else 'eval'} mode for these inputs: {err}") from None
        if graph.fingerprint() == self.main_plan.model_fingerprint:
            return None
        plan = self._plan(graph)
        lowered = lower(graph, plan, self.mesh, device=self.device, synced_as=self.main_plan)
        fqn_of = {ph: fqn for fqn, ph in {**graph.params, **graph.buffers}.items()}
        slots = []
        for ph in lowered.state:
            role = graph.nodes[ph].role
            if role == Role.CONSTANT:
                slots.append(None)
            elif fqn_of.get(ph) in slot_of_fqn:
                slots.append(slot_of_fqn[fqn_of[ph]])
            else:
                raise ConfigError(f"the {'train' if mode else 'eval'}-mode trace reads {fqn_of.get(ph, ph)}, which the "
                                  "main program does not hold; parallelize the model in the mode it runs in")
        consts = constants_of(graph, self.device)
        constants = {i: consts[ph] for i, ph in enumerate(lowered.state) if slots[i] is None}
        spec = graph.exported.call_spec
        return Program(graph, plan, lowered, slots, constants, spec.in_spec, spec.out_spec)

    def _plan(self, graph):
        """The variant's plan: with the user's force where it still applies, else pins alone (a
        forced layout may not split the new shapes)."""
        user = self._user_force(graph)
        if user:
            try:
                plan = plan_on_rank0(self.skeleton, self.pricing_mesh, graph, self._config({**user, **self._pins(graph)}))
                self._check_same_storage(plan)
                return plan
            except (PlanError, ConfigError):
                pass
        plan = plan_on_rank0(self.skeleton, self.pricing_mesh, graph, self._config(self._pins(graph)))
        self._check_same_storage(plan)
        return plan

    def _config(self, force: dict):
        """The variant's config: one stage on the main plan's idle axes, no budget, ``force``.
        (The gradient convention is the variant's own: lower(synced_as=) hands each parameter's
        gradient to the main plan's reducer the way it syncs it.)"""
        return self.config.replace(force=force, pipeline=None, memory_budget=None,
                                   idle_axes=tuple(self.main_plan.idle_axes), identical_axes="auto")

    def _user_force(self, graph) -> dict:
        from autopar.solver.intra_op import view_mesh
        from autopar.solver.layout import Layout, layout_force

        force = self.config.force
        if isinstance(force, Layout):
            try:  # on the mesh the main plan used (its idle axes at size 1)
                return layout_force(graph, view_mesh(self.pricing_mesh, tuple(self.main_plan.idle_axes)), force)
            except (PlanError, ConfigError):
                return {}
        if isinstance(force, dict):
            return {k: v for k, v in force.items() if k in graph.nodes}
        return {}

    def _pins(self, graph) -> dict:
        """Every stored tensor keeps the storage (and gradient sync) the main plan gave it."""
        force = {}
        for fqn, pp in self.main_plan.params.items():
            node = (graph.params if not pp.buffer else graph.buffers).get(fqn)
            if node is not None:
                force[node] = _pin(pp.storage, pp.family)
        return force

    def _check_same_storage(self, plan) -> None:
        for fqn, pp in plan.params.items():
            main = self.main_plan.params.get(fqn)
            if main is None or (pp.storage, pp.family) != (main.storage, main.family):
                raise PlanError(f"the plan for these inputs moved {fqn} ({pp.storage} {pp.family}); its storage must not change")


def _pin(storage, family):
    return lambda s: s.output == storage and s.family == family

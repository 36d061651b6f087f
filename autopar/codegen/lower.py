"""Plan -> the per-rank program: a ``torch.fx.GraphModule`` that runs on local shards.

``lower(graph, plan, mesh)`` walks the traced graph in order and emits, for each node:

    parameter / buffer      a placeholder fed with this rank's storage shard (``Lowered.state``)
    user input              a placeholder fed with the FULL input, then ``autopar_shard_input``
                            keeps this rank's slice of it (the input node's planned spec)
    op                      for each input, the plan's resharding steps on that edge, one call per
                            step (``autopar_all_gather(x, axes=(0,), dim=1)``...), then the ATen op
                            with size arguments rewritten to local sizes, or the family's lowering
                            (``autopar.codegen.lowerings``)
    output                  the edges' steps to the spec the plan returns each output in (whole,
                            or split where training does not read it: ``Lowered.returned``), then
                            ``autopar_backward_seed`` on each differentiable output

The program names mesh axes, never ranks, so it is the same on every rank: which shard a rank holds
and which groups it talks to are bound at run time (``ops.bind``). Parameters are inputs of the
graph (as in torch.export), so the module that owns them (``ParallelModule``) keeps their original
names.

A later pipeline pass cuts the graph into stages on sub-meshes: ``nodes=`` lowers a subset. Values
the subset reads from outside become extra placeholders (``Lowered.boundary_inputs``, in their
producer's layout) and values read outside it extra outputs (``Lowered.boundary_outputs``), after
the user outputs when the subset holds the output node. The whole graph is the special case.
A pipeline stage's plan has no strategy for the values it receives: ``received=`` names the spec
each arrives in (its producer's, in the sending stage's plan), and every read of it reshards from
there to the spec its reader wants along the steps the plan gives that read (``received_edges=``,
the stage's ``StagePlan.received``: ``autopar.solver.receives``).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.codegen import ops
from autopar.codegen.lowerings import autopar_cross_entropy, lowering
from autopar.record.gradients import grad_sum_reads, identical_ok, output_whole_axes, whole_on
from autopar.record.gathers import grouped_route, param_gather_groups
from autopar.errors import ConfigError, PlanError
from autopar.ir.aliasing import in_place_reads, written_values
from autopar.ir.graph import NodeRef, Role
from autopar.ir.losses import counted_from_inputs, fused_cross_entropy
from autopar.sharding_spec.reshard import spec_after
from autopar.sharding_spec.rules._common import localize_args, norm_dim
from autopar.sharding_spec.spec import ShardingSpec
from autopar.sharding_spec.strategy import needs_lowering

STATE_ROLES = (Role.PARAMETER, Role.BUFFER, Role.CONSTANT)
# A view traced on a tensor whose strides happened to allow it (CPU SDPA returns its output laid out
# as (B, T, H, D), so the model's `.transpose(1, 2).contiguous()` traces as a bare transpose + view)
# may meet a fresh contiguous tensor from a collective here: reshape is that view whenever one exists,
# and a copy otherwise.
_VIEW_AS_RESHAPE = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                    torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


@dataclasses.dataclass
class Lowered:
    """The emitted program and what its placeholders expect, in order: ``state`` (placeholder
    names of parameters, buffers and constants, each fed its local shard), ``inputs`` (user
    inputs, fed whole), ``boundary_inputs`` (values made outside the node subset)."""

    gm: fx.GraphModule
    state: list[str]
    inputs: list[str]
    boundary_inputs: list[str]
    boundary_outputs: list[str]
    specs: dict[str, object]  # emitted node name -> the spec of its local value (None: not a tensor)
    # flat output index -> the spec an output is returned split in (the runtime gathers it when it is
    # first read: ``autopar.runtime.outputs``); every other output is whole
    returned: dict = dataclasses.field(default_factory=dict)

    @property
    def code(self) -> str:
        return self.gm.code


def lower(graph, plan, mesh, *, nodes=None, device: torch.device | None = None, received: dict | None = None,
          received_edges=(), synced_as=None) -> Lowered:
    """The program of ``plan`` for ``graph`` on ``mesh``, over ``nodes`` (names; default all).
    ``device``: where factory ops put new tensors (the traced device otherwise). ``received``:
    boundary value -> the spec it arrives in (default: the plan's spec of its producer).
    ``received_edges``: the plan's ``EdgePlan`` per read of a received value held in another spec
    than its reader wants.
    ``synced_as``: the plan whose gradient syncs the reducer runs (a program built for other
    inputs shares the main program's reducer); each parameter's gradient is handed over pending on
    exactly those axes (``autopar_grad_share`` / ``autopar_grad_sum`` where this plan's gradient
    convention leaves it otherwise)."""
    if tuple(plan.mesh["shape"]) != tuple(mesh.shape):
        raise PlanError(f"the plan is for a mesh of shape {tuple(plan.mesh['shape'])}, not {mesh}")
    subset = list(graph.nodes) if nodes is None else [n for n in graph.nodes if n in set(nodes)]
    return _Emitter(graph, plan, mesh, subset, device, dict(received or {}), received_edges, synced_as).run()


class _Emitter:
    def __init__(self, graph, plan, mesh, subset, device, received, received_edges=(), synced_as=None):
        self.graph, self.plan, self.mesh, self.device = graph, plan, mesh, device
        self.synced_as = synced_as
        self.param_of_node = {p.node: p for p in plan.params.values()}
        self.received = received
        self.received_edges = {(e.dst, e.position): e for e in received_edges}
        self.rereads: dict = {}  # (boundary value, wanted spec) -> its resharded node
        self.subset = subset
        self.inside = set(subset)
        self.fx = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.specs: dict[str, object] = {}
        self.edges = {(e.dst, e.position): e for e in plan.edges}
        self.state: list[str] = []
        self.inputs: list[str] = []
        self.boundary: list[str] = []
        self.param_groups, self.group_of = param_gather_groups(graph, plan.edges, self.inside)
        self.gathered: dict = {}
        self.origin: str | None = None  # the traced node being lowered
        # gradients whole on these axes (Megatron's convention): steps take that backward, and reads
        # an op splits get their gradient summed (``autopar.record.gradients``)
        self.identical = tuple(plan.identical_axes)
        why = identical_ok(plan, graph, self.identical)
        if why is not None:  # (the planner never makes such a plan; an edited or stale one may say so)
            raise PlanError(f"this plan cannot keep gradients whole on axes {self.identical}: {why}")
        self.sums = grad_sum_reads(plan, graph, self.identical)
        self.summed: dict = {}  # (value node name, axes) -> its grad_sum node
        self.returned: dict = {}  # flat output index -> the spec it is returned split in (``_output``)
        self.whole: dict[str, fx.Node | None] = {}  # traced value -> a node holding it whole (``_whole``)
        # reads that must see their producer's memory itself: an in-place write and the views on its way
        self.in_place = {(r, p) for r, p in in_place_reads(graph) if r in self.inside}
        self.written = written_values(graph, self.inside)

    # ---- driver ------------------------------------------------------------------------------
    def run(self) -> Lowered:
        placeholders = [n for n in self.subset if self.graph.nodes[n].op == "placeholder"]
        # State first, then user inputs in the traced (flattened call) order, then boundary values.
        for name in placeholders:
            if self.graph.nodes[name].role in STATE_ROLES:
                self._state(self.graph.nodes[name])
        for name in self.graph.inputs:
            if name in self.inside:
                self._input(self.graph.nodes[name])
        for name in self.subset:
            node = self.graph.nodes[name]
            for src in node.inputs:
                if src not in self.inside and src not in self.env:
                    self._boundary(src)
        outputs: list = []
        boundary_out = [n for n in self.subset if any(u not in self.inside for u in self.graph.nodes[n].users)]
        for name in self.subset:
            node = self.graph.nodes[name]
            self.origin = name
            if node.op == "call_function":
                self._op(node)
            elif node.op == "output":
                outputs = list(self._output(node))
            elif node.op == "get_attr":
                raise ConfigError(f"node {name} reads module attribute {node.target!r}; autopar's codegen does not lower get_attr yet")
        outputs += [self.env[n] for n in boundary_out]
        self.fx.output(tuple(outputs))
        self.fx.lint()
        gm = fx.GraphModule(torch.nn.Module(), self.fx, class_name="AutoparRankProgram")
        return Lowered(gm, self.state, self.inputs, self.boundary, boundary_out, self.specs, self.returned)

    def _plan_of(self, name):
        if name not in self.plan.nodes:
            raise PlanError(f"the plan has no strategy for node {name}; it was made for another graph")
        return self.plan.nodes[name]

    def _emit(self, fn, args, kwargs=None, *, name=None, spec=None) -> fx.Node:
        node = self.fx.create_node("call_function", fn, tuple(args), dict(kwargs or {}), name=name)
        node.meta["autopar_origin"] = self.origin  # the traced node it lowers (a pipeline stage splits by layer)
        self._note(node, spec)
        return node

    def _note(self, node: fx.Node, spec) -> None:
        self.specs[node.name] = spec
        node.meta["autopar_spec"] = spec
        if isinstance(spec, ShardingSpec):
            node.meta["autopar_local_shape"] = spec.local_shape(self.mesh)

    # ---- placeholders ------------------------------------------------------------------------
    def _state(self, node) -> None:
        ph = self.fx.placeholder(node.name)
        spec = self._plan_of(node.name).output
        self._note(ph, spec)
        self.env[node.name] = ph
        self.state.append(node.name)
        if self.synced_as is not None and node.role == Role.PARAMETER:
            self.env[node.name] = self._synced_like(ph, node.name, spec)

    def _synced_like(self, value: fx.Node, name: str, spec) -> fx.Node:
        """A parameter read with its gradient pending on exactly the axes ``synced_as`` syncs."""
        own = self.param_of_node.get(name)
        want = self.synced_as.params.get(own.name) if own is not None else None
        if own is None or want is None:
            return value
        have = set(own.grad_sync.axes) if own.grad_sync else set()
        need = set(want.grad_sync.axes) if want.grad_sync else set()
        if (have ^ need) - set(self.identical) - set(self.synced_as.identical_axes):
            raise PlanError(f"{own.name}: this program's gradient sync {sorted(have)} cannot be handed to the "
                            f"reducer's {sorted(need)}")
        if need - have:  # whole here, summed by the reducer: hand it one share
            value = self._emit(ops.autopar_grad_share, (value,), {"axes": tuple(sorted(need - have))},
                               name=f"{name}_grad_share", spec=spec)
        if have - need:  # pending here, not summed by the reducer: sum it now
            value = self._emit(ops.autopar_grad_sum, (value,), {"axes": tuple(sorted(have - need))},
                               name=f"{name}_grad_sum", spec=spec)
        return value

    def _input(self, node) -> None:
        ph = self.fx.placeholder(node.name)
        spec = self._plan_of(node.name).output
        self._note(ph, ShardingSpec.replicate(spec.shape, spec.mesh_ndim) if isinstance(spec, ShardingSpec) else None)
        self.inputs.append(node.name)
        self.whole[node.name] = ph
        if isinstance(spec, ShardingSpec) and not spec.is_replicated:
            kw = {"shape": tuple(spec.shape), "dim_axes": tuple(tuple(a) for a in spec.dim_axes)}
            self.env[node.name] = self._emit(ops.autopar_shard_input, (ph,), kw, name=f"{node.name}_shard", spec=spec)
        else:
            self.env[node.name] = ph

    def _boundary(self, name) -> None:
        ph = self.fx.placeholder(name)
        self._note(ph, self.received[name] if name in self.received else self._plan_of(name).output)
        self.env[name] = ph
        self.boundary.append(name)
        if name in self.written:
            self.env[name] = self._owned_copy(ph, name, *self.written[name])

    def _owned_copy(self, value: fx.Node, name: str, reader: str, pos: int) -> fx.Node:
        """A value made in another stage that this one writes into: this stage's own copy of it,
        in the spec its writer reads (a received tensor is a leaf of the stage's autograd graph,
        which an in-place write may not touch), read by every later op of the stage."""
        want = self._plan_of(reader).inputs[pos]
        have = self.specs.get(value.name)
        if isinstance(want, ShardingSpec) and isinstance(have, ShardingSpec) and have != want:
            value = self._received_steps(value, name, reader, pos, have, want)
        return self._emit(torch.ops.aten.clone.default, (value,), name=f"{name}_owned", spec=want if want is not None else have)

    # ---- edges -------------------------------------------------------------------------------
    def _reshard(self, value: fx.Node, src: str, dst: str, pos: int, want, whole=()) -> fx.Node:
        """``value`` (``src``'s output as ``dst`` reads it) after the plan's steps on that edge;
        ``whole``: axes on which the steps' output gradients are whole besides the plan's."""
        edge = self.edges.get((dst, pos))
        if edge is None and src in self.received:
            return self._reread(value, src, dst, pos, want)
        if edge is None:
            have = self.specs.get(value.name)
            if isinstance(want, ShardingSpec) and isinstance(have, ShardingSpec) and have != want:
                raise PlanError(f"{dst} reads {src} as {want} but it holds {have}, and the plan has no resharding edge")
            return value
        if edge.src != src:
            raise PlanError(f"the plan's edge into {dst} input {pos} comes from {edge.src}, but the graph reads {src}")
        have = self.specs.get(value.name)
        if have != edge.src_spec:
            raise PlanError(f"edge {src} -> {dst}: the plan starts from {edge.src_spec} but {src} holds {have}")
        if want is not None and edge.dst_spec != want:
            raise PlanError(f"edge {src} -> {dst}: the plan ends at {edge.dst_spec} but {dst} reads {want}")
        identical = tuple(sorted(set(self.identical) | set(whole)))
        if (dst, pos) in self.group_of:  # the group's one gather, then this read's local steps
            value = self._gathered_param(self.group_of[(dst, pos)], src)
            spec, steps = self.specs[value.name], [edge.steps[j] for j in grouped_route(edge.steps)[1]]
        else:
            spec, steps = edge.src_spec, edge.steps
        for step in steps:
            spec = spec_after(spec, step)
            fn = ops.STEP_FUNCTIONS[step.kind]
            value = self._emit(fn, (value,), ops.step_kwargs(step, identical), name=f"{src}_{step.kind}", spec=spec)
        if spec != edge.dst_spec:
            raise PlanError(f"edge {src} -> {dst}: the plan's steps end at {spec}, not at {edge.dst_spec}")
        return value

    def _reread(self, value: fx.Node, src: str, dst: str, pos: int, want) -> fx.Node:
        """A received value resharded to ``want`` (once per wanted spec, unless the stage writes
        into it: a copy made before the write must not serve a read after it)."""
        have = self.specs.get(value.name)
        if not isinstance(want, ShardingSpec) or not isinstance(have, ShardingSpec) or have == want:
            return value
        if (src, want) not in self.rereads or src in self.written:
            self.rereads[(src, want)] = self._received_steps(value, src, dst, pos, have, want)
        return self.rereads[(src, want)]

    def _received_steps(self, value: fx.Node, src: str, dst: str, pos: int, have, want) -> fx.Node:
        """``value`` (``src``, received, held in ``have``) after the plan's steps for ``dst``'s
        read at ``pos``, which end at ``want``."""
        edge = self.received_edges.get((dst, pos))
        if edge is None:
            raise PlanError(f"{dst} reads {src} (received in {have}) as {want}, but the stage's plan has no steps "
                            "for that read; plan again (autopar.solver.receives.with_received fills older plans)")
        if edge.src != src or edge.src_spec != have or edge.dst_spec != want:
            raise PlanError(f"the stage plan's steps into {dst} input {pos} go from {edge.src} in {edge.src_spec} to "
                            f"{edge.dst_spec}, but the graph reads {src} held in {have} as {want}")
        spec = have
        for step in edge.steps:
            spec = spec_after(spec, step)
            value = self._emit(ops.STEP_FUNCTIONS[step.kind], (value,), ops.step_kwargs(step, self.identical),
                               name=f"{src}_{step.kind}", spec=spec)
        if spec != want:
            raise PlanError(f"the stage plan's steps from {src} into {dst} end at {spec}, not at {want}")
        return value

    def _gathered_param(self, key, param: str) -> fx.Node:
        """``param`` gathered whole along ``key``'s axes, by the one collective that gathers every
        parameter of its group (emitted at the group's first use)."""
        if (key, param) not in self.gathered:
            members = self.param_groups[key]  # [(param, edge)]
            axes = key[1]
            gathers = [e.steps[grouped_route(e.steps)[0]] for _, e in members]
            dims = tuple(g.src_dim for g in gathers)
            kw = {"axes": axes, "dims": dims}
            if whole_on(axes, self.identical):
                kw["whole"] = True
            call = self._emit(ops.autopar_all_gather_group, tuple(self.env[p] for p, _ in members), kw,
                              name=f"{members[0][0]}_group_all_gather")
            for i, ((p, e), g) in enumerate(zip(members, gathers)):
                self.gathered[(key, p)] = self._emit(operator.getitem, (call, i), name=f"{p}_all_gather",
                                                     spec=spec_after(e.src_spec, g))
        return self.gathered[(key, param)]

    def _read_inputs(self, node, node_plan) -> list[fx.Node]:
        vals = []
        for pos, src in enumerate(node.inputs):
            want = node_plan.inputs[pos] if pos < len(node_plan.inputs) else None
            value = self._reshard(self.env[src], src, node.name, pos, want)
            axes = self.sums.get((node.name, pos))
            if axes:  # one sum per value and axes, shared by every op that splits them reading it
                if (value.name, axes) not in self.summed:
                    self.summed[(value.name, axes)] = self._emit(ops.autopar_grad_sum, (value,), {"axes": axes},
                                                                 name=f"{value.name}_grad_sum", spec=want)
                value = self.summed[(value.name, axes)]
            if (node.name, pos) in self.in_place and value is not self.env[src]:
                raise PlanError(f"{node.name} ({node.target}) writes into {src} in place, but the plan reads {src} "
                                f"in {want}, not in the {self.specs.get(self.env[src].name)} it is held in: the write "
                                "would land in a copy. Plans must read a written tensor (and the views on its way) as held")
            vals.append(value)
        return vals

    # ---- ops -----------------------------------------------------------------------------------
    def _op(self, node) -> None:
        node_plan = self._plan_of(node.name)
        fx_target = node.fx_node.target
        if not any((node.name, p) in self.in_place for p in range(len(node.inputs))):
            fx_target = _VIEW_AS_RESHAPE.get(fx_target, fx_target)  # a view written through must stay a view
        if node.target == "operator.getitem" and isinstance(self.graph.nodes[node.inputs[0]].meta, tuple):
            # Pick the element first: the edge's steps act on it, not on the tuple.
            src = node.inputs[0]
            item = self._emit(operator.getitem, (self.env[src], node.args[1]), name=node.name,
                              spec=_element(self.specs.get(self.env[src].name), node.args[1]))
            self.env[node.name] = self._reshard(item, src, node.name, 0, node_plan.inputs[0])
            return
        vals = self._read_inputs(node, node_plan)
        feed = iter(vals)
        args = _subst(tuple(node.args), feed, self.device)
        kwargs = _subst(dict(node.kwargs), feed, self.device)
        if needs_lowering(node_plan.family):
            fn, extra, how = lowering(node, node_plan, self.graph, self.identical)
            if counted_from_inputs(self.graph, node):  # a class mean counting the batch's targets
                whole = self._whole(node.inputs[1])
                if whole is not None:  # else its lowering all-reduces the ranks' counts
                    extra = {**extra, "whole_target": whole}
            if how == "packed":
                out = self._emit(fn, (node.target, args, kwargs), extra, name=node.name, spec=node_plan.output)
            else:
                out = self._emit(fn, args, {**kwargs, **extra}, name=node.name, spec=node_plan.output)
        else:
            args, kwargs = localize(node, node_plan, args, kwargs, self.mesh)
            if fused_cross_entropy(self.graph, node):  # its classes whole here: no logits-sized gradients made
                fx_target = autopar_cross_entropy
            out = self._emit(fx_target, args, kwargs, name=node.name, spec=node_plan.output)
        self.env[node.name] = out

    def _whole(self, name: str) -> fx.Node | None:
        """A node holding traced value ``name`` whole on every rank, or None where this program
        cannot make one: a user input (before its shard is taken), a value held replicated, or an op
        of the program on such values, emitted again on them (the few ops between a user input and a
        loss's targets: ``ir.losses.counted_from_inputs``)."""
        if name not in self.whole:
            value = self.env.get(name)
            spec = self.specs.get(value.name) if value is not None else None
            node = self.graph.nodes[name]
            if isinstance(spec, ShardingSpec) and spec.is_replicated:
                self.whole[name] = value
            elif node.op == "call_function" and name in self.inside:
                ins = [self._whole(i) for i in node.inputs]
                self.whole[name] = None
                if all(v is not None for v in ins):
                    feed = iter(ins)
                    args, kwargs = _subst(tuple(node.args), feed, self.device), _subst(dict(node.kwargs), feed, self.device)
                    self.whole[name] = self._emit(node.fx_node.target, args, kwargs, name=f"{name}_whole")
            else:
                self.whole[name] = None
        return self.whole[name]

    def _output(self, node):
        """The graph's outputs in the specs the plan returns them in (whole, or split where
        training does not read them: ``Lowered.returned``), each with its backward seed. Every
        rank seeds an output with the same gradient, so on the axes its own gathers and
        all-reduces run over the seed is whole: their backwards keep a chunk or nothing (not a
        reduce-scatter or an all-reduce of a seed held by one rank, as the dual layout would; DDP's
        loss has no collective at all). An output returned split is gathered later, by the runtime
        (``autopar.runtime.outputs``): its seed is whole on the axes that gather runs over too."""
        node_plan = self._plan_of(node.name)
        base = set(self.plan.idle_axes) | set(self.identical)
        seeded, split = [], {}
        for pos, src in enumerate(node.inputs):
            want = node_plan.inputs[pos] if pos < len(node_plan.inputs) else None
            edge = self.edges.get((node.name, pos))
            steps = edge.steps if edge is not None and (node.name, pos) not in self.group_of else ()
            gathered = set(output_whole_axes(steps))
            v = self._reshard(self.env[src], src, node.name, pos, want, whole=tuple(sorted(gathered)))
            if isinstance(want, ShardingSpec) and not want.is_replicated:
                gathered |= {a for ax in want.dim_axes for a in ax}
            whole = tuple(sorted(base | gathered))
            if _is_float_tensor(self.graph.nodes[src].meta):
                v = self._emit(ops.autopar_backward_seed, (v,), {"idle_axes": whole} if whole else None,
                               name=f"{v.name}_out", spec=self.specs.get(v.name))
            if isinstance(want, ShardingSpec) and not want.is_replicated:
                split[v] = want
            seeded.append(v)
        structure = node.args[0] if len(node.args) == 1 else node.args
        flat = _subst(structure, iter(seeded), self.device)
        flat = flat if isinstance(flat, (tuple, list)) else (flat,)
        self.returned = {i: split[v] for i, v in enumerate(flat) if isinstance(v, fx.Node) and v in split}
        return flat


# ---- helpers --------------------------------------------------------------------------------------
def _element(spec, i):
    return spec[i] if isinstance(spec, tuple) and isinstance(i, int) else None


def _is_float_tensor(meta) -> bool:
    return meta is not None and not isinstance(meta, tuple) and meta.dtype in ("float16", "bfloat16", "float32", "float64")


def _subst(value, feed, device):
    """``value`` with every NodeRef replaced, in reading order, by the next item of ``feed``, and
    every torch.device by ``device`` (when given)."""
    if isinstance(value, NodeRef):
        return next(feed)
    if isinstance(value, list):
        return [_subst(v, feed, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_subst(v, feed, device) for v in value)
    if isinstance(value, dict):
        return {k: _subst(v, feed, device) for k, v in value.items()}
    if device is not None and isinstance(value, torch.device):
        return device
    return value


def localize(node, node_plan, args, kwargs, mesh):
    """Size arguments rewritten to local sizes (see ``rules._common.LOCAL_SIZE_ARGS``), plus
    ``narrow`` over a split dim (allowed only when it keeps the whole dim: length -> local size)."""
    out = node_plan.output
    if isinstance(out, ShardingSpec):
        args, kwargs = localize_args(node.target, args, kwargs, out, mesh)
    if node.target == "aten.narrow.default":
        spec = node_plan.inputs[0]
        dim = norm_dim(int(args[1]), spec.ndim)
        if spec.dim_axes[dim]:
            args = args[:3] + (spec.local_shape(mesh)[dim],) + tuple(args[4:])
    return args, kwargs

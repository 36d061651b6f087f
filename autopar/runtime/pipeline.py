"""Run a pipelined plan: this rank's stage, driven by torch's pipeline schedules.

The stages come from ``autopar.codegen.stages`` (what each runs, receives and sends). Each stage
runs on a block of mesh rows (a sub-mesh with its own ``MeshGroups``); rank ``c`` of every stage
(its position inside the stage) forms a pipeline group with the rank ``c`` of the others, so
activations travel point to point between ranks at the same position, each as the local shard it
is in.

Execution is ``torch.distributed.pipelining``: a ``PipelineStage`` over a module that runs the
stage's program, and ``ScheduleGPipe`` / ``Schedule1F1B``. Static shapes are given, so no
metadata round trips happen. A step (``train_step``) runs every microbatch under the reducer's
``no_sync``, and synchronises gradients once: where a rank runs one stage under GPipe or 1F1B, from
the backward of the last microbatch (its last backward), each bucket launched as soon as its
gradients are complete, overlapped with the rest of that backward, as DDP does under torch's
schedules, and waited for after the schedule (so the stage sends its input gradient first: the
stage before waits for it); under interleaved and zero-bubble schedules (several stages per rank,
or a weight half outside the taps), launched after the schedule. A parameter read by several
stages (a tied embedding and head) then sums its gradient over them. The loss is each
microbatch's loss weighed by ``loss_weights`` (1 / m; a mean over counted targets, such as a cross
entropy ignoring padding, by its share of the batch's count; the schedule does not scale again),
summed over microbatches, then over the last stage's data-parallel ranks (``Program.loss_only``
leaves that sum to the step), and sent to every rank. A stage the plan recomputes runs each of its
layers under ``torch.utils.checkpoint`` (the program split by layer): a microbatch in flight keeps
only each layer's inputs.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from autopar.codegen import ops
from autopar.codegen.loss_weights import loss_denominators
from autopar.codegen.stages import sent_specs
from autopar.ir.graph import needs_grad
from autopar.record.schedules import schedule_named
from autopar.errors import ConfigError
from autopar.ir.blocks import unit_of_nodes
from autopar.runtime.pipeline_call import PipelineCall, StageSet, microbatch_rows
from autopar.runtime.process_groups import MeshGroups
from autopar.runtime.programs import start_loss_sum
from autopar.runtime.stage_program import StageProgram, loss_weights
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.spec import ShardingSpec


@dataclasses.dataclass
class StageGroups:
    """This rank's process groups under a pipelined plan. The stages run on ``blocks`` blocks of
    rows, stage s on block s mod blocks (one stage per block, or ``virtual_stages`` for
    interleaved 1F1B); this rank is in block ``block`` and runs ``stages``. ``groups``: its block's
    ``MeshGroups``; the pipeline group: the rank at the same position in every block; ``shared``:
    frozenset of blocks -> the group of this rank's position in them (None when not in it), for
    parameters several blocks hold."""

    block: int
    blocks: int
    stages: list[int]
    groups: MeshGroups
    pp_group: object
    pp_ranks: list[int]
    shared: dict


def make_stage_groups(plan, mesh: Mesh, shared_blocks, timeout=None) -> StageGroups:
    """Every block's groups, made by every rank in the same order (``new_group`` is collective)."""
    stages = plan.pipeline.stages
    n_blocks = len(stages) // plan.pipeline.virtual_stages
    blocks = [stages[b].ranks for b in range(n_blocks)]
    sizes = {len(r) for r in blocks}
    if len(sizes) != 1:
        raise ConfigError(f"the plan's stages have {[len(r) for r in blocks]} devices; torch's pipeline schedules "
                          "pair each rank with one per stage, so every stage needs as many devices (plan with "
                          "autopar.plan(..., pipeline=...) for parallelize: it plans equal stages)")
    if any(st.ranks != blocks[s % n_blocks] for s, st in enumerate(stages)):
        raise ConfigError("the plan's stages do not cycle over the same blocks of ranks (stage s on block s mod blocks)")
    views = [(s, tuple(st.mesh_shape), tuple(stages[s % n_blocks].mesh_shape)) for s, st in enumerate(stages)]
    mixed = [(s, v, first) for s, v, first in views if v != first]
    if mixed:
        s, v, first = mixed[0]
        raise ConfigError(f"the plan's stage {s} views its ranks as a {v} mesh and stage {s % n_blocks}, on the same ranks, "
                          f"as {first}: a rank's stages run on one set of process groups; plan again")
    me = dist.get_rank()
    mine = None
    for b, ranks in enumerate(blocks):
        shape = tuple(stages[b].mesh_shape)  # the stage's own view of its devices (the search may reshape them)
        names = mesh.axis_names if len(shape) == mesh.ndim else None
        g = MeshGroups(Mesh(shape, names, mesh.cluster), ranks=ranks, timeout=timeout)
        if g.member:
            mine = (b, g)
    if mine is None:
        raise ConfigError(f"rank {me} is in no stage of the plan (stages cover ranks {[r for b in blocks for r in b]})")
    b, groups = mine
    position = groups.rank
    pp_group, pp_ranks = None, []
    for c in range(sizes.pop()):
        ranks = [blk[c] for blk in blocks]
        pg = dist.new_group(ranks=ranks, timeout=groups.timeout)
        if c == position:
            pp_group, pp_ranks = pg, ranks
    shared = {}
    for members in sorted(shared_blocks, key=sorted):
        for c in range(len(blocks[0])):
            pg = dist.new_group(ranks=[blocks[t][c] for t in sorted(members)], timeout=groups.timeout)
            if c == position:
                shared[members] = pg if b in members else None
    return StageGroups(b, n_blocks, list(range(b, len(stages), n_blocks)), groups, pp_group, pp_ranks, shared)


_STAGE_CLASSES: dict = {}


def _chunk_stage():
    """``PipelineStage`` that tells its ``StageProgram`` which microbatch it runs."""
    if "chunk" not in _STAGE_CLASSES:
        from torch.distributed.pipelining import PipelineStage

        class ChunkStage(PipelineStage):
            def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
                self.submod.chunk = fwd_chunk_id
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

            def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
                self.submod.chunk = bwd_chunk_id
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

            def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
                # the input gradients go out point to point, which takes contiguous tensors (the
                # gradient of an input read transposed keeps the transpose's layout)
                grads, groups = self._backward(backward_type, bwd_kwargs, last_backward)
                return tuple(g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads), groups

            def _backward(self, backward_type, bwd_kwargs: dict, last_backward: bool):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

        _STAGE_CLASSES["chunk"] = ChunkStage
    return _STAGE_CLASSES["chunk"]


def _split_backward_stage():
    """``_chunk_stage`` whose backward splits into an input half and a weight half (what torch's
    zero-bubble schedules run), through autopar's gradient taps.

    torch finds each weight's branch of the stage's autograd graph from ``submod.parameters()``.
    autopar's stage module owns no parameters, and the program reads them through the reducer's
    taps (leaves whose gradients go to the reducer). So under this stage the program reads every
    parameter through a view of its own (``StageProgram.weight_reads``): torch's input half runs as is with those views as the
    weights (it computes the stage's input gradients only, keeping the gradients where each
    weight's branch leaves that path); the weight half (``backward_weights``) computes each view's
    gradient from them and hands it to the reducer's bucket, or to ``.grad`` for a parameter no
    collective synchronises."""
    if "split" not in _STAGE_CLASSES:
        from torch.distributed.pipelining._backward import stage_backward_input

        class SplitBackwardStage(_chunk_stage()):
            def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
                self.submod.chunk = bwd_chunk_id
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

            def _backward(self, backward_type, bwd_kwargs: dict, last_backward: bool):
                reads = self.submod.weight_reads
                if backward_type == "input":
                    views = [v for _, v in reads[self.submod.chunk]]
                    return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                                bwd_kwargs["input_values"], iter(views))
                if backward_type == "weight":
                    backward_weights(self.submod.pmodel, reads.pop(self.submod.chunk), bwd_kwargs["param_groups"])
                    return (), None
                reads.pop(self.submod.chunk, None)  # the first stage's whole backward reaches the taps itself
                return super()._backward(backward_type, bwd_kwargs, last_backward)

        _STAGE_CLASSES["split"] = SplitBackwardStage
    return _STAGE_CLASSES["split"]


def backward_weights(pmodel, reads: list, param_groups: list) -> None:
    """The weight half of a split backward. ``reads``: (state slot, the view the program read)
    per parameter; ``param_groups``: torch's input half's record, per group of weights (views)
    the nodes where their branches left the input path and the gradients those nodes received.
    Per group, as torch does: one ``autograd.grad`` from those nodes to the group's views
    (intermediates clamped to their saved gradients when there are several, so none counts
    twice); the gradients go, in one hand-off, where a backward through the views would have sent
    them."""
    from torch.autograd.graph import GradientEdge

    slot_of = {v.grad_fn: slot for slot, v in reads}
    found = {}
    for nodes, saved, inters in _disjoint(param_groups):
        edges, grads = [], []
        for grads_in, node in zip(saved, inters):
            for i, g in enumerate(grads_in or ()):  # None: no gradient reached this intermediate
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        handles = [node.register_prehook(lambda _, kept=grads_in: kept) for grads_in, node in zip(saved, inters)] \
            if len(inters) > 1 else []
        try:
            dws = torch.autograd.grad(edges, [GradientEdge(n, 0) for n in nodes], grad_outputs=grads, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        found.update((slot_of[n], dw) for n, dw in zip(nodes, dws) if dw is not None)
    pmodel._ap.reducer.accumulate(found, pmodel._ap.slots)


def _disjoint(param_groups: list) -> list[tuple[list, list, list]]:
    """torch's groups merged where they share a weight or an intermediate (torch's grouping can
    leave a weight in two groups), as (weights, saved gradients, intermediates); groups no
    gradient reached are dropped."""
    parent = list(range(len(param_groups)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner = {}
    for i, group in enumerate(param_groups):
        for node in [*group["params"], *group.get("intermediates", [])]:
            if node in owner:
                parent[root(i)] = root(owner[node])
            else:
                owner[node] = i
    merged: dict = {}
    for i, group in enumerate(param_groups):
        saved = group.pop("grads", None)
        inters = group.pop("intermediates", [])
        nodes, grads, seen = merged.setdefault(root(i), ([], [], set()))
        nodes.extend(n for n in group["params"] if n not in nodes)
        for g, node in zip(saved or [], inters):
            if node not in seen:  # the same intermediate in two of torch's groups: one saved gradient
                seen.add(node)
                grads.append((g, node))
    out = []
    for nodes, grads, _ in merged.values():
        if grads:
            out.append((nodes, [g for g, _ in grads], [n for _, n in grads]))
    return out


def _same_sync(a, b) -> bool:
    """Whether two stages synchronise a parameter's gradient alike (bytes aside): both not at all,
    or by the same collective, split or not, over the same axes."""
    if a is None or b is None:
        return a is b
    return (a.sum_by, a.split, a.axes) == (b.sum_by, b.split, b.axes)


class PipelineRunner:
    """This rank's part of a pipelined plan (see the module docstring); ``ParallelModule.train_step``
    calls ``step``."""

    def __init__(self, pmodel, graph, plan, programs: dict, cuts, sg: StageGroups, shared: dict, device,
                 loss_index: int, batch_dims: list[bool]):
        from torch.distributed import pipelining

        self.pmodel, self.graph, self.plan, self.sg = pmodel, graph, plan, sg
        self.shared = shared  # placeholder -> the stages that read it
        self.device = device
        self.stages = len(plan.pipeline.stages)
        self.microbatches = plan.pipeline.microbatches
        self.loss_index = loss_index
        self.batch_dims = batch_dims  # per user input: split into microbatches along dim 0
        self.first, self.last = 0 in sg.stages, self.stages - 1 in sg.stages
        fqn_of = {ph: fqn for fqn, ph in {**graph.params, **graph.buffers}.items()}
        self.owner = {}  # canonical name -> the first stage holding it
        for c in cuts:
            for n in c.nodes:
                if n in fqn_of:
                    self.owner.setdefault(fqn_of[n], c.index)
        specs = sent_specs(graph, plan, cuts)
        self.grad_values = needs_grad(graph)  # what travels with a gradient between stages
        unit_of = unit_of_nodes(graph)
        mesh = sg.groups.mesh
        out_node = next(n for n in graph.nodes.values() if n.op == "output")
        # what a call of the module (``pipeline_call``) builds its own stage modules from
        self.unit_of = unit_of
        # how microbatch losses are weighed (a mean over counted targets: by their counts); every
        # rank computes the weights, so that a step that cannot be weighed fails on all of them
        self.denominators = loss_denominators(graph, out_node.inputs[loss_index])
        self.main_set = StageSet(graph, plan, cuts, specs, programs, list(batch_dims), self.grad_values, self.denominators)
        self.calls: dict = {}  # (mode, microbatch shapes) -> its PipelineCall
        self.variants = None  # builds the stages of calls the main ones do not fit (compose.pipeline sets it)
        planned = schedule_named(plan.pipeline.schedule)
        if not planned.recompute and any(st.recompute for st in plan.pipeline.stages):
            raise ConfigError(f"this plan recomputes stages under the {planned.name} schedule, whose split backward would "
                              "recompute once per group of weights; plan it again (autopar.Pipeline refuses the pair)")
        self.modules, self.pipeline_stages = [], []
        for s in sg.stages:
            cut, last = cuts[s], s == self.stages - 1
            module = StageProgram(pmodel, programs[s], cut, last, plan.pipeline.stages[s].recomputed, unit_of,
                                   split_backward=planned.split_backward)
            inputs = tuple(self._example(v, specs, mesh) for v in cut.receives)
            outputs = tuple(self._example(v, {} if last else specs, mesh)
                            for v in ([out_node.inputs[loss_index]] if last else cut.sends))
            self.modules.append(module)
            stage_cls = _split_backward_stage() if planned.split_backward else _chunk_stage()
            self.pipeline_stages.append(stage_cls(module, s, self.stages, device, input_args=inputs,
                                                  output_args=outputs, group=sg.pp_group))
        m = self.microbatches
        schedule = planned
        if not schedule.takes(self.stages, m) and schedule.fallback:  # (1F1B: GPipe's order for fewer microbatches)
            schedule = schedule_named(schedule.fallback)
        schedule_cls = getattr(pipelining, schedule.torch_class)

        def loss_fn(output, weight):  # the last stage's (loss,); ``weight``: this microbatch's slice of ``loss_weights``
            out = output[0] if isinstance(output, (tuple, list)) else output
            return out * weight[0].to(out.dtype)

        chunks = tuple(pipelining.microbatch.TensorChunkSpec(0) if split else pipelining.microbatch._Replicate
                       for split in batch_dims)
        stages = self.pipeline_stages if schedule.multi_stage else self.pipeline_stages[0]
        if not schedule.multi_stage and len(self.modules) == 1:  # its last backward is microbatch m - 1's
            self.modules[0].sync_chunk = m - 1
        self.schedule = schedule_cls(stages, m, loss_fn=loss_fn, args_chunk_spec=chunks, scale_grads=False)

    def check_call(self, training: bool, flat: list) -> None:
        """A step's inputs are the traced microbatch's, ``microbatches`` times longer along the
        batch dim, in the traced mode."""
        if training != self.pmodel._ap.mode:
            raise ConfigError(f"this pipeline was built for {'training' if self.pmodel._ap.mode else 'eval'} mode; "
                              "call train_step in that mode (a pipelined plan builds no program for the other)")
        for name, x, split in zip(self.graph.inputs, flat, self.batch_dims):
            meta = self.graph.nodes[name].meta
            if not isinstance(x, torch.Tensor):
                raise ConfigError(f"input {name}: a pipelined model takes tensors only, got {type(x).__name__}")
            want = tuple(meta.shape)
            if split:
                want = (want[0] * self.microbatches, *want[1:])
            if tuple(x.shape) != want or str(x.dtype).removeprefix("torch.") != meta.dtype:
                raise ConfigError(f"input {name} has shape {tuple(x.shape)} and dtype {x.dtype}; this pipeline was built "
                                  f"for {want} and {meta.dtype} ({self.microbatches} microbatches); parallelize again "
                                  "for other shapes")

    @torch.no_grad()
    def across_stages(self, local: dict, keys: list[str], canonical: dict) -> dict:
        """``local`` (canonical name -> this stage's full tensor, or None) completed with every
        other stage's, under ``keys``; each tensor sent by the first rank of the first stage that
        holds it. A collective over every rank."""
        out, sent = {}, {}
        for key in keys:
            canon = canonical.get(key, key)
            if canon not in sent:
                owner = self.owner.get(canon)
                if owner is None:
                    continue
                ph = self.graph.params.get(canon) or self.graph.buffers.get(canon)
                meta = self.graph.nodes[ph].meta
                src = self.plan.pipeline.stages[owner].ranks[0]
                here = owner in self.sg.stages
                mine = local.get(canon) if here else None
                flag = torch.tensor([0 if here and mine is None else 1], device=self.device)
                dist.broadcast(flag, src=src)
                if not flag.item():
                    sent[canon] = None
                else:
                    t = (mine.detach().clone() if mine is not None else
                         torch.empty(tuple(meta.shape), dtype=self.pmodel._ap.held_dtype(self.graph, ph),
                                     device=self.device))
                    dist.broadcast(t, src=src)
                    sent[canon] = t
            out[key] = sent[canon]
        return out

    def _example(self, v: str, specs: dict, mesh) -> torch.Tensor:
        meta = self.graph.nodes[v].meta
        dtype = getattr(torch, meta.dtype)
        spec = specs.get(v)
        shape = spec.local_shape(mesh) if isinstance(spec, ShardingSpec) else tuple(meta.shape)
        # Values computed from parameters carry gradients between stages (static metadata says so);
        # masks, positions and integer tensors made from the inputs do not.
        return torch.empty(shape, dtype=dtype, device=self.device, requires_grad=v in self.grad_values)

    def call(self, training: bool, flat_inputs: list) -> list:
        """The module called on ``flat_inputs`` (the user inputs, flattened) in mode ``training``:
        its flat outputs on every rank, differentiable (``autopar.runtime.pipeline_call``): on the
        stages built for the plan, or on stages built for this mode and these shapes on first use."""
        rows = microbatch_rows(flat_inputs, self.batch_dims, self.main_set.micro)
        key = (bool(training), rows, tuple((tuple(x.shape[1:]) if split else tuple(x.shape), x.dtype)
                                           if isinstance(x, torch.Tensor) else ("value", repr(x))
                                           for x, split in zip(flat_inputs, self.batch_dims)))
        if key not in self.calls:
            if training == self.pmodel._ap.mode and rows == self.main_set.micro and self.main_set.takes(flat_inputs):
                stage_set = self.main_set
            elif self.variants is None:
                raise ConfigError(f"{self.graph.model_name}'s pipelined module was built for {self.main_set.describe()}; "
                                  "this call needs stages of its own, which a module built from a given plan cannot make")
            else:
                stage_set = self.variants.build(training, flat_inputs, rows) or self.main_set
            same = next((d for d in self.calls.values() if d.stage_set is stage_set), None)
            self.calls[key] = same or PipelineCall(self, stage_set)
        return self.calls[key](flat_inputs)

    def step(self, flat_inputs: list) -> torch.Tensor:
        """Forward and backward of the whole batch ``flat_inputs`` (the user inputs, flattened);
        gradients synchronised; the loss on every rank."""
        ap = self.pmodel._ap
        losses: list = []
        args = flat_inputs if self.first else ()
        weights = self.loss_weights(flat_inputs)
        kwargs = dict(target=weights, losses=losses) if self.last else {}
        with ap.reducer.no_sync(), ap.reducer.deferred_waits():
            self.schedule.step(*args, return_outputs=False, **kwargs)
        loss, summed = None, lambda: None
        if self.last:  # this rank's parts of the microbatches' losses (``Program.loss_only``), summed once
            axes = next(m for m in self.modules if m.last).feeds.loss_sum_axes
            loss, summed = start_loss_sum(torch.stack([x.detach() for x in losses]).sum(), axes, ap.groups)
        ap.reducer.synchronize()
        self._sum_shared_grads()
        summed()
        if loss is None:
            out_meta = next(n for n in self.graph.nodes.values() if n.op == "output").inputs[self.loss_index]
            loss = torch.zeros((), dtype=getattr(torch, self.graph.nodes[out_meta].meta.dtype), device=self.device)
        dist.broadcast(loss, src=self.sg.pp_ranks[(self.stages - 1) % self.sg.blocks], group=self.sg.pp_group)
        return loss

    def loss_weights(self, flat_inputs: list, microbatches: int | None = None) -> torch.Tensor:
        """What each microbatch's loss weighs in the step's (``loss_weights``)."""
        m = self.microbatches if microbatches is None else microbatches
        return loss_weights(self.denominators, self.batch_dims, flat_inputs, m, self.device)

    @torch.no_grad()
    def _sum_shared_grads(self) -> None:
        """A parameter read by several stages (a tied embedding and head) holds a copy in each:
        their gradients are summed. Where every stage that reads it stores it alike (the same
        storage and gradient sync on sub-meshes of one shape: each rank's shard, ZeRO-2 chunk
        included, is the same piece of it as its peers'), the shards are summed as they are; else
        whole tensors (gathered within the stage, summed, sliced again)."""
        if not self.sg.shared:
            return
        pm = self.pmodel
        ap = pm._ap
        fqn_of = {ph: fqn for fqn, ph in ap.graph.params.items()}
        groups = ap.groups
        blocks_of = {ph: frozenset(s % self.sg.blocks for s in st) for ph, st in self.shared.items()}
        alike = self._tied_alike
        # the other shared parameters' gradients alone, whole (a collective inside the stage where
        # ZeRO-2 chunks are: all of them gathered, every parameter's gradient crossed the stage each step)
        grads = pm._storage_shards(grads=True, names={fqn_of[ph] for ph in self.shared if ph in fqn_of} - alike)
        held = pm.local_state()
        for members in sorted({b for b in blocks_of.values() if len(b) > 1}, key=sorted):
            pg = self.sg.shared.get(members)
            names = sorted(fqn_of[ph] for ph, b in blocks_of.items() if b == members)
            if pg is None:
                continue
            for fqn in names:
                local = held[fqn]
                if fqn in alike:
                    g = local.grad if local.grad is not None else torch.zeros_like(local)
                    g = g if g.is_contiguous() else g.contiguous()
                    dist.all_reduce(g, group=pg)
                    local.grad = g
                    continue
                if fqn not in grads:
                    continue
                spec = pm.storage_spec(fqn)
                g = grads[fqn]
                full = ops.gather_full(g if g is not None else torch.zeros(spec.local_shape(groups.mesh), dtype=local.dtype,
                                                                            device=local.device), spec, groups)
                dist.all_reduce(full, group=pg)
                mine = full[spec.local_slices(groups.mesh, groups.rank)]
                entry = ap.zero2.get(ap.slot_of_fqn[fqn])
                if entry is not None:
                    from autopar.runtime.reducer import chunk_of

                    h = groups.handle(entry.sync.axes)
                    mine = chunk_of(mine, h.index, h.size)
                local.grad = mine.clone()

    @functools.cached_property
    def _tied_alike(self) -> frozenset:
        """The parameters several stages read that they store alike (``_stored_alike``): a plan's
        fact, found once."""
        fqn_of = {ph: fqn for fqn, ph in self.pmodel._ap.graph.params.items()}
        return frozenset(fqn_of[ph] for ph, st in self.shared.items() if ph in fqn_of and self._stored_alike(fqn_of[ph], st))

    def _stored_alike(self, fqn: str, stages) -> bool:
        """Every stage of ``stages`` stores ``fqn`` the same way on a sub-mesh of the same shape (so
        the ranks at one position of their blocks hold the same piece of it, and of its gradient)."""
        plans = [self.plan.pipeline.stages[s] for s in sorted(stages)]
        params = [st.plan.params.get(fqn) for st in plans]
        if any(p is None for p in params):
            return False
        first, shape = params[0], tuple(plans[0].mesh_shape)
        return all(tuple(st.mesh_shape) == shape and p.storage == first.storage
                   and _same_sync(p.grad_sync, first.grad_sync)
                   for st, p in zip(plans, params))

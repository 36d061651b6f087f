"""Calling a pipelined module the way the original model is called: the plain training loop.

``out = pmodel(*inputs); out.loss.backward(); opt.step()`` works on a pipelined plan as on any
other. torch's schedules run every microbatch's forward and backward inside one ``step()``, so they
cannot leave the backward to the caller's loss; a call runs GPipe's order over the same stage
programs instead, split where the caller splits it:

    the call      the batch cut into microbatches of the traced size; every stage of this rank runs
                  each microbatch's forward (received values from the previous stage's rank at this
                  rank's position, point to point; sent on the same way); the last stage's outputs
                  are put together (the loss weighed per microbatch as ``train_step`` weighs it,
                  per-sample outputs concatenated) and sent to every rank, so every rank returns the
                  same outputs, as the original model would; an output the plan returns split (a
                  language model's logits) is put together and sent only when first read
                  (``autopar.runtime.outputs``)
    backward()    when autograd reaches those outputs (whatever loss the caller made of them, scaled
                  or not), every stage runs each microbatch's backward in the same order, gradients
                  of sent values travelling back point to point; then the gradient reducer
                  synchronises once (not inside ``no_sync()``) and parameters several stages hold
                  sum their gradients

A call in eval mode or without gradients runs the forwards alone. A batch of any multiple of the
microbatch size runs on the stages built for the plan (as many microbatches). A call in the other
mode, or with inputs of other shapes, runs on stages built for it on first use and kept
(``StageSet``s made by ``autopar.compose.pipeline.PipelineVariants``: the same layers on the same
ranks, each parameter stored where the plan stores it), or on the plan's own where the model
computes the same (no dropout, no batch norm).

``train_step`` is the faster path: torch's schedule (1F1B, interleaved, zero bubble) keeps fewer
microbatches in flight and overlaps the stages' work, and the last stage returns the loss alone.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from autopar.codegen import ops
from autopar.codegen.ops import gather_full
from autopar.errors import ConfigError
from autopar.runtime.outputs import SplitOutput, block_of, output_names
from autopar.runtime.stage_program import StageProgram, loss_weights
from autopar.sharding_spec.spec import ShardingSpec


@dataclasses.dataclass(eq=False)
class StageSet:
    """One microbatch graph cut into the plan's stages, and this rank's programs of them: what a
    call runs on. ``batch_dims``: per user input, whether the microbatches split its dim 0."""

    graph: object
    plan: object  # the pipelined Plan (its stage plans for this graph)
    cuts: list
    specs: dict
    programs: dict  # stage -> Program, for this rank's stages
    batch_dims: list
    grad_values: frozenset  # values that carry a gradient between stages
    denominators: object  # how microbatch losses are weighed (``codegen.loss_weights``)

    @property
    def micro(self) -> int | None:
        """Rows of a microbatch (None: no input is split)."""
        return next((self.graph.nodes[n].meta.shape[0] for n, split in zip(self.graph.inputs, self.batch_dims) if split),
                    None)

    def takes(self, flat: list) -> bool:
        """Whether a batch of these inputs runs on these stages: every input shaped like the
        microbatch, the split ones along dim 0 times a whole number."""
        for name, x, split in zip(self.graph.inputs, flat, self.batch_dims):
            meta = self.graph.nodes[name].meta
            if not isinstance(x, torch.Tensor) or str(x.dtype).removeprefix("torch.") != meta.dtype:
                return False
            shape, want = tuple(x.shape), tuple(meta.shape)
            if split and (shape[1:] != want[1:] or not shape or shape[0] % want[0]):
                return False
            if not split and shape != want:
                return False
        return True

    def describe(self) -> str:
        return ", ".join(f"{n} {self.graph.nodes[n].meta}" for n in self.graph.inputs) + " (one microbatch)"


def microbatch_rows(flat: list, batch_dims: list[bool], micro: int | None) -> int | None:
    """The microbatch size a call's batch runs at: the plan's where it divides the batch, else
    the largest one under it that does (a last partial batch, an evaluation batch)."""
    batch = next((x.shape[0] for x, split in zip(flat, batch_dims) if split and isinstance(x, torch.Tensor) and x.dim()),
                 None)
    if batch is None or micro is None:
        return micro
    if batch % micro == 0:
        return micro
    return max(d for d in range(1, min(micro, batch) + 1) if batch % d == 0)


class PipelineCall:
    """A pipelined module's calls on one ``StageSet`` (module docstring)."""

    def __init__(self, runner, stage_set: StageSet):
        self.runner, self.stage_set = runner, stage_set
        r = runner
        self.modules = [
            StageProgram(r.pmodel, stage_set.programs[s], stage_set.cuts[s], s == r.stages - 1,
                          stage_set.plan.pipeline.stages[s].recomputed, r.unit_of, all_outputs=True)
            for s in r.sg.stages
        ]
        graph = stage_set.graph
        self.micro = stage_set.micro
        out_node = next(n for n in graph.nodes.values() if n.op == "output")
        self.out_metas = [graph.nodes[n].meta for n in out_node.inputs]
        self.blocks = r.sg.blocks
        # outputs the last stage returns split (a language model's logits): put together and sent
        # to every rank when first read (``autopar.runtime.outputs``), by position
        last_plan = stage_set.plan.pipeline.stages[-1].plan
        reads = last_plan.nodes[out_node.name].inputs if out_node.name in last_plan.nodes else []
        self.split = {k: spec for k, spec in enumerate(reads)
                      if isinstance(spec, ShardingSpec) and not spec.is_replicated}
        self.names = output_names(r.pmodel._ap.out_spec, len(self.out_metas))

    # ---- the call -------------------------------------------------------------------------------
    def __call__(self, flat: list) -> list:
        r = self.runner
        m = self._microbatches(flat)
        batch_dims = self.stage_set.batch_dims
        chunks = [list(x.tensor_split(m)) if split else [x] * m for x, split in zip(flat, batch_dims)]
        grad = torch.is_grad_enabled()
        reducer = r.pmodel._ap.reducer
        sync = reducer._sync_enabled  # the caller's no_sync(), read now as DDP reads it
        saved: dict = {}
        outputs: list = []
        sends = []
        # every microbatch only accumulates: the reducer synchronises once, after the last backward
        with reducer.no_sync():
            for module in self.modules:
                s = module.cut.index
                for i in range(m):
                    received = [c[i] for c in chunks] if s == 0 else self._receive(s, module.cut.receives, grad)
                    module.chunk = i
                    out = module(*received)
                    if module.last:
                        outputs.append(list(out))
                    else:
                        sends += self._send(s, out)
                    if grad:
                        saved[(s, i)] = (received, out)
        for work in sends:
            work.wait()
        weights = self._weights(flat, m)
        flat_out = self._gathered(outputs, m, weights)
        if not grad:
            return flat_out
        state = _CallState(self, saved, m, sync, weights)
        tensors = [i for i, x in enumerate(flat_out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        anchor = torch.empty((), requires_grad=True)  # autograd reaches the backward below through it
        made = _PipelineOutputs.apply(state, anchor, *[flat_out[i] for i in tensors])
        for i, t in zip(tensors, made):
            flat_out[i] = t
        return flat_out

    def _microbatches(self, flat: list) -> int:
        """How many microbatches this call's batch holds."""
        if not self.stage_set.takes(flat):  # (the runner picked these stages for these inputs)
            raise ConfigError(f"these inputs do not run on stages built for {self.stage_set.describe()}")
        if self.micro is None:
            return 1
        return next(x.shape[0] for x, split in zip(flat, self.stage_set.batch_dims) if split) // self.micro

    def _weights(self, flat: list, m: int) -> torch.Tensor:
        ss = self.stage_set
        return loss_weights(ss.denominators, ss.batch_dims, flat, m, self.runner.device)

    # ---- point to point ---------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        """The global rank at this rank's position in the block that runs ``stage``."""
        return self.runner.sg.pp_ranks[stage % self.blocks]

    def _receive(self, s: int, names: list[str], grad: bool) -> list:
        r = self.runner
        bufs = [self._buffer(v) for v in names]
        works = [dist.irecv(b, src=self._peer(s - 1), group=r.sg.pp_group) for b in bufs]
        for w in works:
            w.wait()
        return [b.requires_grad_() if grad and v in self.stage_set.grad_values else b for v, b in zip(names, bufs)]

    def _buffer(self, v: str) -> torch.Tensor:
        """An empty tensor for value ``v`` as it travels (its spec's local shard)."""
        from autopar.sharding_spec.spec import ShardingSpec

        meta = self.stage_set.graph.nodes[v].meta
        spec = self.stage_set.specs.get(v)
        shape = spec.local_shape(self.runner.sg.groups.mesh) if isinstance(spec, ShardingSpec) else tuple(meta.shape)
        return torch.empty(shape, dtype=meta.torch_dtype, device=self.runner.device)

    def _send(self, s: int, values) -> list:
        r = self.runner
        return [dist.isend(v.detach().contiguous(), dst=self._peer(s + 1), group=r.sg.pp_group) for v in values]

    # ---- the last stage's outputs, on every rank ---------------------------------------------------
    def _gathered(self, outputs: list, m: int, weights: torch.Tensor) -> list:
        """The microbatches' outputs as one call's, on every rank: the last stage's ranks put them
        together (``_combine``), the others receive them from the last stage's rank at their
        position. An output the last stage returns split is a ``SplitOutput`` that does both when
        it is first read (``_split_output``)."""
        r = self.runner
        src = self._peer(r.stages - 1)
        last = r.last
        values = self._combine(outputs, m, weights) if last else None
        out = []
        others = [None] if not last else [[v if not isinstance(v, torch.Tensor) else None for v in values]]
        if len(r.sg.pp_ranks) > 1:
            dist.broadcast_object_list(others, src=src, group=r.sg.pp_group)
        for k, meta in enumerate(self.out_metas):
            if meta is None or isinstance(meta, tuple):
                out.append(values[k] if last else others[0][k])
                continue
            if k in self.split:
                out.append(self._split_output(k, meta, m, [o[k] for o in outputs] if last else None))
                continue
            if last:
                t = values[k].detach()
            else:
                t = torch.empty(self._whole_shape(meta, m), dtype=meta.torch_dtype, device=r.device)
            if len(r.sg.pp_ranks) > 1:
                dist.broadcast(t, src=src, group=r.sg.pp_group)
            out.append(t)
        return out

    def _split_output(self, k: int, meta, m: int, pieces: list | None) -> SplitOutput:
        """Output ``k`` as a ``SplitOutput``: when first read, the last stage's ranks gather each
        microbatch's piece whole over their groups and put the microbatches together, then send it
        to the other stages' ranks at their position (``pieces``: this rank's, on the last stage)."""
        r = self.runner
        ap = r.pmodel._ap
        check, call, name, spec = ap.read_check, ap.calls, self.names[k], self.split[k]
        src, groups = self._peer(r.stages - 1), ap.groups
        shape = self._whole_shape(meta, m)
        pieces = None if pieces is None else [p.detach() for p in pieces]

        def gather():
            check.agree(call, k, name)
            if pieces is not None:
                whole = self._put_together(k, [gather_full(p, spec, groups) for p in pieces])
            else:
                whole = torch.empty(shape, dtype=meta.torch_dtype, device=r.device)
            if len(r.sg.pp_ranks) > 1:
                dist.broadcast(whole, src=src, group=r.sg.pp_group)
            return whole

        return SplitOutput(shape, meta.torch_dtype, r.device, gather)

    def _whole_shape(self, meta, m: int) -> tuple:
        shape = tuple(meta.shape)
        if self._per_sample(meta):
            return (shape[0] * m, *shape[1:])
        return shape

    def _per_sample(self, meta) -> bool:
        return self.micro is not None and len(meta.shape) > 0 and meta.shape[0] == self.micro

    def _combine(self, outputs: list, m: int, weights: torch.Tensor) -> list:
        """The microbatches' outputs put together: a number (the loss, an auxiliary loss) weighed as
        the step weighs the loss; a per-sample output concatenated along dim 0; any other the same in
        every microbatch (ConfigError where it is not). Outputs returned split are left to
        ``_split_output`` (None here)."""
        out = []
        for k, meta in enumerate(self.out_metas):
            parts = [o[k] for o in outputs]
            if k in self.split:
                out.append(None)
            elif isinstance(parts[0], torch.Tensor) and parts[0].dim() == 0 and parts[0].is_floating_point():
                out.append(sum(p.detach() * w.to(p.dtype) for p, w in zip(parts, weights)))
            else:
                out.append(self._put_together(k, parts))
        return out

    def _put_together(self, k: int, parts: list):
        """Output ``k`` of every microbatch as the call's: concatenated where it has a row per sample,
        else the same in every microbatch."""
        meta = self.out_metas[k]
        if not isinstance(parts[0], torch.Tensor):
            return parts[0]
        if self._per_sample(meta):
            return torch.cat([p.detach() for p in parts])
        if all(torch.equal(parts[0], p) for p in parts[1:]):
            return parts[0].detach()
        raise ConfigError(f"output {k} of {self.stage_set.graph.model_name} is neither a number, nor one row per "
                          "sample, nor the same in every microbatch: a pipelined call cannot put it together. "
                          "Train with pmodel.train_step(...) (it returns the loss alone), or pipeline=False")

    # ---- backward ------------------------------------------------------------------------------------
    def backward(self, state: "_CallState", grads: list) -> None:
        """Every microbatch's backward through this rank's stages (module docstring)."""
        r = self.runner
        m = state.microbatches
        seeds = self._seeds(grads, m, state.weights) if r.last else None
        sends = []
        for module in reversed(self.modules):
            s = module.cut.index
            for i in range(m):
                received, out = state.saved.pop((s, i))
                if module.last:
                    outs, gs = list(out), seeds[i]
                else:
                    outs, gs = list(out), self._receive_grads(s, module.cut.sends, out)
                pairs = [(o, g) for o, g in zip(outs, gs) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
                if pairs:
                    with ops.bind(r.sg.groups):
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                if s > 0:
                    sends += self._send_grads(s, module.cut.receives, received)
        for work in sends:
            work.wait()
        if state.sync:
            r.pmodel._ap.reducer.synchronize()
            r._sum_shared_grads()

    def _seeds(self, grads: list, m: int, weights: torch.Tensor) -> list[list]:
        """Per microbatch, the gradient of each of the last stage's outputs from the call's."""
        seeds = [[None] * len(self.out_metas) for _ in range(m)]
        it = iter(grads)
        for k, meta in enumerate(self.out_metas):
            if meta is None or isinstance(meta, tuple) or meta.dtype not in ("float16", "bfloat16", "float32", "float64"):
                continue
            g = next(it)
            if g is None:
                continue
            if isinstance(g, SplitOutput):
                g = g.whole()
            # an output returned split: this rank's block of each microbatch's (``SplitOutput``)
            block = self.split[k].local_slices(self.runner.pmodel._ap.groups.mesh, self.runner.pmodel._ap.groups.rank) \
                if k in self.split else None
            for i in range(m):
                if len(meta.shape) == 0:
                    seeds[i][k] = g * weights[i].to(g.dtype)
                elif self._per_sample(meta):
                    seeds[i][k] = g.tensor_split(m)[i].contiguous()
                else:
                    seeds[i][k] = g / m  # the same value in every microbatch: each gets its share
                if block is not None:
                    seeds[i][k] = block_of(seeds[i][k], block)
        return seeds

    def _receive_grads(self, s: int, names: list[str], out) -> list:
        r = self.runner
        bufs = [self._buffer(v) if v in self.stage_set.grad_values else None for v in names]
        works = [dist.irecv(b, src=self._peer(s + 1), group=r.sg.pp_group) for b in bufs if b is not None]
        for w in works:
            w.wait()
        return bufs

    def _send_grads(self, s: int, names: list[str], received: list) -> list:
        r = self.runner
        works = []
        for v, x in zip(names, received):
            if v not in self.stage_set.grad_values:
                continue
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            works.append(dist.isend(g.contiguous(), dst=self._peer(s - 1), group=r.sg.pp_group))
        return works


class _CallState:
    """What a call keeps for its backward: per (stage, microbatch) the received values and the
    outputs, the microbatch count, whether to synchronise, the loss weights."""

    def __init__(self, call: PipelineCall, saved: dict, microbatches: int, sync: bool, weights):
        self.call, self.saved, self.microbatches, self.sync, self.weights = call, saved, microbatches, sync, weights


class _PipelineOutputs(torch.autograd.Function):
    """Identity on a call's outputs; its backward runs the stages' backwards (``PipelineCall.backward``)."""

    @staticmethod
    def forward(ctx, state, anchor, *outputs):
        ctx.state = state
        ctx.set_materialize_grads(False)
        # a SplitOutput is made anew (a view would read it): the same gather, now with a gradient
        return tuple(SplitOutput(o.shape, o.dtype, o.device, o.take_gather()) if isinstance(o, SplitOutput)
                     else o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        state, ctx.state = ctx.state, None
        if state is None:
            raise ConfigError("a pipelined call's outputs went through backward twice; call the module again")
        state.call.backward(state, list(grads))
        return (None, None) + (None,) * len(grads)

"""One pipeline stage's program as a module: what torch's ``PipelineStage`` runs for ``train_step``
(``autopar.runtime.pipeline``) and what a plain call runs stage by stage
(``autopar.runtime.pipeline_call``); with the recomputation of a stage by layer, and how each
microbatch's loss weighs in the step's (``loss_weights``)."""
from __future__ import annotations

import functools
import torch
import torch.nn as nn

from autopar.codegen import ops
from autopar.codegen.stages import StageCut
from autopar.errors import ConfigError
from autopar.record.recompute import SAVED_ATEN_OPS, Recompute


class StageProgram(nn.Module):
    """The module a ``PipelineStage`` runs: this stage's program over the received values. It owns
    no parameters (the ParallelModule does; gradients reach them through its reducer's taps)."""

    def __init__(self, pmodel, program, cut: StageCut, last: bool, recompute: Recompute, unit_of: dict | None = None,
                 split_backward: bool = False, all_outputs: bool = False):
        super().__init__()
        object.__setattr__(self, "pmodel", pmodel)
        object.__setattr__(self, "feeds", program)  # the Program: its lowered graph and state slots
        self.cut, self.last = cut, last
        # Under a split backward: microbatch -> (state slot, the view of it the program read).
        self.weight_reads: dict | None = {} if split_backward else None
        self.chunk = 0  # the microbatch the stage runs (set by ``_chunk_stage``)
        self.sync_chunk: int | None = None  # the microbatch whose backward launches the gradient sync (None: after the schedule)
        self.read_slots = sorted({slot for slot in program.state_slots if slot is not None})
        # The last stage returns the loss alone for a step (``train_step`` reads nothing else, and
        # the other outputs' resharding to whole values, a language model's logits gathered every
        # microbatch, would only cost time); every output for a call (``all_outputs``).
        gm = program.loss_only() if last and not all_outputs else program.lowered.gm
        # Recomputation per layer, as the plan priced it: one checkpointed piece per layer.
        self.program = checkpointed_by_layer(gm, unit_of, pmodel._ap.groups, recompute) if recompute else gm

    def forward(self, *received):
        ap = self.pmodel._ap
        lowered = self.feeds.lowered
        vals = dict(zip(self.cut.receives, received))
        feed = [vals[n] for n in lowered.inputs] + [vals[n] for n in lowered.boundary_inputs]
        state = ap.program_state(sync=True if self.chunk == self.sync_chunk else None)
        if self.weight_reads is not None and torch.is_grad_enabled():  # a split backward: one view per parameter
            reads = [(slot, state[slot].view_as(state[slot])) for slot in self.read_slots if state[slot].requires_grad]
            for slot, view in reads:
                state[slot] = view
            self.weight_reads[self.chunk] = reads
        state = self.feeds.state_inputs(state)

        with ops.bind(ap.groups):
            out = tuple(self.program(*state, *feed))
        if self.last:
            return out  # (loss,)
        n_user = len(out) - len(lowered.boundary_outputs)
        made = dict(zip(lowered.boundary_outputs, out[n_user:]))
        return tuple(self._sendable(made[v] if v in made else vals[v], v not in made) for v in self.cut.sends)

    def _sendable(self, t, passing: bool):
        """A value the stage sends. One passing through is re-viewed so autograd hands its gradient
        straight back. Under a split backward torch detaches every output in place, which a view
        refuses (a mask built with ``expand``, a passed value): those are sent as copies. Point to
        point sends take contiguous tensors (an op on a transposed value may keep its layout)."""
        if not isinstance(t, torch.Tensor):
            return t
        if not t.is_contiguous():
            t = t.contiguous()  # a copy: no longer a view, nor the received tensor itself
            passing = False
        if self.weight_reads is not None and (passing or t._is_view()):
            return t.clone() if t.requires_grad else t.detach().clone()
        return t.view_as(t) if passing and t.requires_grad else t


class _Checkpointed(nn.Module):
    """A piece of a stage program run under ``torch.utils.checkpoint``: its activations are not
    kept (under selective recomputation, but for the outputs of the ops it saves); backward runs it
    again (with the mesh's groups bound, as in forward)."""

    def __init__(self, piece: nn.Module, groups, selective: bool):
        super().__init__()
        self.piece = piece
        self.selective = selective
        object.__setattr__(self, "groups", groups)

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        if not torch.is_grad_enabled():
            return self.piece(*args)
        if self.selective:
            return checkpoint(self._run, *args, use_reentrant=False, context_fn=_saving_contexts)
        return checkpoint(self._run, *args, use_reentrant=False)

    def _run(self, *args):
        with ops.bind(self.groups):
            return self.piece(*args)


def _saving_contexts():
    """Selective checkpointing's contexts: the outputs of ``SAVED_ATEN_OPS`` kept, the rest recomputed."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(list(_saved_ops()))


@functools.cache
def _saved_ops() -> tuple:
    """The installed torch's overloads of ``SAVED_ATEN_OPS``."""
    found = []
    for name in SAVED_ATEN_OPS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            found.append(op)
    return tuple(found)


def checkpointed_by_layer(gm, unit_of: dict, groups, recompute: Recompute = Recompute.FULL) -> nn.Module:
    """``gm`` split into one piece per layer unit (each emitted node goes with the traced node it
    lowers: ``autopar_origin``), each piece checkpointed (whole, or selectively)."""
    from torch.fx.passes.split_module import split_module

    first = min((unit_of[n.meta["autopar_origin"]] for n in gm.graph.nodes if n.meta.get("autopar_origin") in unit_of),
                default=0)

    def piece(node) -> int:
        return unit_of.get(node.meta.get("autopar_origin"), first)

    split = split_module(gm, gm, piece)
    for name, child in list(split.named_children()):
        setattr(split, name, _Checkpointed(child, groups, recompute is Recompute.SELECTIVE))
    return split


@torch.no_grad()
def loss_weights(denominators, batch_dims: list[bool], flat_inputs: list, m: int, device) -> torch.Tensor:
    """What each of ``m`` microbatches' losses weighs in the step's (``autopar.codegen.loss_weights``):
    1 / m, or for a mean over counted targets its share of the batch's count."""
    if denominators is not None:
        chunks = [list(x.tensor_split(m) if split else [x] * m) for x, split in zip(flat_inputs, batch_dims)]
        counts = torch.stack([torch.stack(denominators([c[k] for c in chunks])) for k in range(m)])  # (m, means)
        if denominators.direct:
            return (counts[:, 0] / counts[:, 0].sum()).to(device)
        if not bool((counts == counts[:1]).all()):
            node = denominators.means[0]
            raise ConfigError(
                f"the loss adds a mean over counted targets ({node.name}, {node.target}) to other terms, and this "
                f"step's microbatches count {counts[:, 0].tolist()} targets: weighing them alike would not give "
                "the batch's loss. Use Pipeline(microbatches=1), or make the mean the whole loss")
    return torch.full((m,), 1.0 / m, dtype=torch.float64, device=device)

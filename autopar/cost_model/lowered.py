"""Collectives that run inside an op: the lowered loss families (autopar/codegen/lowerings.py) talk
across ranks inside the op itself, not on a resharding edge, so their price lives here.

    loss-vocab-parallel     forward: an all-reduce (max) of one value per sample and one (sum) of
                            two values per sample over the class axes; backward: one of one value
                            per sample; a mean adds an all-reduce of the valid-target count over the
                            batch axes
    loss-batch-split(mean)  a class-index loss with its denominator unknown until run time: an
                            all-reduce of the valid-target count over the batch axes

A count the ranks can make from the whole user inputs (``ir.losses.counted_from_inputs``:
``counted_locally``) needs no all-reduce: the program recomputes the targets whole and counts them.
"""
from __future__ import annotations

import math

from autopar.cost_model.comm import mesh_collective_time
from autopar.cost_model.gradients import whole_on
from autopar.sharding_spec.rules.loss import MEAN_SPLIT, VOCAB_PARALLEL

_CLASS_LOSSES = ("cross_entropy", "nll_loss")


def lowered_comm_s(target: str, family: str, inputs, output, mesh, itemsize: int = 4, identical=(),
                   counted_locally: bool = False) -> float:
    """Seconds of the collectives ``family`` runs inside the op (forward and backward); on
    ``identical`` gradient axes the loss gradient arrives whole and backward's all-reduce is not run;
    ``counted_locally``: a mean's denominator needs no all-reduce (see the module docstring)."""
    parts = set(family.split("+"))
    total = 0.0
    if VOCAB_PARALLEL in parts and inputs and inputs[0] is not None:
        x = inputs[0]
        cdim = 1 if x.ndim >= 2 else 0
        class_axes = tuple(x.dim_axes[cdim])
        batch_axes = tuple(a for d, ax in enumerate(x.dim_axes) if d != cdim for a in ax)
        local = x.local_shape(mesh)
        samples = math.prod(local) // max(local[cdim], 1)
        if class_axes:
            backward = 0 if whole_on(class_axes, identical) else 1
            total += ((1 + backward) * mesh_collective_time("all_reduce", samples * itemsize, mesh, class_axes)  # max
                      + mesh_collective_time("all_reduce", 2 * samples * itemsize, mesh, class_axes))  # sum exp, target
        if batch_axes and not counted_locally:
            total += mesh_collective_time("all_reduce", itemsize, mesh, batch_axes)
    elif MEAN_SPLIT in parts and any(k in target for k in _CLASS_LOSSES) and not counted_locally:
        out = output[0] if isinstance(output, tuple) else output
        if out is not None and out.partial:
            total += mesh_collective_time("all_reduce", itemsize, mesh, tuple(out.partial))
    return total

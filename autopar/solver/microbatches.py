"""Microbatches: how many a batch splits into, one microbatch of the example inputs, and whether
splitting the inputs' dim 0 changes the step at all (``batch_mixing``: samples that meet in an op,
a loss that sums over them). The pipeline search (``autopar.solver.pipeline``) reads them; so do
``parallelize`` (the microbatch it traces) and the CLI.
"""
from __future__ import annotations

from autopar.errors import ConfigError
from autopar.ir.graph import Role
from autopar.ir.losses import class_means, state_weighing
from autopar.sharding_spec.mesh import Mesh
from autopar.sharding_spec.spec import ShardingSpec


def batch_size(example_inputs, example_kwargs=None) -> int:
    """The batch: dim 0 of the first tensor input (what microbatches split)."""
    import torch

    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    tensors = [t for t in inputs + tuple((example_kwargs or {}).values()) if isinstance(t, torch.Tensor) and t.dim()]
    if not tensors:
        raise ConfigError("a pipeline splits the batch into microbatches: pass the batch as tensor inputs")
    return tensors[0].shape[0]


def microbatch_candidates(batch: int, fixed: int | None, max_count: int = 512) -> list[int]:
    """Microbatch counts to try: those whose microbatch size is a power of two (it then splits
    evenly over power-of-two data-parallel degrees), ascending; a given count alone."""
    if fixed is not None:
        if batch % fixed:
            raise ConfigError(f"Pipeline(microbatches={fixed}) does not divide the batch of {batch}")
        return [fixed]
    sizes = [2 ** i for i in range(batch.bit_length()) if batch % 2 ** i == 0]
    return sorted({1} | {batch // b for b in sizes if batch // b <= max_count})


_IOTA_THROUGH = {"aten.unsqueeze.default", "aten.view.default", "aten.reshape.default", "aten.expand.default",
                 "aten._to_copy.default", "aten.to.dtype", "aten.to.device", "aten.clone.default"}


def _iota_args(size: int) -> dict:
    """target -> args of the aranges 0, 1, ..., size - 1."""
    return {"aten.arange.default": (size,), "aten.arange.start": (0, size), "aten.arange.start_step": (0, size, 1)}


def _iota_index_rows(graph, node, spec) -> int | None:
    """The output dim that carries the samples of ``aten.index.Tensor(x, indices)`` when ``x`` is
    split on one dim d (``spec``), the indices are the leading ones, and index d is an ``arange``
    over all of dim d (through views and casts: transformers' masks read ``mask[batch_arange,
    kv_arange]``), every other index unsplit. Each sample then reads its own row, and a
    microbatch, traced at its own size, indexes its rows with its own ``arange``. None otherwise."""
    if node.target != "aten.index.Tensor" or len(node.args) < 2 or not node.inputs:
        return None
    src = spec.get(node.inputs[0])
    indices = node.args[1]
    if not isinstance(src, ShardingSpec) or src.partial or not isinstance(indices, (list, tuple)):
        return None
    split = [d for d, axes in enumerate(src.dim_axes) if axes]
    if len(split) != 1 or split[0] >= len(indices) or any(i is None for i in indices):
        return None
    d = split[0]
    names = [getattr(i, "name", None) for i in indices]
    if None in names or any(spec.get(n) is not None for n in names):
        return None
    iota = graph.nodes[names[d]]
    while iota.target in _IOTA_THROUGH:
        iota = graph.nodes[iota.inputs[0]]
    size = src.shape[d]
    if _iota_args(size).get(iota.target) != tuple(iota.args):
        return None
    shape = tuple(graph.nodes[names[d]].meta.shape)
    broadcast = len(node.meta.shape) - (len(src.shape) - len(indices))  # the indices' broadcast dims lead the output
    if shape.count(size) != 1 or any(n not in (1, size) for n in shape) or len(shape) > broadcast:
        return None
    return broadcast - len(shape) + shape.index(size)


def batch_mixing(graph, batch: int) -> str | None:
    """Why splitting the inputs' dim 0 into microbatches would change the step, or None when it
    would not: the op where the samples of dim 0 meet (attention over a time-first sequence, batch
    norm's statistics, a loss term nonlinear in batch means), a loss that sums over dim 0 (a
    pipelined step averages its microbatches' losses), or a mean over class targets weighed by
    model state (``codegen.loss_weights`` weighs microbatches by their counts from the inputs).
    The sharding rules decide it: dim 0 split over a virtual axis must reach the outputs split, or
    as a pending mean, with no op needing the samples together."""
    from autopar.sharding_spec.rules import strategies_for
    from autopar.sharding_spec.strategy import OpContext

    out = next(n for n in graph.nodes.values() if n.op == "output")
    for mean in (m for name in out.inputs if name in graph.nodes for m in class_means(graph, name)[0]):
        state = state_weighing(graph, mean)
        if state is not None:  # microbatches count their targets apart (``codegen.loss_weights``)
            return f"{mean.target} ({mean.name}) averages over targets weighed by model state ({state})"
    parts = next(p for p in range(2, batch + 1) if batch % p == 0)
    mesh = Mesh((parts,))

    def plain(x):  # a spec that neither splits nor holds a pending sum is the same as none
        if isinstance(x, tuple):
            x = tuple(plain(e) for e in x)
            return None if all(e is None for e in x) else x
        return None if x is None or (not x.partial and not any(x.dim_axes)) else x

    def reads(want, held) -> bool:
        """A strategy reads an input as it is held; a value the split does not reach (a parameter
        expanded to the batch) may be read split too: each microbatch makes its own slice."""
        if held is None:
            return not any(isinstance(w, ShardingSpec) and w.partial for w in (want if isinstance(want, tuple) else (want,)))
        return plain(want) == held

    spec, kind = {}, {}  # node -> its spec under the split; pending sums: "mean" or "sum"
    for node in graph.nodes.values():
        meta = node.meta
        if node.op == "placeholder":
            if node.role == Role.INPUT and getattr(meta, "shape", None) and meta.shape[0] == batch:
                spec[node.name] = ShardingSpec(meta.shape, ((0,),) + ((),) * (len(meta.shape) - 1), (), 1)
            continue
        have = [spec.get(i) for i in node.inputs]
        if node.target == "operator.getitem" and isinstance(have[0], tuple):  # it reads element i
            have[0] = plain(have[0][node.args[1]])
        if node.op == "output":
            for name, x in zip(node.inputs, have):
                if isinstance(x, ShardingSpec) and x.partial and kind.get(name) != "mean":
                    return f"the output {name} sums over dim 0 (a pipelined step averages its microbatches' losses)"
            continue
        if node.op != "call_function" or not any(x is not None for x in have):
            continue
        rows = _iota_index_rows(graph, node, spec)
        if rows is not None:  # x[arange(b)[:, None], ...]: each sample reads its own row
            spec[node.name] = ShardingSpec(node.meta.shape, tuple((0,) if d == rows else () for d in range(len(node.meta.shape))),
                                           (), 1)
            continue
        ctx = OpContext(node, mesh, [graph.nodes[i].meta for i in node.inputs], graph)
        pending = {kind[i] for i, x in zip(node.inputs, have) if isinstance(x, ShardingSpec) and x.partial}
        match = next((st for st in strategies_for(ctx) if all(reads(w, h) for w, h in zip(list(st.inputs) + [None] * len(have), have))),
                     None)
        if match is None or len(pending) > 1:
            where = f" in {node.module_path}" if node.module_path else ""
            return f"{node.target} ({node.name}{where}) reads the samples of dim 0 together"
        out = plain(match.output)
        if out is not None:
            spec[node.name] = out
            if isinstance(out, ShardingSpec) and out.partial:
                kind[node.name] = pending.pop() if pending else ("mean" if match.family.takes_mean else "sum")
    return None


def microbatch_inputs(example_inputs, example_kwargs, count: int):
    """One microbatch of the example inputs: every tensor whose dim 0 is the batch, cut to
    ``batch // count`` rows (others, like a shared mask, whole)."""
    import torch

    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    batch = batch_size(inputs, example_kwargs)

    def cut(t):
        return t[: batch // count] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t

    return tuple(cut(t) for t in inputs), {k: cut(v) for k, v in (example_kwargs or {}).items()}


def mixing_probe(counts: list[int], batch: int, inputs, kwargs) -> int:
    """The microbatch count whose graph ``batch_mixing`` reads: the one the pipeline search (``pipeline._search_counts``)
    evaluates first, so that no graph is traced for the check alone. The whole batch (1) when that
    microbatch holds one sample (nothing to split) or when an input that is not cut has as many
    rows as it (the check could not tell them apart)."""
    import torch

    count = counts[(len(counts) - 1) // 3] if len(counts) > 3 else counts[0]
    rows = batch // count
    uncut = {t.shape[0] for t in (*inputs, *(kwargs or {}).values())
             if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] != batch}
    return 1 if rows < 2 or rows in uncut else count

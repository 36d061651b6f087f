"""In-place writes in the planner, without ranks: which reads must see their producer's memory
(``ir.aliasing``), plans that never reshard on the way to a write, and codegen refusing a plan
that would write into a copy."""
from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import autopar
from autopar import ir
from autopar.codegen.lower import lower
from autopar.errors import PlanError
from autopar.ir.aliasing import in_place_reads, write_paths, written_bases
from autopar.sharding_spec.spec import ShardingSpec
from autopar.solver.plan import StepPlan
from autopar.solver.problem import edge_matrix, node_choices

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_zoo  # noqa: E402


@pytest.fixture(scope="module")
def t5():
    import transformers as tf

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, dropout_rate=0.0,
                      use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    model = tf.T5ForConditionalGeneration(cfg)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": torch.roll(ids, 1, 1)}
    return model, kwargs, ir.trace(model, (), kwargs)


def test_t5_decoder_shift_reads_are_in_place(t5):
    _, _, graph = t5
    reads = in_place_reads(graph)
    assert {("copy_", 0), ("slice_2", 0), ("fill_", 0), ("select", 0), ("masked_fill_", 0)} <= reads
    bases = written_bases(graph)
    assert {k: bases[k] for k in ("copy_", "fill_", "masked_fill_")} == dict.fromkeys(("copy_", "fill_", "masked_fill_"), "new_zeros")
    # the source of a copy is an ordinary read, and so is every read of a tensor nothing writes into
    assert ("copy_", 1) not in reads and not any(r.startswith("linear") for r, _ in reads)


def test_chains_of_in_place_ops_reach_their_base():
    model, inputs = models_zoo.in_place()
    graph = ir.trace(model, inputs)
    paths = write_paths(graph)
    relu = next(n for n in paths if graph.nodes[n].target == "aten.relu_.default")
    assert [graph.nodes[r].target for r, _ in paths[relu]] == ["aten.relu_.default", "aten.add_.Tensor", "aten.mul_.Tensor"]
    assert graph.nodes[written_bases(graph)[relu]].target == "aten.add.Tensor"
    running = [w for w, b in written_bases(graph).items() if graph.nodes[b].role == ir.Role.BUFFER]
    assert len(running) == 2  # mul_ and add_ of the running mean


def _plan_edges_into_writes(graph, plan):
    reads = in_place_reads(graph)
    return [e for e in plan.edges if (e.dst, e.position) in reads]


@pytest.mark.parametrize("shape, layout", [
    ((4,), autopar.Layout(dp=4)), ((4,), autopar.Layout(tp=4)), ((4,), autopar.Layout(dp=4, zero=3)),
    ((2, 2), autopar.Layout(dp=2, tp=2)), ((4,), None), ((2, 2), None),
], ids=str)
def test_plans_read_written_tensors_as_held(t5, shape, layout):
    model, kwargs, graph = t5
    for g, m, args, kw in ((graph, model, (), kwargs), (None, *models_zoo.in_place(), None)):
        if g is None:
            g = ir.trace(m, args)
        plan = autopar.plan(m, autopar.Mesh(shape, cluster="cpu-gloo"), args, example_kwargs=kw, force=layout,
                            pipeline=False, idle_axes=())
        for e in _plan_edges_into_writes(g, plan):
            assert not e.steps and e.src_spec == e.dst_spec, f"{e.src} -> {e.dst}: {e.src_spec} -> {e.dst_spec}"
        if layout is not None and layout.dp > 1:  # the writes ran on split batches, not gathered
            split = [n for n in written_bases(g).values() if g.nodes[n].op == "call_function"
                     and not plan.nodes[n].output.is_replicated]
            assert split, "every written tensor was held whole"


def test_edge_matrix_forbids_reshards_into_a_write(t5):
    _, _, graph = t5
    mesh = autopar.Mesh((4,), cluster="cpu-gloo")
    choices = node_choices(graph, mesh)
    prod, cons = choices["slice_2"], choices["copy_"]
    mat = edge_matrix(graph, prod, cons, 0, mesh, with_backward=False, in_place=True)
    free = edge_matrix(graph, prod, cons, 0, mesh, with_backward=False)
    for i, ps in enumerate(prod.strategies):
        for j, cs in enumerate(cons.strategies):
            if ps.output == cs.inputs[0]:
                assert mat[i, j] == free[i, j] == 0.0
            else:
                assert np.isinf(mat[i, j]) and np.isfinite(free[i, j])


def test_codegen_refuses_a_plan_that_writes_into_a_copy():
    model, inputs = models_zoo.in_place()
    graph = ir.trace(model, inputs)
    mesh = autopar.Mesh((2,), cluster="cpu-gloo")
    plan = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=2), pipeline=False)
    edge_i = next(i for i, e in enumerate(plan.edges) if e.dst == "copy_" and e.position == 0)
    edge = plan.edges[edge_i]
    assert edge.src_spec.dim_axes[0] == (0,)
    whole = ShardingSpec.replicate(edge.src_spec.shape, 1)
    plan.edges[edge_i] = dataclasses.replace(edge, dst_spec=whole, steps=[StepPlan("all_gather", (0,), 0, 0.0, 0, None)])
    node = plan.nodes["copy_"]
    plan.nodes["copy_"] = dataclasses.replace(node, inputs=[whole] + list(node.inputs[1:]), output=whole)
    with pytest.raises(PlanError, match="writes into slice_2 in place"):
        lower(graph, plan, mesh)

"""lower(): the emitted per-rank program, in one process. Multi-rank numerics are in
tests/runtime/test_parallelize.py; here: what the program says (collectives, local sizes, the same
text for every rank), node subsets for later pipeline stages, and clear errors."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import ir, models
from autopar.codegen import ops
from autopar.codegen.lower import lower
from autopar.codegen.lowerings import lowering
from autopar.errors import AutoparError, ConfigError, PlanError
from autopar.ir.trace import target_name
from autopar.sharding_spec.rules._common import LOCAL_SIZE_ARGS
from autopar.solver.plan import NodePlan


@pytest.fixture(scope="module", autouse=True)
def quiet():
    warnings.simplefilter("ignore")


@pytest.fixture(scope="module")
def mlp():
    model, inputs = models.build("mlp", layers=1)
    return model, inputs, ir.trace(model, inputs)


@pytest.fixture(scope="module")
def llama():
    model, inputs = models.build("llama", layers=1)
    graph = ir.trace(model, inputs)
    return model, inputs, graph, autopar.plan(model, autopar.Mesh((2,)), inputs, graph=graph, idle_axes=())


@pytest.fixture()
def world_of_one():
    """A one-rank default process group in this process (removed afterwards)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_row_parallel_program_names_its_collectives(mlp):
    model, inputs, graph = mlp
    mesh = autopar.Mesh((2,))
    force = {n.name: "1d-row" for n in graph if n.target == "aten.linear.default"}
    plan = autopar.plan(model, mesh, inputs, graph=graph, force=force)
    code = lower(graph, plan, mesh).code
    assert "autopar_all_reduce(" in code or "autopar_reduce_scatter(" in code
    assert "autopar_backward_seed(mse_loss" in code
    assert code.count("torch.ops.aten.linear.default(") == 3


def test_size_arguments_are_local_and_every_node_knows_its_shard(llama):
    model, inputs, graph, plan = llama
    mesh = autopar.Mesh((2,))
    lowered = lower(graph, plan, mesh)
    checked = 0
    for node in lowered.gm.graph.nodes:
        if node.op != "call_function":
            continue
        spec = node.meta.get("autopar_spec")
        target = target_name(node.target)
        if target in LOCAL_SIZE_ARGS and spec is not None:
            i, name = LOCAL_SIZE_ARGS[target]
            size = node.args[i] if i < len(node.args) else node.kwargs[name]
            assert tuple(size) == spec.local_shape(mesh), f"{node.name}: {size} vs {spec}"
            checked += 1
    assert checked >= 5
    assert any(not s.is_replicated for s in lowered.specs.values() if isinstance(s, autopar.ShardingSpec))


def test_program_is_the_same_for_every_rank(llama):
    model, inputs, graph, plan = llama
    a = lower(graph, plan, autopar.Mesh((2,))).code
    b = lower(graph, plan, autopar.Mesh((2,))).code
    assert a == b and "rank" not in a.replace("autopar_", "")


def test_whole_graph_and_two_stage_cut_run_like_the_model(mlp, world_of_one):
    from autopar.runtime.process_groups import MeshGroups

    model, inputs, graph = mlp
    mesh = autopar.Mesh((1,))
    plan = autopar.plan(model, mesh, inputs, graph=graph)
    groups = MeshGroups(mesh)
    state = {ph: model.get_parameter(fqn).detach() for fqn, ph in graph.params.items()}
    whole = lower(graph, plan, mesh)
    with ops.bind(groups):
        (loss,) = whole.gm(*[state[p] for p in whole.state], *inputs)
    assert torch.allclose(loss, model(*inputs))
    # A cut after the first relu, each stage with the placeholders it reads: stage 1 returns the
    # relu, stage 2 reads it as a boundary input (after its own user input, the targets).
    names = list(graph.nodes)
    op_names = [n for n in names if graph.nodes[n].op != "placeholder"]
    k = op_names.index("relu") + 1

    def stage(sub):
        reads = {i for n in sub for i in graph.nodes[n].inputs if graph.nodes[i].op == "placeholder"}
        return [n for n in names if n in reads or n in sub]

    first, second = lower(graph, plan, mesh, nodes=stage(op_names[:k])), lower(graph, plan, mesh, nodes=stage(op_names[k:]))
    assert first.boundary_outputs == ["relu"] and first.inputs == ["x"]
    assert second.boundary_inputs == ["relu"] and second.inputs == ["targets"]
    with ops.bind(groups):
        (relu,) = first.gm(*[state[p] for p in first.state], inputs[0])
        (loss2,) = second.gm(*[state[p] for p in second.state], inputs[1], relu)
    assert torch.allclose(loss2, loss)


def test_graph_run_outside_bind_is_a_clear_error(mlp):
    with pytest.raises(AutoparError, match="outside autopar.codegen.ops.bind"):
        ops.current_groups()


def test_unimplemented_lowering_is_a_plan_error(mlp):
    model, inputs, graph = mlp
    node = graph.nodes["linear"]
    fake = NodePlan("linear", node.target, None, "1d-col+embedding-vocab-parallel", [None] * 3, None, 0.0, 0.0)
    with pytest.raises(PlanError, match="needs a lowering"):
        lowering(node, fake, graph)


def test_plan_for_another_mesh_is_rejected(mlp):
    model, inputs, graph = mlp
    plan = autopar.plan(model, autopar.Mesh((2,)), inputs, graph=graph, idle_axes=())
    with pytest.raises(PlanError, match="mesh of shape"):
        lower(graph, plan, autopar.Mesh((4,)))


def test_parallelize_rejects_foreign_plans_before_any_collective(mlp):
    model, inputs, graph = mlp
    mesh = autopar.Mesh((2,))
    zero2 = autopar.plan(model, mesh, inputs, graph=graph, force={"p_proj_in_weight": "zero2"})
    other, other_inputs = models.build("mlp", layers=2)
    with pytest.raises(PlanError, match="Make a new plan"):
        autopar.parallelize(other, mesh, other_inputs, plan=zero2)


def test_planner_drops_zero2_when_optimizer_sharding_is_off(mlp):
    model, inputs, graph = mlp
    plan = autopar.plan(model, autopar.Mesh((2,)), inputs, graph=graph, optimizer_sharding=False)
    assert not any(p.family.zero2 for p in plan.params.values())
    with pytest.raises(ConfigError, match="no strategy of family"):
        autopar.plan(model, autopar.Mesh((2,)), inputs, graph=graph, optimizer_sharding=False,
                     force={"p_proj_in_weight": "zero2"})


def test_forcing_a_split_the_batch_does_not_allow_is_a_config_error():
    model, inputs = models.build("mlp", layers=1, batch=3)
    graph = ir.trace(model, inputs)
    with pytest.raises(ConfigError, match="no strategy of family 'dp'"):
        autopar.plan(model, autopar.Mesh((2,)), inputs, graph=graph, force={"linear": "dp"})


class _ViewAfterTranspose(torch.nn.Module):
    """``a.transpose(1, 2).view(...)`` is legal here only because the multiply kept the transposed
    input's strides (as CPU SDPA's output layout does in attention); a collective in between would
    hand the view a fresh contiguous tensor."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        a = self.lin(x).transpose(1, 2) * 2.0
        return a.transpose(1, 2).view(x.shape[0], -1).sum()


def test_views_are_emitted_as_reshapes(world_of_one):
    from autopar.runtime.process_groups import MeshGroups

    torch.manual_seed(0)
    model, x = _ViewAfterTranspose(), torch.randn(4, 5, 6)
    graph = ir.trace(model, (x,))
    assert any(n.target == "aten.view.default" for n in graph.nodes.values())
    mesh = autopar.Mesh((1,))
    lowered = lower(graph, autopar.plan(model, mesh, (x,), graph=graph), mesh)
    assert "aten.view.default" not in lowered.code and "aten.reshape.default" in lowered.code
    state = {ph: model.get_parameter(fqn).detach() for fqn, ph in graph.params.items()}
    with ops.bind(MeshGroups(mesh)):
        (out,) = lowered.gm(*[state[p] for p in lowered.state], x.transpose(1, 2).contiguous().transpose(1, 2))
    assert torch.allclose(out, model(x), rtol=1e-5, atol=1e-5)


def test_zero3_gathers_each_layers_parameters_in_one_collective():
    """ZeRO-3 / FSDP storage: a block's parameters are gathered by one collective (and their
    gradients reduce-scattered by one), as FSDP groups them; outside the blocks, one more group."""
    model, inputs = models.build("gpt", layers=2, vocab=64, width=32, heads=4, seq=16, batch=8)
    graph = ir.trace(model, inputs)
    mesh = autopar.Mesh((2,))
    plan = autopar.plan(model, mesh, inputs, graph=graph, force=autopar.Layout(dp=2, zero=3))
    code = lower(graph, plan, mesh).code
    assert code.count("autopar_all_gather_group(") == 3  # two blocks and the rest
    assert "autopar_all_gather(p_" not in code  # no parameter gathered alone


def test_an_outputs_all_reduce_keeps_the_seed_whole():
    # the batch-split loss is all-reduced to every rank with the whole backward (identity), and
    # every rank keeps its seed on that axis: no all-reduce of the seed at the start of backward
    model, inputs = models.build("gpt", layers=1)
    graph = ir.trace(model, inputs)
    mesh = autopar.Mesh((4,), cluster="cpu-gloo")
    plan = autopar.plan(model, mesh, inputs, graph=graph, force=autopar.Layout(dp=4))
    code = lower(graph, plan, mesh).code
    assert "autopar_all_reduce(cross_entropy_loss, axes = (0,), whole = True)" in code
    assert "autopar_backward_seed(cross_entropy_loss_all_reduce, idle_axes = (0,))" in code


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_zero3_under_tensor_parallel_gathers_a_layer_in_one_collective(name):
    """ZeRO-3 over data parallel of tensor-parallel shards: reads whose route is a gather with
    local steps around it (a bias read partial: to_partial then the gather; a norm weight gathered
    then sliced for a sequence split) take the group's one gather too, then run their local
    steps; no parameter is gathered on its own, and the price counts one gather per group."""
    from autopar.record.gathers import param_gather_groups

    model, inputs = models.build(name, layers=2, vocab=64, width=32, heads=4, seq=16, batch=8)
    graph = ir.trace(model, inputs)
    mesh = autopar.Mesh((2, 2), cluster="cpu-gloo")
    plan = autopar.plan(model, mesh, inputs, graph=graph, force=autopar.Layout(dp=2, tp=2, zero=3), pipeline=False)
    routes = [[s.kind for s in e.steps] for e in plan.edges if graph.nodes[e.src].role == ir.Role.PARAMETER
              and "all_gather" in [s.kind for s in e.steps]]
    # the case this test is about (GPT's biases; LLaMA has none, its groups hold single gathers)
    assert any(r[0] != "all_gather" or len(r) > 1 for r in routes) == (name == "gpt")
    code = lower(graph, plan, mesh).code
    groups, _ = param_gather_groups(graph, plan.edges)
    assert code.count("autopar_all_gather_group(") == len(groups) == 3  # two blocks and the rest
    assert "autopar_all_gather(p_" not in code
    assert plan.solver["objective_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)

"""Which gradient convention a plan runs with per mesh axis (``autopar.cost_model.gradients``),
checked by hand on a Megatron MLP block and against the step model. Runs on real ranks are in
tests/runtime/test_identical_grads.py."""
import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar import ir
from autopar.record.gradients import grad_sum_reads, identical_ok
from autopar.errors import PlanError
from autopar.solver.plan import Plan


class Block(nn.Module):
    """x -> LayerNorm -> fc1 -> gelu -> fc2 (+ bias after the sum) -> residual: a Megatron MLP."""

    def __init__(self, d=1024, h=4096):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x, y):
        out = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))
        return ((out - y) ** 2).mean()


def _inputs(batch=8, seq=512, d=1024):
    return torch.randn(batch, seq, d, device="meta"), torch.randn(batch, seq, d, device="meta")


# Megatron's layout, by hand: fc1 column-parallel, fc2 row-parallel (its output all-reduced), the
# layer norm, the residual add and the loss replicated over the tensor-parallel axis. (Left free,
# the loss splits over it: its output all-reduce has no backward, and the slice that feeds it
# would all-gather in a whole backward.)
MEGATRON = {"linear": "1d-col", "linear_1": "1d-row", "add": "replicate", "layer_norm": "replicate",
            "sub": "replicate", "pow_1": "replicate", "mean": "replicate"}


def _megatron(identical_axes="auto", force=MEGATRON):
    model = Block().to("meta")
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    inputs = _inputs()
    return model, mesh, inputs, autopar.plan(model, mesh, inputs, force=force, optimizer_sharding=False,
                                              identical_axes=identical_axes)


# Megatron's storage too: the norm and fc2's bias replicated over tp (left free, the dual
# convention stores them split and gathers the three in one call)
MEGATRON_STORED = {**MEGATRON, **{p: "replicated" for p in ("p_ln_weight", "p_ln_bias", "p_fc2_bias")}}


def test_megatron_block_keeps_tensor_parallel_gradients_whole():
    model, mesh, inputs, plan = _megatron()
    graph = ir.trace(model, inputs)
    assert plan.identical_axes == (0,)
    sync = {p.name: p.grad_sync for p in plan.params.values()}
    # LayerNorm and fc2's bias (added after the all-reduce) are replicated over tp and read by ops
    # that do not split it: no sync at all; the split weights never needed one
    assert all(s is None for s in sync.values()), sync
    # one backward all-reduce where fc1 reads the normed input whole (Megatron's "f"); none at fc2
    reads = grad_sum_reads(plan, graph, plan.identical_axes)
    assert list(reads.items()) == [(("linear", 0), (0,))]
    # the dual convention pays the same activation all-reduce (the backward of fc2's forward
    # all-reduce) plus, for the norm and fc2's bias, a sync over tp or (cheaper on A100s: one
    # call for the three) their storage split over tp, gathered in one call and reduce-scattered
    # back: the whole convention prices lower
    _, _, _, dual = _megatron(identical_axes=())
    assert dual.identical_axes == ()
    small = ("ln.weight", "ln.bias", "fc2.bias")
    for p in dual.params.values():
        synced = p.grad_sync is not None and p.grad_sync.axes == (0,)
        stored_split = p.grad_sync is None and p.storage.dim_axes == ((0,),)
        assert (synced or stored_split) if p.name in small else p.grad_sync is None, p
    assert plan.predicted["step_time_s"] < dual.predicted["step_time_s"]
    assert plan.predicted["comm_s"] < dual.predicted["comm_s"]


def test_a_set_the_plan_cannot_run_is_refused_by_name():
    model = Block().to("meta")
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    inputs = _inputs()
    # the norm's gradient reduce-scattered over tp (ZeRO-2, forced: on A100s its all-reduce hides
    # behind backward and is the cheaper); whole there, it has nothing to shard unless it is left
    # pending for the reducer, which the norm (it does not split tp) cannot do: refused when asked
    # for, and "auto" keeps the dual convention
    force = {**MEGATRON, "p_ln_weight": "zero2"}
    plan = autopar.plan(model, mesh, inputs, force=force, identical_axes=())
    assert plan.params["ln.weight"].grad_sync.name == "reduce_scatter+all_gather"
    with pytest.raises(PlanError, match=r"cannot keep gradients whole on axes \(0,\): .*p_ln_weight"):
        autopar.plan(model, mesh, inputs, force=force, identical_axes=(0,))
    assert autopar.plan(model, mesh, inputs, force=force).identical_axes == ()


def test_sync_axes_shrink_only_on_identical_axes():
    # the same hand layout under both conventions: the ILP of the whole convention drops the
    # tensor-parallel axis from exactly the syncs of the parameters no op splitting it reads
    _, _, _, dual = _megatron(identical_axes=(), force=MEGATRON_STORED)
    _, _, _, whole = _megatron(identical_axes=(0,), force=MEGATRON_STORED)
    assert [n.family for n in dual.nodes.values()] == [n.family for n in whole.nodes.values()]
    sync = {p.name: p.grad_sync.axes for p in dual.params.values() if p.grad_sync is not None}
    assert sync == {"ln.weight": (0,), "ln.bias": (0,), "fc2.bias": (0,)}
    assert all(p.grad_sync is None for p in whole.params.values())
    # the dual plan's sync of the norm left in the whole one: its gradient would be pending on the
    # tensor-parallel axis while the norm does not split it (a share and a whole gradient added):
    # refused by name, and codegen lowers no such plan
    from autopar.codegen.lower import lower
    from autopar.record.grad_sync import GradSync

    model, mesh, inputs, _ = _megatron(identical_axes=(), force=MEGATRON_STORED)
    graph = ir.trace(model, inputs)
    bad = dataclasses.replace(whole, params={k: dataclasses.replace(p, grad_sync=GradSync.all_reduce((0,), 4096))
                                             if k == "ln.weight" else p for k, p in whole.params.items()})
    assert "p_ln_weight: its gradient is left pending on identical axis 0" in identical_ok(bad, graph, (0,))
    with pytest.raises(PlanError, match="cannot keep gradients whole on axes"):
        lower(graph, bad, mesh)


def test_a_parameter_may_keep_its_gradient_pending_on_an_identical_axis():
    # data parallel with the batch axis "identical": every weight is read by ops that split the
    # batch, so each may leave its gradient pending for the bucketed sync rather than sum it
    # mid-backward; the ILP picks that. (It prices at most the dual convention's: here less, as the
    # loss's mean may gather its input, whose backward is a local slice when gradients are whole.)
    model = Block(d=64, h=128).to("meta")
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    inputs = _inputs(batch=8, seq=16, d=64)
    dual = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=4), optimizer_sharding=False, identical_axes=())
    whole = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=4), optimizer_sharding=False,
                         identical_axes=(0,))
    graph = ir.trace(model, inputs)
    assert whole.identical_axes == (0,)
    assert {p.name: p.grad_sync.axes for p in whole.params.values()} == {p.name: (0,) for p in whole.params.values()}
    assert grad_sum_reads(whole, graph, (0,)) == {}
    assert identical_ok(whole, graph, (0,)) is None
    assert f"but for {len(whole.params)} parameter(s) whose gradient waits for the bucketed sync" in whole.explain()
    assert whole.predicted["step_time_s"] <= dual.predicted["step_time_s"]
    assert whole.solver["objective_s"] == pytest.approx(whole.predicted["step_time_s"], rel=1e-9)


def test_the_convention_survives_a_save_and_load(tmp_path):
    *_, plan = _megatron()
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back.identical_axes == plan.identical_axes == (0,)
    assert {p.name: p.grad_sync for p in back.params.values()} == {p.name: p.grad_sync for p in plan.params.values()}


def test_an_output_edge_may_span_identical_and_other_axes():
    # a loss summed over both axes of a 2x2 mesh reaching the output through one all-reduce over
    # (0, 1): the output is seeded whole on every axis of its own gathers and all-reduces, so
    # their backwards run nothing and the convention holds on axis 1 alone; the same step on an
    # edge gradients flow back through is refused (and the ILP never routes through one)
    from autopar import models
    from autopar.solver.plan import StepPlan

    model, inputs = models.build("gpt", vocab=64, width=32, layers=2, heads=4, seq=8, batch=4)
    graph = ir.trace(model, inputs)
    plan = autopar.plan(model, autopar.Mesh((2, 2), cluster="cpu-gloo"), inputs, force=autopar.Layout(dp=2, tp=2),
                        idle_axes=(), identical_axes=(1,), pipeline=False)
    assert plan.identical_axes == (1,) and identical_ok(plan, graph, (1,)) is None
    mixed_axes = [e for e in plan.edges if e.backward and any(0 in s.axes and 1 in s.axes for s in e.steps)]
    assert not mixed_axes, mixed_axes
    both = StepPlan("all_reduce", (0, 1), 4, 0.0)
    out = next(e for e in plan.edges if graph.nodes[e.dst].op == "output")
    to_output = dataclasses.replace(plan, edges=[dataclasses.replace(e, steps=[both]) if e is out else e
                                                 for e in plan.edges])
    assert identical_ok(to_output, graph, (1,)) is None
    inner = next(e for e in plan.edges if e.backward)
    backward = dataclasses.replace(plan, edges=[dataclasses.replace(e, steps=[both]) if e is inner else e
                                                for e in plan.edges])
    why = identical_ok(backward, graph, (1,))
    assert why is not None and "only partly identical" in why


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x, y):
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)))
        return nn.functional.cross_entropy(self.fc(h.mean((2, 3))), y)


def test_auto_tries_the_axes_a_data_parallel_plan_all_reduces_over_in_backward():
    # data parallel with batch norms: each norm all-reduces its statistics over the batch axes,
    # whose backward is another all-reduce under the dual convention and local with gradients
    # whole there; "auto" tries those axes though no parameter is split, and keeps the cheapest
    model = _ConvNet()
    inputs = (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    mesh = autopar.Mesh((2, 2), cluster="cpu-gloo")
    plan = autopar.plan(model, mesh, inputs, pipeline=False, idle_axes=())
    prices = {axes: autopar.plan(model, mesh, inputs, pipeline=False, idle_axes=(), identical_axes=axes)
              .predicted["step_time_s"] for axes in ((), (0,), (1,), (0, 1))}
    assert plan.predicted["step_time_s"] == pytest.approx(min(prices.values()), rel=1e-9), prices
    assert plan.identical_axes and min(prices.values()) < prices[()], prices

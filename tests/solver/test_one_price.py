"""One price: the ILP's objective of the plan it chooses is the step model's price of that plan,
to rounding, on every preset, for the layouts users force and the ones the planner picks. The
ILP's coefficients and the step model read the same formulas: each gradient sync group's first
calls paid once (``cost_model.grad_sync``), a reshard's backward as the step model prices it
(``cost_model.gradients.backward_route_s``), parameters gathered a layer per call, the op
overheads a constant, on GPUs the syncs hidden behind backward but for the last bucket, and the
gradient convention of each set of identical axes tried (``record.gradients``) in its own ILP."""
import sys
from pathlib import Path

import pytest

import autopar
from autopar import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models_zoo  # noqa: E402

CLUSTERS = ("cpu-gloo", "a100-80g", "h100-80g")
LAYOUTS = {
    (4,): (None, autopar.Layout(dp=4), autopar.Layout(dp=4, zero=2), autopar.Layout(dp=4, zero=3), autopar.Layout(tp=4)),
    (2, 2): (None, autopar.Layout(dp=2, tp=2), autopar.Layout(dp=2, tp=2, zero=2), autopar.Layout(dp=2, tp=2, zero=3)),
}


def _models():
    return {
        "gpt": models.build("gpt", layers=2),
        "llama": models.build("llama", layers=2),
        "mlp": models.build("mlp"),
        "mingpt": models_zoo.mingpt(),
        "vit": models_zoo.vit(),
    }


def _check(plan, label):
    p = plan.predicted
    assert plan.solver["objective_s"] == pytest.approx(p["step_time_s"], rel=1e-9), (label, plan.solver, p)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_the_objective_is_the_step_models_price_of_the_chosen_plan(cluster):
    checked, whole = 0, 0
    for name, (model, inputs) in _models().items():
        for shape, layouts in LAYOUTS.items():
            mesh = autopar.Mesh(shape, cluster=cluster)
            for layout in layouts:
                if layout is not None and layout.tp > 1 and name in ("vit",):
                    continue  # (tensor parallel layouts name transformer blocks of language models)
                label = (name, shape, cluster, layout)
                try:
                    plan = autopar.plan(model, mesh, inputs, pipeline=False, force=layout)
                except autopar.PlanError:
                    continue  # a layout this model cannot take
                _check(plan, label)
                checked += 1
                whole += bool(plan.identical_axes)
    assert checked >= 35, checked
    assert whole >= 1, "no plan kept gradients whole on any axis: the convention's prices went untested"


def test_the_convention_is_chosen_by_the_ilps_of_each_set():
    """``identical_axes="auto"`` (the default) solves one ILP per set of axes kept whole: the plan
    is the cheapest of them, and every set's objective is its plan's price."""
    model, inputs = models.build("gpt", layers=2)
    for cluster in CLUSTERS:
        mesh = autopar.Mesh((2, 2), cluster=cluster)
        layout = autopar.Layout(dp=2, tp=2)
        plan = autopar.plan(model, mesh, inputs, pipeline=False, force=layout)
        _check(plan, cluster)
        prices = {}
        for axes in ((), (0,), (1,), (0, 1)):
            try:
                forced = autopar.plan(model, mesh, inputs, pipeline=False, force=layout, identical_axes=axes)
            except autopar.PlanError:
                continue
            assert forced.identical_axes == axes
            _check(forced, (cluster, axes))
            prices[axes] = forced.predicted["step_time_s"]
        assert () in prices and (1,) in prices, prices  # dual, and Megatron's on the tensor-parallel axis
        assert plan.predicted["step_time_s"] == pytest.approx(min(prices.values()), rel=1e-9), (cluster, prices)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_accumulated_microbatches_price_as_their_ilp(cluster):
    """One stage run on 4 microbatches (gradient accumulation) is priced through the stage tables:
    its step is 4 x its stage's time per microbatch, which is the ILP's objective of that stage
    (per-step work at a quarter a run). A parameter read by two layers (GPT's tied embedding and
    head) is counted once in a stage holding both."""
    checked = 0
    for name, build in (("gpt", dict(layers=2, batch=16)), ("llama", dict(layers=2, batch=16))):
        model, inputs = models.build(name, **build)
        for shape, layouts in LAYOUTS.items():
            for layout in layouts:
                try:
                    plan = autopar.plan(model, autopar.Mesh(shape, cluster=cluster), inputs, force=layout,
                                        pipeline=autopar.Pipeline(stages=1, microbatches=4))
                except autopar.PlanError:
                    continue
                (stage,) = plan.pipeline.stages
                assert plan.pipeline.microbatches == 4
                label = (name, shape, layout)
                assert stage.time_per_microbatch_s == pytest.approx(stage.plan.solver["objective_s"], rel=1e-9), label
                assert plan.predicted["step_time_s"] == pytest.approx(4 * stage.time_per_microbatch_s, rel=1e-9), label
                checked += 1
    assert checked >= 12, checked

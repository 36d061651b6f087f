"""Plan: JSON round trip, summary, model check, explain."""
import json
import warnings

import pytest

import autopar
from autopar import ir, models
from autopar.errors import PlanError


@pytest.fixture(scope="module")
def gpt_plan():
    warnings.simplefilter("ignore")
    model, inputs = models.build("gpt", layers=2)
    return autopar.plan(model, autopar.Mesh((2, 2)), inputs, pipeline=False)  # the one-stage plan's contract


def test_json_round_trip_is_exact(gpt_plan, tmp_path):
    path = tmp_path / "plan.json"
    gpt_plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == gpt_plan
    assert loaded.to_json() == gpt_plan.to_json()
    assert json.loads(path.read_text())["schema_version"] == 6
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()


def test_a_schema_4_file_reads_its_gradient_syncs(gpt_plan, tmp_path):
    """Schema 4 spelt a parameter's sync ``[kind, axes, bytes]``, ZeRO-2's kind "<sum>+all_gather"."""
    d = gpt_plan.to_json()
    d["schema_version"] = 4
    for p in d["params"]:
        if p["grad_sync"] is not None:
            g = p["grad_sync"]
            p["grad_sync"] = ["+".join(([g["sum_by"]] + (["all_gather"] if g["split"] else []))), g["axes"], g["nbytes"]]
    (tmp_path / "v4.json").write_text(json.dumps(d))
    loaded = autopar.Plan.load(tmp_path / "v4.json")
    assert {n: p.grad_sync for n, p in loaded.params.items()} == {n: p.grad_sync for n, p in gpt_plan.params.items()}
    p = next(p for p in d["params"] if p["grad_sync"] is not None)
    p["grad_sync"][0] = "all_reduce+broadcast"
    (tmp_path / "v4-bad.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match="'all_reduce\\+broadcast' is not one this autopar runs"):
        autopar.Plan.load(tmp_path / "v4-bad.json")


def test_summary_has_the_contract_keys(gpt_plan):
    s = gpt_plan.summary()
    for key in ("step_time_s", "compute_s", "comm_s", "memory_bytes_per_device", "families", "collectives"):
        assert key in s
    p = gpt_plan.predicted
    assert s["step_time_s"] == pytest.approx(p["compute_s"] + p["overhead_s"] + p["comm_s"] + p["optimizer_s"] + p["grad_accumulate_s"])
    assert p["comm_s"] == pytest.approx(p["reshard_s"] + p["op_comm_s"] + p["exposed_sync_s"] + p["param_gather_s"]
                                        + p["zero2_fresh_s"])
    graph = ir.trace(*models.build("gpt", layers=2))
    assert gpt_plan.solver["objective_s"] == pytest.approx(ilp_objective(gpt_plan, graph) + p["overhead_s"], rel=1e-9)
    for kind, axes, nbytes in s["collectives"]:
        assert kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
        assert all(0 <= a < 2 for a in axes) and nbytes > 0


def test_plan_for_another_model_is_rejected(gpt_plan):
    other, inputs = models.build("gpt", layers=3)
    graph = ir.trace(other, inputs)
    with pytest.raises(PlanError, match="made for model 'GPT'.*Make a new plan"):
        gpt_plan.check_model(graph.fingerprint(), "GPT with 3 layers")
    same, inputs = models.build("gpt", layers=2)
    gpt_plan.check_model(ir.trace(same, inputs).fingerprint())


def test_bad_plan_files(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        autopar.Plan.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        autopar.Plan.load(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({"schema_version": 0}))
    with pytest.raises(PlanError, match="schema version 0"):
        autopar.Plan.load(tmp_path / "old.json")
    (tmp_path / "other.json").write_text(json.dumps({"schema_version": 1, "nodes": []}))
    with pytest.raises(PlanError, match="not an autopar plan"):
        autopar.Plan.load(tmp_path / "other.json")


def test_explain_names_layers_ops_and_totals(gpt_plan):
    text = gpt_plan.explain()
    assert "transformer.h.0" in text
    assert "linear" in text and "predicted step time" in text and "memory per device" in text


def test_more_bad_plan_files(tmp_path):
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(PlanError, match="JSON object was expected"):
        autopar.Plan.load(tmp_path / "list.json")
    with pytest.raises(PlanError, match="cannot read plan file"):
        autopar.Plan.load(tmp_path)
    (tmp_path / "nodes.json").write_text(json.dumps({"schema_version": 1, "nodes": "x", "edges": [], "params": []}))
    with pytest.raises(PlanError, match="not an autopar plan"):
        autopar.Plan.load(tmp_path / "nodes.json")


def test_explain_collapses_identical_layers():
    model, inputs = models.build("gpt", layers=4)
    text = autopar.plan(model, autopar.Mesh((2, 2)), inputs).explain()
    assert "more layer(s) with the same choices as transformer.h." in text


def test_bad_budgets_and_solvers_are_config_errors():
    model, inputs = models.build("mlp")
    mesh = autopar.Mesh((2,))
    for budget in (float("inf"), float("nan"), True, "1e400", -5):
        with pytest.raises(autopar.ConfigError, match="memory budget|memory size"):
            autopar.plan(model, mesh, inputs, memory_budget=budget)
    with pytest.raises(autopar.ConfigError, match="unknown ILP solver 'gurobi'"):
        autopar.plan(model, mesh, inputs, solver="gurobi")


def test_bf16_tuple_outputs_price_their_element_bytes():
    model, inputs = models.build("gpt", layers=1, dtype=__import__("torch").bfloat16)
    plan = autopar.plan(model, autopar.Mesh((4,)), inputs, pipeline=False)
    assert plan.solver["objective_s"] == pytest.approx(ilp_objective(plan, ir.trace(model, inputs)) + plan.predicted["overhead_s"],
                                                       rel=1e-9)
    assert plan.predicted["reshard_s"] == pytest.approx(sum(e.cost_s for e in plan.edges), rel=1e-9)


def ilp_objective(plan, graph) -> float:
    """The ILP's objective re-added from the plan: node prices (ops' compute, parameters'
    optimizer step, collectives inside lowered ops), edge reshards (forward and backward) and the
    parameters' gradient sync (the objective adds the op overheads)."""
    from autopar.cost_model.lowered import lowered_comm_s
    from autopar.ir.losses import counted_from_inputs
    from autopar.sharding_spec.strategy import needs_lowering

    mesh = autopar.Mesh.from_dict(plan.mesh)
    in_ops = sum(lowered_comm_s(n.target, n.family, n.inputs, n.output, mesh,
                                counted_locally=counted_from_inputs(graph, graph.nodes[n.name]))
                 for n in plan.nodes.values() if needs_lowering(n.family))
    return (sum(n.compute_s for n in plan.nodes.values()) + in_ops + sum(e.cost_s for e in plan.edges)
            + sum(p.grad_sync_s for p in plan.params.values()))


def test_diff_of_a_plan_with_itself_is_empty_and_a_forced_layout_differs(gpt_plan):
    assert gpt_plan.diff(gpt_plan).empty and gpt_plan.diff(gpt_plan).lines() == ["no differences"]
    model, inputs = models.build("gpt", layers=2)
    other = autopar.plan(model, autopar.Mesh((2, 2)), inputs, force=autopar.Layout(dp=2, tp=2))
    d = gpt_plan.diff(other)
    assert not d.empty and d.same_model
    assert d.nodes or d.storage
    changed = {c.name for c in d.nodes}
    for c in d.nodes:
        assert gpt_plan.nodes[c.name].family in c.before and other.nodes[c.name].family in c.after
    assert all(gpt_plan.nodes[n].family != other.nodes[n].family or gpt_plan.nodes[n].output != other.nodes[n].output
               or gpt_plan.nodes[n].inputs != other.nodes[n].inputs for n in changed)
    assert d.step_time_s == (gpt_plan.predicted["step_time_s"], other.predicted["step_time_s"])


def test_diff_sees_totals_and_cluster_changes():
    model, inputs = models.build("gpt", layers=2)
    a = autopar.plan(model, autopar.Mesh((4,)), inputs, force=autopar.Layout(dp=4))
    b = autopar.plan(model, autopar.Mesh((4,)), inputs, force=autopar.Layout(dp=4), optimizer="sgd")
    d = a.diff(b)
    assert not d.empty and d.memory_bytes[1] < d.memory_bytes[0]
    c = autopar.plan(model, autopar.Mesh((4,), cluster="a100-80g"), inputs, force=autopar.Layout(dp=4))
    lines = a.diff(c).lines()
    assert any(line.startswith("cluster: cpu-gloo -> a100-80g") for line in lines)
    assert not any(line.startswith("mesh:") for line in lines)


def test_an_outputs_all_reduce_has_no_backward():
    # every rank seeds the loss with the same gradient: the all-reduce that brings the batch-split
    # loss to every rank runs forward only (codegen seeds it whole), and is priced so
    model, inputs = models.build("gpt", layers=1)
    plan = autopar.plan(model, autopar.Mesh((4,), cluster="cpu-gloo"), inputs, force=autopar.Layout(dp=4))
    assert plan.nodes["cross_entropy_loss"].family == "loss-batch-split(mean)"
    (out,) = [e for e in plan.edges if e.dst == "output"]
    assert [s.kind for s in out.steps] == ["all_reduce"] and not out.backward
    assert out.cost_s == out.forward_s
    loss_bytes = out.steps[0].nbytes
    assert plan.summary()["collectives"].count(("all_reduce", (0,), loss_bytes)) == 1

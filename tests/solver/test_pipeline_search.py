"""The pipeline search around the stage DP: units, groups, microbatch counts, price attribution,
and whole searches on small models (no processes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import autopar
from autopar import ir, models
from autopar.cost_model.schedules import bubble_fraction, interleaved_time, simulate_shared
from autopar.record.schedules import SCHEDULES, schedule_orders
from autopar.errors import ConfigError, PlanError
from autopar.ir.blocks import unit_of_nodes
from autopar.ir.losses import unread_outputs
from autopar.solver.microbatches import microbatch_candidates
from autopar.solver.pipeline import (
    Pipeline, _moved_cuts, _nudged, _search_counts, layer_groups, row_options, search, shared_core_time, sub_mesh,
)
from autopar.solver.stage_dp import StageSolution
from autopar.solver.stage_prices import step_extras, unit_prices


def test_microbatch_candidates():
    assert microbatch_candidates(16, None) == [1, 2, 4, 8, 16]
    got = microbatch_candidates(1536, None)
    assert 192 in got and 3 in got and 1 in got and max(got) <= 512
    assert all(1536 % c == 0 and ((1536 // c) & (1536 // c - 1)) == 0 for c in got if c > 1)
    assert microbatch_candidates(16, 4) == [4]
    with pytest.raises(ConfigError, match="does not divide"):
        microbatch_candidates(16, 3)


def test_layer_groups():
    assert layer_groups(96, 24) == [list(range(i, i + 4)) for i in range(0, 96, 4)]
    assert layer_groups(5, 24) == [[0], [1], [2], [3], [4]]
    # sizes differ by at most one, longer first, in order, covering every layer once
    groups = layer_groups(50, 16)
    assert [len(g) for g in groups] == [4, 4] + [3] * 14
    assert sum(groups, []) == list(range(50))


@pytest.mark.parametrize("n_layers", [4, 7, 50, 96, 97])
@pytest.mark.parametrize("stages", [1, 2, 3, 8, 16, 32])
def test_unit_groups_allow_equal_stages(n_layers, stages):
    """For a known stage count the units are a multiple of it (at most MAX_UNITS unless the
    count itself is larger), so stages of equal layer counts, up to one, exist."""
    from autopar.solver.pipeline import MAX_UNITS, unit_groups

    groups = unit_groups(n_layers, stages)
    assert sum(groups, []) == list(range(n_layers))
    if stages > n_layers:
        assert len(groups) == min(n_layers, MAX_UNITS)
        return
    if len(groups) == n_layers:  # a unit per layer: every split is there
        return
    assert len(groups) % stages == 0 and len(groups) <= max(MAX_UNITS, stages)
    per_stage = len(groups) // stages
    sizes = [sum(len(g) for g in groups[k * per_stage:(k + 1) * per_stage]) for k in range(stages)]
    assert max(sizes) - min(sizes) <= per_stage  # each unit differs by at most one layer
    if n_layers % stages == 0 and (n_layers // stages) % per_stage == 0:
        assert len(set(sizes)) == 1


def test_unit_groups_for_fixed_layers_are_the_stages():
    from autopar.solver.pipeline import unit_groups

    assert unit_groups(4, 2, (3, 1)) == [[0, 1, 2], [3]]
    assert unit_groups(96, None, (6,) * 16) == [list(range(i, i + 6)) for i in range(0, 96, 6)]
    with pytest.raises(ConfigError, match="covers 95 layers"):
        unit_groups(96, None, (5,) + (6,) * 15)


def test_search_counts_finds_the_minimum_with_few_evaluations():
    counts = list(range(1, 30))
    calls = []

    class R:
        def __init__(self, v):
            self.step_time = v

    def evaluate(c):
        calls.append(c)
        if c < 5:
            return None  # too few microbatches: nothing fits
        return (R((c - 17) ** 2 + 1.0),)

    best = _search_counts(counts, evaluate)
    assert best[0].step_time == 1.0
    assert len(set(calls)) < len(counts) // 2


def test_pipeline_options_are_checked():
    with pytest.raises(ConfigError, match="schedules are"):
        Pipeline(schedule="round-robin")
    with pytest.raises(ConfigError, match="recompute"):
        Pipeline(schedule="zero-bubble", recompute=True)
    with pytest.raises(ConfigError, match="interleaved-1f1b"):
        Pipeline(schedule="zero-bubble", virtual_stages=2)
    with pytest.raises(ConfigError, match="at least one stage"):
        Pipeline(stages=0)
    with pytest.raises(ConfigError) as err:
        Pipeline(schedule="zero-bubble", recompute=True)
    assert str(err.value).endswith("use recompute with 'gpipe', '1f1b' or 'interleaved-1f1b'")
    with pytest.raises(ConfigError) as err:
        Pipeline(schedule="1f1b", virtual_stages=2)
    assert str(err.value).endswith("only schedule='interleaved-1f1b' does that, not '1f1b'")
    # several stages per rank: the interleaved schedule, two per rank unless given
    assert (Pipeline(virtual_stages=3).schedule, Pipeline(virtual_stages=3).virtual_stages) == ("interleaved-1f1b", 3)
    assert Pipeline(schedule="interleaved-1f1b").virtual_stages == Pipeline(schedule="interleaved-1f1b", virtual_stages=1).virtual_stages == 2
    assert Pipeline(schedule="interleaved-1f1b", layers=(1, 1, 1, 1)).stages == 2 and Pipeline(layers=(1, 1, 1, 1)).stages == 4


def test_one_stage_per_rank_asked_for_searches_without_interleaving():
    """``Pipeline(virtual_stages=1)`` fixes one stage per rank: the searched interleaved schedule
    is left out (it used to reach the stage DP with one stage per rank, which refused it)."""
    model, inputs = models.build("gpt", layers=4, batch=8)
    choice = search(model, autopar.Mesh((2,), cluster="a100-80g"), inputs, pipeline=Pipeline(virtual_stages=1))
    assert choice.pipeline.virtual_stages == 1 and choice.schedule != "interleaved-1f1b"


def test_units_and_attribution():
    model, inputs = models.build("gpt", layers=3)
    graph = ir.trace(model, inputs)
    unit = unit_of_nodes(graph)
    assert set(unit.values()) == {0, 1, 2}
    by_layer = {n.name: n.layer for n in graph.nodes.values()}
    embedding = next(n for n in graph.nodes.values() if n.op == "call_function" and "embedding" in n.target)
    assert unit[embedding.name] == 0
    loss = next(n for n in graph.nodes.values() if n.op == "call_function" and "cross_entropy" in n.target)
    assert unit[loss.name] == 2
    assert all(unit[name] == graph.layers.index(layer) for name, layer in by_layer.items() if layer is not None)
    mesh = autopar.Mesh((2,), cluster="a100-80g")
    plan = autopar.plan(model, mesh, graph=graph)
    prices = unit_prices(plan, graph, mesh)
    compute = sum(n.compute_s for name, n in plan.nodes.items() if graph.nodes[name].op == "call_function")
    cluster = mesh.resolved_cluster()
    ops = [graph.nodes[name] for name in plan.nodes if graph.nodes[name].op == "call_function"]
    grad = ir.graph.needs_grad(graph)
    with_backward = sum(1 for n in ops if any(i in grad for i in n.inputs))  # the step model's overheads, too
    assert 0 < with_backward < len(ops)
    edges = sum(e.cost_s for e in plan.edges)
    overheads = len(ops) * cluster.op_overhead_s + with_backward * cluster.backward_op_overhead_s
    assert overheads == pytest.approx(plan.predicted["overhead_s"], rel=1e-12)
    assert prices.per_microbatch_s.sum() >= compute + edges + overheads - 1e-12
    # every parameter is held by some unit; the tied embedding by the first and the last
    params = sum(n.memory_bytes for name, n in plan.nodes.items() if graph.nodes[name].role == ir.Role.PARAMETER)
    wte = plan.nodes[graph.params["transformer.wte.weight"]].memory_bytes
    assert prices.static_bytes.sum() == pytest.approx(params + wte)
    assert prices.boundary_bytes[0] == 0 and (prices.boundary_bytes[1:] > 0).all()
    # a parameter adds its gradient up every microbatch and pays its optimizer once per step: its
    # accumulation moves from the per-step prices to the per-microbatch ones, in the units reading it
    import dataclasses
    plan = autopar.plan(model, mesh, graph=graph, microbatches=4)
    prices = unit_prices(plan, graph, mesh)
    assert all(p.accumulate_s > 0 for p in plan.params.values())
    free = dataclasses.replace(plan, params={k: dataclasses.replace(p, accumulate_s=0.0) for k, p in plan.params.items()})
    without = unit_prices(free, graph, mesh)
    added = prices.per_microbatch_s - without.per_microbatch_s
    assert (added > 0).all()
    assert without.per_step_s - prices.per_step_s == pytest.approx(added)
    acc = {p.node: p.accumulate_s for p in plan.params.values()}
    wte = graph.params["transformer.wte.weight"]
    assert added.sum() == pytest.approx(sum(acc.values()) + acc[wte])  # the tied weight by both its units


def test_a_deferred_weight_half_holds_the_gradients_its_weights_read():
    """Per unit, the output bytes of every op reading a parameter (what torch's input half keeps
    for the weight half: a GPT layer's four linears and two layer norms; the last unit's head
    too), less, on the unit ending a stage, what is saved after its last such op (the loss's
    inputs: the input half frees them)."""
    width, seq, batch, vocab = 64, 32, 8, 512
    model, inputs = models.build("gpt", layers=3, width=width, seq=seq, batch=batch, vocab=vocab)
    graph = ir.trace(model, inputs)
    mesh = autopar.Mesh((1,), cluster="a100-80g")
    prices = unit_prices(autopar.plan(model, mesh, graph=graph), graph, mesh)
    tokens = batch * seq * 4  # float32 bytes per feature
    layer = tokens * (3 * width + width + 4 * width + width + 2 * width)  # qkv, proj, fc, proj, 2 norms
    assert prices.weight_grad_bytes[1] == layer
    assert prices.weight_grad_bytes[0] == layer + tokens * width + seq * width * 4  # token, position embeddings
    assert prices.weight_grad_bytes[2] == layer + tokens * width + tokens * vocab  # the final norm and the head
    assert prices.tail_bytes[2] >= tokens * vocab  # the logits the loss saved
    assert prices.deferred_between(1, 1) == layer - prices.tail_bytes[1]
    assert prices.deferred_between(0, 2) == pytest.approx(prices.weight_grad_bytes.sum() - prices.tail_bytes[2])


def test_row_options_and_sub_mesh():
    assert row_options(autopar.Mesh((4,))) == [1, 2, 3, 4]
    assert row_options(autopar.Mesh((128, 8))) == [1, 2, 4, 8, 16, 32, 64, 128]
    mesh = autopar.Mesh((4, 8), cluster="a100-80g")
    sm = sub_mesh(mesh, 2)
    assert sm.shape == (2, 8) and sm.links() == mesh.links()


def _check_choice(choice, mesh, n_layers, budget):
    virtual = choice.pipeline.virtual_stages
    blocks = len(choice.stages) // virtual  # interleaved: stage s runs on block s mod blocks
    rows = [s.rows for s in choice.stages]
    assert rows[0][0] == 0 and rows[blocks - 1][1] == mesh.shape[0] - 1
    assert all(b[0] == a[1] + 1 for a, b in zip(rows[:blocks], rows[1:blocks]))
    assert all(rows[s] == rows[s % blocks] for s in range(len(rows)))
    layers = [s.layers for s in choice.stages]
    assert layers[0][0] == 0 and layers[-1][1] == n_layers - 1
    assert all(b[0] == a[1] + 1 for a, b in zip(layers, layers[1:]))
    assert all(s.memory_bytes <= budget for s in choice.stages)
    times = [s.time_per_microbatch_s for s in choice.stages]
    if choice.schedule == "zero-bubble":  # its step is simulated (the weight halves fill the drain)
        from autopar.cost_model.schedules import SPLIT_BACKWARD_EXTRA

        want = simulate_shared(times, [1] * len(times), choice.microbatches, "zero-bubble", math.inf)
        # never more than 1F1B's with every backward split
        assert want <= (sum(times) + (choice.microbatches - 1) * max(times)) * (1 + 2 / 3 * SPLIT_BACKWARD_EXTRA)
    elif virtual > 1:
        want = interleaved_time(times, blocks, virtual, choice.microbatches)
    else:
        want = sum(times) + (choice.microbatches - 1) * max(times)
    # plus what runs after the schedule (the loss broadcast, tied parameters' sums)
    stages = [(s.layers[0], s.layers[1], 0) for s in choice.stages]
    extras = step_extras(choice.graph, [[u] for u in range(n_layers)], stages, blocks, mesh)
    assert (extras > 0) == (len(stages) > 1)
    assert choice.step_time_s == pytest.approx(want + extras)
    ranks = [r for s in choice.stages[:blocks] for r in s.ranks]
    assert ranks == list(range(mesh.size))
    summary = choice.summary()
    assert summary["schedule"] in SCHEDULES and 0 <= summary["bubble_fraction"] < 1


def test_search_without_memory_pressure_keeps_one_stage_when_it_is_fastest():
    model, inputs = models.build("gpt", layers=4, batch=8)
    mesh = autopar.Mesh((2,), cluster="a100-80g")
    choice = search(model, mesh, inputs)
    _check_choice(choice, mesh, 4, math.inf)
    one = search(model, mesh, inputs, pipeline=Pipeline(stages=1, microbatches=1))
    assert choice.step_time_s <= one.step_time_s + 1e-12


def test_search_under_a_tight_budget():
    """Under a budget the fastest layout does not meet, every stage fits it, the step is no faster
    than without the budget, and the search's answer is the best over every fixed stage count."""
    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=16)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    free = search(model, mesh, inputs)
    budget = 0.8 * max(s.memory_bytes for s in free.stages)
    choice = search(model, mesh, inputs, memory_budget=budget)
    _check_choice(choice, mesh, 8, budget)
    assert choice.step_time_s >= free.step_time_s - 1e-12
    fixed = {}
    for n in (1, 2, 3, 4):
        try:
            fixed[n] = search(model, mesh, inputs, memory_budget=budget,
                              pipeline=Pipeline(stages=n, microbatches=choice.microbatches, schedule=choice.schedule)).step_time_s
        except (PlanError, ConfigError):  # no plan fits, or stages that do not tile the rows (3 of 4)
            pass
    assert 3 not in fixed
    assert choice.step_time_s == pytest.approx(min(fixed.values()), rel=0.02)  # the search skips t_max within 1%
    if 1 not in fixed:
        assert len(choice.stages) >= 2


def test_scaled_graphs_give_the_searchs_answer_with_fewer_traces(monkeypatch):
    """Past its first two traces the search reads each microbatch size's graph off them
    (``ir.batch_scaling``) and traces only the count it picks: the same choice, step and stage plans
    as tracing every count, the chosen graph a real trace."""
    import autopar.solver.pipeline as pipeline_module

    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=64)
    mesh = autopar.Mesh((4, 2), cluster="a100-80g")
    scaled = search(model, mesh, inputs, memory_budget=2e9)
    monkeypatch.setattr(pipeline_module, "scaled_graph", lambda *a: None)
    traced = search(model, mesh, inputs, memory_budget=2e9)
    assert scaled.timing["scaled_graphs"] >= 1 and traced.timing["scaled_graphs"] == 0
    assert scaled.timing["traces"] < traced.timing["traces"]
    assert (scaled.microbatches, scaled.schedule, len(scaled.stages)) == (traced.microbatches, traced.schedule, len(traced.stages))
    assert scaled.step_time_s == traced.step_time_s
    def content(st):  # the stage's plan, less the solver's timings
        return st.plan.nodes, st.plan.edges, st.plan.params, st.plan.predicted, st.plan.model_fingerprint

    assert [content(st) for st in scaled.stages] == [content(st) for st in traced.stages]
    assert scaled.graph.fingerprint() == traced.graph.fingerprint() and scaled.graph.nodes[scaled.graph.inputs[0]].fx_node is not None


def _one_integer_off(graph):
    """``graph`` with the last integer argument of its first op that has one made one larger: a
    graph that is not what tracing gives."""
    node = next(n for n in graph.nodes.values() if n.op == "call_function" and n.args and isinstance(n.args[-1], int))
    node.args = (*node.args[:-1], node.args[-1] + 1)
    return graph


def test_a_scaled_graph_that_is_not_the_trace_is_priced_on_the_trace(monkeypatch):
    """Where the model's program changes with the batch (the scaled graph is not what tracing the
    chosen count gives), the search prices that count again on its trace."""
    import autopar.solver.pipeline as pipeline_module
    from autopar.ir.batch_scaling import scaled_graph

    def off_by_one(*args):  # a prediction that is wrong somewhere
        g = scaled_graph(*args)
        return None if g is None else _one_integer_off(g)

    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=64)
    mesh = autopar.Mesh((4, 2), cluster="a100-80g")
    monkeypatch.setattr(pipeline_module, "scaled_graph", off_by_one)
    wrong = search(model, mesh, inputs, memory_budget=2e9)
    monkeypatch.setattr(pipeline_module, "scaled_graph", lambda *a: None)
    traced = search(model, mesh, inputs, memory_budget=2e9)
    assert wrong.graph.fingerprint() == traced.graph.fingerprint()  # what it answers with was traced
    assert wrong.stages[0].plan.model_fingerprint == traced.stages[0].plan.model_fingerprint


def test_search_needs_layers():
    model, inputs = torch.nn.Linear(4, 4), (torch.randn(8, 4),)
    with pytest.raises(PlanError, match="no repeated layers"):
        search(model, autopar.Mesh((2,)), inputs)


def test_plan_with_pipeline_stages_round_trips_and_explains(tmp_path):
    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=16)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    # (unpinned, the search interleaves 2 stages per rank here, each recomputing its own way)
    plan = autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(stages=2, schedule="1f1b"),
                        memory_budget="800MiB")
    assert plan.pipeline is not None and len(plan.pipeline.stages) == 2
    pipe = plan.summary()["pipeline"]
    assert [s["ranks"] for s in pipe["stages"]] == [[0, 1], [2, 3]]
    assert [s["layers"] for s in pipe["stages"]][0][0] == 0 and pipe["stages"][-1]["layers"][1] == 7
    assert pipe["schedule"] == "1f1b" and pipe["microbatches"] > 1 and 0 <= pipe["bubble_fraction"] < 1
    assert all(s["memory_bytes"] <= 800 * 2**20 for s in pipe["stages"])
    # every node of the microbatch graph runs in some stage
    graph = ir.trace(model, tuple(t[: 16 // pipe["microbatches"]] for t in inputs))
    ops = {n.name for n in graph.nodes.values() if n.op == "call_function"}
    assert ops <= {name for s in plan.pipeline.stages for name in s.plan.nodes}
    path = tmp_path / "pipe.json"
    plan.save(path)
    assert autopar.Plan.load(path) == plan
    assert autopar.Plan.load(path).to_json() == plan.to_json()  # sub-meshes' links included
    # each stage carries its reshards of what it receives; a version-3 file, without them, gets the same
    # from the graph (``with_received``)
    from autopar.solver.receives import received_edges, with_received

    assert [s.received for s in plan.pipeline.stages] == received_edges(graph, plan.pipeline.stages)
    assert plan.pipeline.stages[0].received == []  # the first stage receives the user inputs alone
    old = plan.to_json()
    old["schema_version"] = 3
    for st in old["pipeline"]["stages"]:
        del st["received"]
    path.write_text(__import__("json").dumps(old))
    loaded = autopar.Plan.load(path)
    assert [s.received for s in loaded.pipeline.stages] == [None, None]
    assert with_received(loaded, graph) == plan
    text = plan.explain()
    first, last = pipe["stages"][1]["layers"]
    assert "pipeline: 2 stages" in text and f"stage 1: layers {first}-{last}" in text and "--- stage 0 ---" in text
    assert "a call (pmodel(...) then backward()) runs GPipe's order" in text


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b"])
def test_a_calls_step_is_gpipes_order_over_the_same_stages(schedule):
    model, inputs = models.build("gpt", device="meta", layers=8, width=256, heads=8, seq=64, vocab=1024, batch=16)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    plan = autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(stages=2, schedule=schedule, microbatches=4))
    step, call = plan.predicted["step_time_s"], plan.predicted["call_step_time_s"]
    if schedule in ("gpipe", "1f1b"):  # the same stage times in the same step formula
        assert call == pytest.approx(step, rel=1e-9)
    else:  # the schedules that hide part of GPipe's bubble
        assert call >= step * (1 - 1e-9)


def test_one_stage_plan_reports_one_stage_and_version_1_files_load(tmp_path):
    import json

    model, inputs = models.build("gpt", layers=2)
    plan = autopar.plan(model, autopar.Mesh((2,)), inputs)
    pipe = plan.summary()["pipeline"]
    assert pipe == {"stages": [{"layers": [0, 1], "ranks": [0, 1], "mesh_shape": [2], "recompute": [],
                                "recompute_kind": "none"}],
                    "schedule": None, "microbatches": 1, "virtual_stages": 1, "bubble_fraction": 0.0}
    old = plan.to_json()
    old["schema_version"] = 1
    del old["pipeline"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    assert autopar.Plan.load(path) == plan


def test_recomputation_is_chosen_where_only_it_fits():
    """Somewhere between the memory the fastest layout needs and what nothing meets, a budget fits
    only with activations recomputed: the search then recomputes (it says which layers), and with
    recompute=False the same budget raises PlanError."""
    model, inputs = models.build("gpt", device="meta", layers=8, width=512, heads=8, seq=1024, vocab=4096, batch=16)
    mesh = autopar.Mesh((2,), cluster="a100-80g")
    free = search(model, mesh, inputs, pipeline=Pipeline(recompute=False))
    assert not any(s.recompute for s in free.stages)
    top = max(s.memory_bytes for s in free.stages)
    found = False
    for f in (0.7, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08):
        budget = top * f
        try:
            search(model, mesh, inputs, memory_budget=budget, pipeline=Pipeline(recompute=False))
            continue
        except PlanError:
            pass
        try:
            choice = search(model, mesh, inputs, memory_budget=budget)
        except PlanError:
            break
        assert any(s.recompute for s in choice.stages)
        for s in choice.stages:
            assert s.recompute in ([], list(range(s.layers[0], s.layers[1] + 1)))
            assert s.memory_bytes <= budget
        assert choice.step_time_s > free.step_time_s  # recomputing costs a forward
        found = True
        break
    assert found, "no budget between 'fits without recomputation' and 'fits with nothing' was found"


def test_one_stage_without_memory_pressure_takes_one_microbatch():
    """More microbatches on one stage only add per-microbatch costs (gradient sync and optimizer are
    paid once per step, priced once)."""
    model, inputs = models.build("gpt", layers=2, batch=8)
    choice = search(model, autopar.Mesh((2,), cluster="cpu-gloo"), inputs, pipeline=Pipeline(stages=1))
    assert choice.microbatches == 1


class _BetweenLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0:
                x = torch.tanh(x) * 0.5  # root-level ops between layer 0 and layer 1
        return self.head(x).mean()


def test_ops_between_layers_join_the_layer_before_them():
    graph = ir.trace(_BetweenLayers(), (torch.randn(4, 8),))
    unit = unit_of_nodes(graph)
    tanh = next(n for n in graph.nodes.values() if n.op == "call_function" and "tanh" in n.target)
    assert unit[tanh.name] == 0
    head = next(n for n in graph.nodes.values() if n.module_path == "head" and n.op == "call_function")
    assert unit[head.name] == len(graph.layers) - 1


def test_two_nodes_keep_activation_collectives_inside_the_node():
    """2 nodes x 8 A100s (slow inter-node link on axis 0): a 24-layer, 4096-wide GPT's activations are
    resharded only over the node's devices; across nodes go gradients, pipeline transfers, and the
    mean loss's one scalar."""
    model, inputs = models.build("gpt", device="meta", layers=24, width=4096, heads=32, seq=1024, vocab=51200, batch=64)
    mesh = autopar.Mesh((2, 8), cluster="a100-80g")
    assert mesh.links()[0].beta > 5 * mesh.links()[1].beta  # axis 0 crosses nodes
    plan = autopar.plan(model, mesh, inputs, pipeline="auto", memory_budget="80GB")
    micro = plan.pipeline.microbatches if plan.pipeline else 1
    graph = ir.trace(model, tuple(t[: 64 // micro] for t in inputs))
    crossing = []
    for sp in plan.stage_plans():
        if sp.mesh["shape"][0] == 1:
            continue  # a stage on one node: axis 0 has one device
        for e in sp.edges:
            src = graph.nodes[e.src]
            scalar = isinstance(src.meta, tuple) or not len(src.meta.shape)
            if src.op != "placeholder" and not scalar and any(0 in st.axes for st in e.steps):
                crossing.append((e.src, e.dst, [st.kind for st in e.steps]))
    assert crossing == [], crossing


def test_gpt3_175b_plans_with_pipeline_stages_like_megatron():
    """GPT-3 175B on 1024 simulated A100s with 80 GB each, in Megatron's recipe (bf16 compute on
    fp32 masters, gradients and Adam states) and its 96 microbatches: pipeline stages of whole
    nodes, model parallel inside the node, a model-FLOPs utilization near Megatron-LM's measured
    44-52%. The microbatch count is fixed to keep the suite short: benchmarks/gpt3_pipeline.py
    searches it too (and prints the figures and the time to plan)."""
    model, inputs = models.build("gpt", device="meta", dtype=torch.bfloat16, layers=96, width=12288, heads=96, seq=2048,
                                 vocab=51200, batch=1536)
    mesh = autopar.Mesh((128, 8), cluster="a100-80g")
    plan = autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(microbatches=96), memory_budget="80GB",
                        precision="bf16")
    s = plan.summary()
    assert plan.precision == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "master_dtype": "float32"}
    # model parallel inside the node (tensor or sequence, as wide as pays: the search views a stage's
    # nodes of 8 as (2r, 4) and (4r, 2) too, stage by stage), pipeline and data parallel across nodes
    assert s["pp"] > 1 and s["memory_bytes_per_device"] <= 80e9
    for st in s["pipeline"]["stages"]:  # a stage holds whole nodes; its inner axis stays inside one
        assert len(st["ranks"]) % 8 == 0 and 8 % st["mesh_shape"][-1] == 0, st["mesh_shape"]
        assert len(st["ranks"]) * s["pp"] == 1024 and st["mesh_shape"][-1] > 1, st
    params = sum(t.numel() for t in model.parameters())
    mfu = 6 * params * 1536 * 2048 / (s["step_time_s"] * 1024 * 312e12)
    assert 0.40 <= mfu <= 0.60, mfu
    # No hand configuration beats the plan by its own prices (under its precision): two of the
    # grid's nearest, with another ZeRO stage or tensor width (1.000x and 1.008x of the plan at
    # 2026-12-05; benchmarks/whatif_grid.py prices all 18 in `make bench`); a configuration may tie it.
    near = ["tp=8,pp=16,dp=8,mb=96,zero=1", "tp=4,pp=16,dp=16,mb=96,zero=0"]
    rows = autopar.compare(plan, model, inputs, *near, memory_budget="80GB")
    assert all(r.step_time_s is not None for r in rows), [r.note for r in rows]
    beaten = [(r.name, r.step_time_s / s["step_time_s"]) for r in rows[1:]
              if r.fits and r.step_time_s < s["step_time_s"] * (1 - 1e-9)]
    assert not beaten, beaten


# ---- pipelines on shared cores ---------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("times", [[3.0, 3.0, 3.0, 3.0], [1.0, 2.0, 4.0], [2.0, 5.0]])
@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_simulation_with_a_core_per_rank_is_the_schedule_formula(schedule, times, count):
    # enough capacity for every rank: GPipe and 1F1B take sum + (B - 1) * max (Alpa's objective)
    got = simulate_shared(times, [1] * len(times), count, schedule, capacity=100.0)
    assert got == pytest.approx(sum(times) + (count - 1) * max(times))


def test_simulation_shares_the_host_among_busy_ranks():
    # one stage on every rank: all 4 busy, each at capacity / 4 of full speed
    assert simulate_shared([1.0], [4], 1, "1f1b", capacity=2.0) == pytest.approx(2.0)
    # 2 stages of 2 ranks on a host of 2 ranks' capacity, 1F1B, 2 microbatches, stage time 3
    # (forward 1, backward 2), worked by hand: s0 F0 alone [0, 1]; s0 F1 + s1 F0 at half speed
    # [1, 3]; s1 B0 alone [3, 5]; s0 B0 + s1 F1 at half speed [5, 7] (B0 has 1 left); s0 B0 +
    # s1 B1 at half speed [7, 9] (B1 has 1 left); s1 B1 alone [9, 10]; s0 B1 alone [10, 12]
    assert simulate_shared([3.0, 3.0], [2, 2], 2, "1f1b", capacity=2.0) == pytest.approx(12.0)
    # idle stages cost nothing when the others can use their share: a short first stage
    short = simulate_shared([0.3, 3.0], [2, 2], 4, "1f1b", capacity=2.0)
    assert short < simulate_shared([3.0, 3.0], [2, 2], 4, "1f1b", capacity=2.0)


def test_shared_core_time_keeps_the_dp_time_on_devices_of_their_own():
    sol = StageSolution([(0, 0, 0), (1, 1, 0)], step_time=7.0, t_max=4.0, stage_times=[3.0, 4.0])
    assert shared_core_time(sol, np.array([1]), 2, 1.0, 2) == 7.0
    assert shared_core_time(sol, np.array([1]), 2, 2.0, 2, "interleaved-1f1b") == 7.0
    # c = 2 on 2 ranks: capacity 1, stage times at full speed 1.5 and 2
    assert shared_core_time(sol, np.array([1]), 2, 2.0, 2) == pytest.approx(simulate_shared([1.5, 2.0], [1, 1], 2, "1f1b", 1.0))
    # what a stage pays once per step (spread over the microbatches in its stage time: 0.5 and 1.0 of
    # 3.0 and 4.0) runs after the schedule, every rank at once: the slowest stage's, at the all-busy price
    tail = shared_core_time(sol, np.array([1]), 2, 2.0, 2, per_step=[1.0, 2.0])
    assert tail == pytest.approx(simulate_shared([1.25, 1.5], [1, 1], 2, "1f1b", 1.0) + 2.0)


def test_moved_cuts_move_one_cut_a_unit_and_keep_every_stage():
    # the first cut can move earlier only (later would empty the one-unit middle stage), the second later only
    assert list(_moved_cuts([(0, 1, 0), (2, 2, 1), (3, 5, 0)])) == [
        [(0, 0, 0), (1, 2, 1), (3, 5, 0)], [(0, 1, 0), (2, 3, 1), (4, 5, 0)]]
    assert list(_moved_cuts([(0, 3, 0)])) == []


def test_nudged_cuts_walk_down_the_priced_step_to_a_local_least():
    # a price with its least at cuts after units 2 and 5 (of 8), and one stage list refused
    def priced(stages):
        cuts = [j for _, j, _ in stages[:-1]]
        if cuts == [3, 5]:
            return None
        return StageSolution(stages, float(abs(cuts[0] - 2) + abs(cuts[1] - 5)), 1.0, [1.0] * len(stages))

    start = [(0, 5, 0), (6, 6, 0), (7, 7, 0)]
    got = _nudged(priced(start), priced)
    assert [j for _, j, _ in got.stages[:-1]] == [2, 5] and got.step_time == 0.0
    assert got.stages[-1] == (6, 7, 0)  # every unit still covered, in order
    # already at its least: unchanged
    assert _nudged(got, priced) is got


# ---- zero bubble -------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, count", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 2), (3, 6)])
def test_zero_bubble_orders_are_torchs(p, count):
    """Each rank's tasks in the order torch's ScheduleInterleavedZeroBubble (one stage per rank)
    builds them (its private helper, the truth for the pinned torch)."""
    from torch.distributed.pipelining import schedules as ts

    rounds = max(1, count // p)
    kind = {ts._ComputationType.FORWARD: "F", ts._ComputationType.BACKWARD_INPUT: "B",
            ts._ComputationType.BACKWARD_WEIGHT: "W"}
    ours = schedule_orders(p, count, "zero-bubble")
    for rank in range(p):
        warm = ts._get_warmup_ops(rank, 1, count // rounds, p, count, multiply_factor=1)
        ops = ts._get_1f1b_rank_ops(1, p, warm, count - warm, warm, rank, lambda _: rank, lambda _: rank,
                                    num_1f1b_microbatches=rank, enable_zero_bubble=True)
        assert ours[rank] == [(kind[a.computation_type], a.microbatch_index) for a in ops if a is not None]


@pytest.fixture
def free_split(monkeypatch):
    """Zero bubble's split backward priced as the whole one (the papers' model)."""
    import autopar.cost_model.schedules as schedules

    monkeypatch.setattr(schedules, "SPLIT_BACKWARD_EXTRA", 0.0)


def test_zero_bubble_hand_worked(free_split):
    # 2 stages of time 3 (forward 1, input half 1, weight half 1; stage 0's whole backward, 2, is its
    # weight task), 2 microbatches, a device per rank. s0: F0 [0,1] F1 [1,2]; s1: F0 [1,2] B0 [2,3]
    # F1 [3,4] B1 [4,5] W0 [5,6] W1 [6,7]; s0: B0 at 3 (nothing to do) W0 [3,5], B1 at 5, W1 [5,7].
    assert simulate_shared([3.0, 3.0], [1, 1], 2, "zero-bubble", math.inf) == pytest.approx(7.0)
    # 1F1B takes sum + (B - 1) max = 9: the weight halves fill the drain
    assert simulate_shared([3.0, 3.0], [1, 1], 2, "1f1b", math.inf) == pytest.approx(9.0)


def test_zero_bubble_prices_the_split_backward():
    # As above, but a split backward's weight half costs a tenth of the backward (2) more on the
    # stages that split it (not stage 0, whose whole backward is its weight task): s1's W0 [5, 6.2],
    # W1 [6.2, 7.4]; s0 ends at 7 as before.
    from autopar.cost_model.schedules import SPLIT_BACKWARD_EXTRA

    assert SPLIT_BACKWARD_EXTRA == 0.1
    assert simulate_shared([3.0, 3.0], [1, 1], 2, "zero-bubble", math.inf) == pytest.approx(7.4)
    # where the bubble is already filled (two stages sharing one core's worth), 1F1B is cheaper
    zb = simulate_shared([3.0, 3.0], [1, 1], 2, "zero-bubble", 1.0)
    f1b = simulate_shared([3.0, 3.0], [1, 1], 2, "1f1b", 1.0)
    assert f1b == pytest.approx(12.0) and zb == pytest.approx(12.4)


@pytest.mark.parametrize("p, count", [(2, 4), (4, 4), (4, 16), (8, 8)])
def test_zero_bubble_bubble_is_a_third_of_1f1bs_on_equal_stages(p, count, free_split):
    # ZB-H1 (Qi et al., 2024): equal stages with F = B = W leave (p - 1)(F + B - W) idle, a third
    # of 1F1B's (p - 1)(F + B + W). The first stage's whole backward runs as its weight task, so
    # the drain ends one W later there; the step is count x 3 + (p - 1) x 1 (+ 1: stage 0's W).
    zb = simulate_shared([3.0] * p, [1] * p, count, "zero-bubble", math.inf)
    f1b = simulate_shared([3.0] * p, [1] * p, count, "1f1b", math.inf)
    assert f1b == pytest.approx(3.0 * count + 3.0 * (p - 1))
    assert zb < f1b
    assert zb - 3.0 * count <= (p - 1) * 1.0 + 1.0 + 1e-9
    assert bubble_fraction([3.0] * p, count, "zero-bubble") < bubble_fraction([3.0] * p, count, "1f1b")
    assert bubble_fraction([3.0] * p, count, "1f1b") == pytest.approx((p - 1) / (count + p - 1))


def test_search_with_zero_bubble_plans_it_without_recomputation():
    model, inputs = models.build("gpt", layers=4)
    plan = autopar.plan(model, autopar.Mesh((4,)), inputs, pipeline=Pipeline(stages=2, schedule="zero-bubble"))
    s = plan.summary()["pipeline"]
    assert s["schedule"] == "zero-bubble" and len(s["stages"]) == 2
    assert not any(st["recompute"] for st in s["stages"])
    assert 0 <= s["bubble_fraction"] < 1


# ---- pipeline="auto", the default ---------------------------------------------------------------------
def test_the_default_searches_stages_where_it_can():
    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=16)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    default = autopar.plan(model, mesh, inputs, memory_budget="800MiB")
    auto = autopar.plan(model, mesh, inputs, pipeline="auto", memory_budget="800MiB")
    assert default.summary() == auto.summary()
    assert default.pipeline is not None  # one stage does not fit 800 MiB here (see the round-trip test)
    graph = ir.trace(model, inputs)
    # nothing to search: no batch given (a traced graph alone), a forced hand layout, one row to cut
    assert autopar.plan(model, mesh, graph=graph).pipeline is None
    assert autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=4)).pipeline is None
    assert autopar.plan(model, autopar.Mesh((1, 4), cluster="a100-80g"), inputs).pipeline is None


def test_the_default_plans_one_stage_for_a_model_without_layers():
    class OneMatmul(torch.nn.Module):  # parameters of its own, no submodules: nothing to cut
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, x):
            return (x @ self.weight).relu().sum()

    torch.manual_seed(0)
    model, inputs = OneMatmul(), (torch.randn(8, 8),)
    assert not ir.trace(model, inputs).layers
    with pytest.raises(PlanError):
        autopar.plan(model, autopar.Mesh((2,)), inputs, pipeline=Pipeline(stages=2))
    plan = autopar.plan(model, autopar.Mesh((2,)), inputs)
    assert plan.pipeline is None
    assert plan.summary() == autopar.plan(model, autopar.Mesh((2,)), inputs, pipeline=False).summary()


def test_step_extras_price_the_loss_broadcast_and_tied_parameters():
    """After the schedule a pipelined step sends the loss to every rank and sums a parameter read
    by several blocks of ranks (GPT's embedding tied to its head) over them: both priced on the
    first mesh axis's link, nothing for one stage."""
    from autopar.cost_model.comm import mesh_collective_time

    mesh = autopar.Mesh((4,), cluster="a100-80g")
    pp = autopar.Mesh((2,), cluster=mesh.resolved_cluster().with_axis_links([mesh.links()[0]]))
    for name, tied in (("gpt", True), ("llama", False)):
        model, inputs = models.build(name, layers=2)
        graph = ir.trace(model, inputs)
        groups = layer_groups(2, 24)
        assert step_extras(graph, groups, [(0, 1, 0)], 1, mesh) == 0.0
        got = step_extras(graph, groups, [(0, 0, 0), (1, 1, 0)], 2, mesh)
        want = mesh_collective_time("all_reduce", 4, pp, (0,))
        if tied:
            wte = model.get_parameter("transformer.wte.weight")
            assert wte is model.get_parameter("lm_head.weight")
            want += mesh_collective_time("all_reduce", wte.numel() * 4, pp, (0,))
        assert got == pytest.approx(want)


def test_interleaved_time_is_never_below_one_microbatch_through_every_stage():
    # 2 ranks x 2 stages of 1 s: 4 microbatches take (4 + 1/2) x 2 s (Narayanan et al.)
    assert interleaved_time([1.0] * 4, 2, 2, 4) == pytest.approx(9.0)
    # one microbatch still passes all 4 stages in turn: 4 s, not the formula's 3 s
    assert interleaved_time([1.0] * 4, 2, 2, 1) == pytest.approx(4.0)


# ---- microbatches need dim 0 to be a batch of independent samples -------------------------------------
class _TimeFirst(torch.nn.Module):
    """(time, batch, features) inputs, nn.Transformer's default layout: dim 0 is not the batch."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x.mean(0, keepdim=True)  # each step reads the whole sequence
        return torch.nn.functional.cross_entropy(self.head(x.mean(0)), y)


class _SumLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return ((x - y) ** 2).sum()  # a pipelined step averages microbatch losses: this one must not be split


def _zoo():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import models_zoo

    return models_zoo


class _BufferWeightedLoss(torch.nn.Module):
    """A cross entropy whose class weights are a buffer: microbatches count Σ weight[target] apart."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5]))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc(x), y, weight=self.class_weight)


class _MaskByIndex(torch.nn.Module):
    """Attention over a padding mask read per sample by index, as transformers 5 builds its masks:
    ``mask[rows[:, None, None, None], cols[None, None, None, :]]`` with ``rows`` an ``arange`` over
    the batch (``rows``: "arange"), the batch reversed ("flip": samples read each other's masks) or
    a row index from the inputs ("input")."""

    def __init__(self, rows="arange"):
        super().__init__()
        self.rows, self.blocks = rows, torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, mask, pick=None):
        b, t = mask.shape
        rows = {"arange": lambda: torch.arange(b), "flip": lambda: torch.arange(b).flip(0), "input": lambda: pick}[self.rows]()
        m = mask.bool()[rows[:, None, None, None], torch.arange(t)[None, None, None, :]]  # (b, 1, 1, t)
        for proj in self.blocks:
            scores = (proj(x) @ x.transpose(1, 2)).masked_fill(~m[:, 0], -1e4)  # (b, t, t)
            x = x + scores.softmax(-1) @ x
        return x.square().mean()


def test_batch_mixing_reads_masks_indexed_per_sample():
    """An index by an arange over the batch reads each sample's own row (microbatches trace their
    own arange); a reversed arange or an index from the inputs reads other samples' rows."""
    from autopar.solver.microbatches import batch_mixing

    x, mask = torch.randn(4, 6, 8), (torch.rand(4, 6) > 0.3).long()
    assert batch_mixing(ir.trace(_MaskByIndex("arange"), (x, mask)), 4) is None
    for rows, extra in (("flip", ()), ("input", (torch.tensor([1, 0, 3, 2]),))):
        why = batch_mixing(ir.trace(_MaskByIndex(rows), (x, mask, *extra)), 4)
        assert why is not None and "aten.index.Tensor" in why, (rows, why)
    # the same through autopar.plan: 2 microbatches of the arange case; the flipped one refused
    mesh = autopar.Mesh((2,), cluster="cpu-gloo")
    plan = autopar.plan(_MaskByIndex("arange"), mesh, (x, mask), pipeline=autopar.Pipeline(stages=2, microbatches=2))
    assert plan.pipeline.microbatches == 2 and len(plan.pipeline.stages) == 2
    with pytest.raises(ConfigError, match=r"not a batch of independent samples here: aten\.index\.Tensor"):
        autopar.plan(_MaskByIndex("flip"), mesh, (x, mask), pipeline=autopar.Pipeline(stages=2, microbatches=2))


def test_batch_mixing_finds_where_samples_meet():
    from autopar.solver.microbatches import batch_mixing

    zoo = _zoo()
    # the ViT's nn.MultiheadAttention merges (time, batch) rows, kept apart by ir/rewrites.py
    independent = [models.build("gpt", layers=2), models.build("llama", layers=2), models.build("mlp"), zoo.mingpt(),
                   zoo.vit()]
    for model, inputs in independent:
        assert batch_mixing(ir.trace(model, inputs), inputs[0].shape[0]) is None, type(model).__name__
    mixing = {
        "time-first": (_TimeFirst(), (torch.randn(6, 4, 8), torch.randint(0, 3, (4,))), "aten.add.Tensor"),
        "sum loss": (_SumLoss(), (torch.randn(4, 8), torch.randn(4, 8)), "sums over dim 0"),
        "class weights": (_BufferWeightedLoss(), (torch.randn(4, 8), torch.randint(0, 3, (4,))), "weighed by model state"),
        # Switch-style load balancing multiplies two batch means: per microbatch it is another number
        "moe aux loss": (*zoo.moe(), "aten.mul.Tensor"),
    }
    for name, (model, inputs, where) in mixing.items():
        why = batch_mixing(ir.trace(model, inputs), inputs[0].shape[0])
        assert why is not None and where in why, (name, why)


def test_microbatches_are_refused_or_left_out_where_dim_0_is_not_a_batch():
    model, inputs = _TimeFirst(), (torch.randn(6, 4, 8), torch.randint(0, 3, (4,)))
    mesh = autopar.Mesh((2,), cluster="cpu-gloo")
    with pytest.raises(ConfigError, match=r"Pipeline\(microbatches=2\) splits the inputs' dim 0 .* not a batch of "
                                          r"independent samples here: aten\.add\.Tensor"):
        autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(stages=2, microbatches=2))
    plan = autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(stages=2))
    assert plan.pipeline.microbatches == 1 and len(plan.pipeline.stages) == 2


def test_lean_plans_are_cut_off_without_changing_the_search():
    """Leaner plans of a sub-mesh are solved with a cutoff from the pipeline already found (a stage
    on 1 / s of the rows runs at least 1 / s of the work): the search finds what it finds solving
    them whole; and a cutoff below a lean plan's cost drops it, one above it keeps it unchanged."""
    import autopar.solver.pipeline as pipeline_search
    import autopar.solver.stage_prices as stage_prices
    from autopar.solver.intra_op import plan_one_stage

    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=16)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    free = search(model, mesh, inputs)
    budget = 0.6 * max(s.memory_bytes for s in free.stages)  # tight enough that lean plans are kept
    solved = []
    leaner = stage_prices.leaner_prices

    def recorded(model, sm, graph, intra_op_plan, config, fastest, cutoff_s):
        out = leaner(model, sm, graph, intra_op_plan, config, fastest, cutoff_s)
        solved.append((sm, graph, config, fastest, cutoff_s, out))
        return out

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(stage_prices, "MEMORY_VARIANTS", (0.8,))  # lean plans that fit here
        mp.setattr(pipeline_search, "leaner_prices", recorded)  # the search's own name for it
        with_cutoff = search(model, mesh, inputs, memory_budget=budget)
        mp.setattr(pipeline_search, "leaner_prices", lambda *a: leaner(*a[:-1], None))
        reference = search(model, mesh, inputs, memory_budget=budget)
        assert with_cutoff.step_time_s == pytest.approx(reference.step_time_s, rel=1e-12)
        assert [(s.layers, s.rows) for s in with_cutoff.stages] == [(s.layers, s.rows) for s in reference.stages]
        assert (with_cutoff.schedule, with_cutoff.microbatches) == (reference.schedule, reference.microbatches)
        kept = [r for r in solved if r[4] is not None and r[5]]
        assert kept, "the case must keep lean plans solved under a cutoff"
        sm, graph, config, fastest, cutoff_s, out = kept[0]
        objective = out[0].plan.solver["objective_s"]
        assert objective <= cutoff_s
        # the cutoff bounds the ILP's objective, which prices split gathers at a share of their
        # latency (``intra_op._plan_on``): a plan may cost a little more than it, never less
        assert leaner(model, sm, graph, plan_one_stage, config, fastest, objective * 0.5) == []
        again = leaner(model, sm, graph, plan_one_stage, config, fastest, objective * 1.001)
        assert again[0].plan.solver["objective_s"] == pytest.approx(objective, rel=1e-9)
    finally:
        mp.undo()


def test_the_batch_check_reads_a_graph_the_search_evaluates():
    """``batch_mixing`` reads the first microbatch shape the count search evaluates (no trace for
    the check alone), or the whole batch where a microbatch holds one sample or an input that is
    not cut has its rows; every shape is traced once."""
    from autopar.solver.microbatches import mixing_probe

    counts = microbatch_candidates(1536, None)
    assert mixing_probe(counts, 1536, (torch.zeros(1536, 4),), None) == 6
    assert mixing_probe(counts, 1536, (torch.zeros(1536, 4), torch.zeros(256, 256)), None) == 1  # a (256, 256) mask
    assert mixing_probe(counts, 1536, (torch.zeros(1536, 4),), {"mask": torch.zeros(256, 1)}) == 1
    assert mixing_probe([4], 8, (torch.zeros(8, 4),), None) == 4
    assert mixing_probe([4], 4, (torch.zeros(4, 4),), None) == 1  # one sample each: nothing to split
    assert mixing_probe([1, 2], 2, (torch.zeros(2, 4),), None) == 1

    import autopar.solver.pipeline as pipeline_module

    model, inputs = models.build("gpt", layers=4, batch=8)
    shapes = []
    trace = ir.trace
    mp = pytest.MonkeyPatch()
    try:  # the search's own name for ir.trace
        mp.setattr(pipeline_module, "trace_graph",
                   lambda m, args, kwargs=None, **kw: shapes.append(args[0].shape[0]) or trace(m, args, kwargs, **kw))
        choice = search(model, autopar.Mesh((2,), cluster="a100-80g"), inputs)
    finally:
        mp.undo()
    assert len(shapes) == len(set(shapes)) and 8 // shapes[0] == 2  # count 2 (of 1, 2, 4, 8) first
    assert choice.graph is not None


class _LossAndLogits(torch.nn.Module):
    """Returns (loss, logits), as a transformers language model does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


class _LogitsOnly(_LossAndLogits):
    def forward(self, idx, targets):
        return super().forward(idx, targets)[1]


def test_outputs_training_does_not_read_are_returned_as_made():
    """A plan returns the loss whole (its pending sum summed) and the logits as they are made,
    split over the batch (a call gathers them only when read: runtime.outputs), so neither the
    plan nor the unit prices of the pipeline search pay their gather; a model that returns no loss
    has every output read, gathered whole in the plan."""
    model, inputs = _LossAndLogits(), (torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))
    mesh = autopar.Mesh((2,), cluster="cpu-gloo")
    graph = ir.trace(model, inputs)
    assert unread_outputs(graph) == {1}
    plan = autopar.plan(model, mesh, inputs, graph=graph, pipeline=False, force=autopar.Layout(dp=2))
    out = next(n for n in graph.nodes.values() if n.op == "output")
    edges = {e.position: e for e in plan.edges if e.dst == out.name}
    assert edges[1].steps == [] and edges[1].cost_s == 0 and edges[1].dst_spec.notation() == "[S0, R, R]"
    assert plan.nodes[out.name].inputs[1].notation() == "[S0, R, R]"
    assert [s.kind for s in edges[0].steps] == ["all_reduce"] and edges[0].dst_spec.is_replicated
    assert "returned split, gathered only when read" in plan.explain()
    priced = unit_prices(plan, graph, mesh)
    last = unit_of_nodes(graph)[out.name]
    assert priced.per_microbatch_s[last] > 0

    alone = _LogitsOnly()
    alone.load_state_dict(model.state_dict())
    graph = ir.trace(alone, inputs)
    assert unread_outputs(graph) == frozenset()
    plan = autopar.plan(alone, mesh, inputs, graph=graph, pipeline=False, force=autopar.Layout(dp=2))
    (edge,) = [e for e in plan.edges if e.dst == out.name]
    assert [s.kind for s in edge.steps] == ["all_gather"] and edge.dst_spec.is_replicated and edge.cost_s > 0
    assert "returned split" not in plan.explain()


def test_a_stage_holds_a_tied_weight_once():
    """A tied embedding and head in one stage is one parameter: the units' state between the first
    and the last unit is the plan's state, the tied weight once; two stages each hold it."""

    model, inputs = models.build("gpt", layers=4, width=64, heads=4, seq=16, vocab=512, batch=8)
    mesh = autopar.Mesh((2,))
    plan = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=2), pipeline=False)
    graph = ir.trace(model, inputs)
    prices = unit_prices(plan, graph, mesh)
    state = sum(plan.nodes[p.node].memory_bytes for p in plan.params.values())
    n = len(prices.static_bytes)
    assert prices.shared_params, "the built-in GPT ties its embedding and head"
    tied = sum(sp.nbytes for sp in prices.shared_params)
    assert prices.static_between(0, n - 1) == pytest.approx(state)
    assert prices.static_bytes.sum() == pytest.approx(state + tied)  # each reader unit counts it
    (b, _, _, units), = prices.shared_params
    cut = units[0]  # stages [0, cut] and [cut + 1, n - 1] hold one copy each
    assert prices.static_between(0, cut) + prices.static_between(cut + 1, n - 1) == pytest.approx(state + tied)


def test_the_one_stage_plan_reads_the_whole_batch_off_the_searchs_traces(monkeypatch):
    """Beside a pipeline search the one-stage plan is priced on the whole batch's graph read off the
    search's two traces, not on a trace of its own: the same plans and choice as tracing it. Where
    the one-stage plan is chosen on such a graph, the whole batch is traced to check it, and a
    scaled graph that is not the trace is planned again on the trace."""
    import autopar.solver.api as api_module
    import autopar.solver.intra_op as intra_module
    import autopar.solver.pipeline as pipeline_module

    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=16)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    whole = ir.trace(model, inputs)
    traces = []
    for module in (api_module, intra_module):
        real = module.trace
        monkeypatch.setattr(module, "trace", lambda *a, _real=real, **k: traces.append(1) or _real(*a, **k))

    def planned(**kw):
        traces.clear()
        p = autopar.plan(model, mesh, inputs, memory_budget="800MiB", **kw)
        return p, len(traces)

    scaled, n_scaled = planned()
    assert scaled.pipeline is not None and n_scaled == 0  # (one stage does not fit 800 MiB)
    with monkeypatch.context() as m:
        m.setattr(pipeline_module, "scaled_graph", lambda *a: None)
        traced, n_traced = planned()
    assert n_traced == 1 and traced.summary() == scaled.summary()
    # where the one-stage plan is chosen on the search's scaled graph (here one stage is fastest; the
    # search, asked for 2 stages, is made to answer as if it had scaled the whole batch's graph):
    # checked against the trace, kept where it is the trace, planned again where it is not
    import copy
    import dataclasses

    real_search = api_module.search

    def scaled_whole(wrong: bool):
        def fake(*a, **k):
            choice = real_search(*a, **{**k, "config": k["config"].replace(pipeline=Pipeline(stages=2, microbatches=4))})
            g = copy.deepcopy(whole)  # (its two stages' search traced one microbatch count: nothing to scale)
            if wrong:
                g = _one_integer_off(g)
            return dataclasses.replace(choice, whole=g, whole_traced=False)
        return fake

    def one_stage_planned(wrong):
        traces.clear()
        with monkeypatch.context() as m:
            m.setattr(api_module, "search", scaled_whole(wrong))
            p = autopar.plan(model, mesh, inputs)
        return p, len(traces)

    free = autopar.plan(model, mesh, inputs)
    assert free.pipeline is None
    for wrong in (False, True):
        one, n_one = one_stage_planned(wrong)
        assert n_one == 1 and one.model_fingerprint == whole.fingerprint(), wrong
        assert (one.nodes, one.edges, one.params, one.predicted) == (free.nodes, free.edges, free.params, free.predicted)

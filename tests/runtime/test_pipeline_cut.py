"""How a pipelined plan's microbatch graph is cut into stages (no ranks needed): what each stage
runs, receives and sends; values that skip a stage pass through it; a stage program reshards
what it receives; ``Pipeline(layers=...)`` fixes the cut."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import ir, models
from autopar.codegen.lower import lower
from autopar.codegen.stages import cut_stages, sent_specs, shared_params
from autopar.errors import ConfigError
from autopar.ir.graph import Role
from autopar.ir.losses import loss_position
from autopar.solver.microbatches import microbatch_inputs


def _pipelined(model, inputs, mesh, pipeline, **kw):
    plan = autopar.plan(model, mesh, inputs, pipeline=pipeline, **kw)
    assert plan.pipeline is not None
    micro = ir.trace(model, *microbatch_inputs(inputs, None, plan.pipeline.microbatches)[:1])
    plan.check_model(micro.fingerprint(), micro.model_name)
    return plan, micro


def test_every_op_runs_once_and_every_read_is_received():
    model, inputs = models.build("gpt", layers=4)
    plan, micro = _pipelined(model, inputs, autopar.Mesh((3,)), autopar.Pipeline(layers=(1, 2, 1), microbatches=2))
    cuts = cut_stages(micro, plan)
    assert [c.index for c in cuts] == [0, 1, 2]
    ops = [n for n, node in micro.nodes.items() if node.op in ("call_function", "output")]
    ran = [n for c in cuts for n in c.nodes if micro.nodes[n].op in ("call_function", "output")]
    assert sorted(ran) == sorted(ops) and len(ran) == len(set(ran))
    assert cuts[0].receives == list(micro.inputs) and cuts[-1].sends == []
    for prev, cut in zip(cuts, cuts[1:]):
        assert cut.receives == prev.sends
        have = set(cut.nodes) | set(cut.receives)
        for n in cut.nodes:
            for src in micro.nodes[n].inputs:
                node = micro.nodes[src]
                assert src in have or (node.op == "placeholder" and node.role != Role.INPUT), (n, src)
    # the targets are read only by the loss, in the last stage: they pass through stage 1
    targets = micro.inputs[1]
    assert targets in cuts[0].sends and targets in cuts[1].sends
    assert not any(targets in micro.nodes[n].inputs for n in cuts[1].nodes)
    # the tied embedding / head weight is held by the first and the last stage
    shared = shared_params(micro, cuts)
    assert list(shared.values()) == [frozenset({0, 2})]
    assert loss_position(micro) == 0


def test_values_computed_before_the_layers_pass_through_every_stage():
    """transformers' LLaMA computes the rotary tables once, before the layers; every layer reads them."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 16))
    plan = autopar.plan(model, autopar.Mesh((3,)), (), example_kwargs={"input_ids": ids, "labels": ids},
                        pipeline=autopar.Pipeline(stages=3, microbatches=2))
    micro = ir.trace(model, (), {"input_ids": ids[:2], "labels": ids[:2]})
    cuts = cut_stages(micro, plan)
    made0 = {n for n in cuts[0].nodes if micro.nodes[n].op == "call_function"}
    early = [v for v in cuts[1].sends if v in made0]  # made in stage 0, passed on by stage 1
    assert early, cuts[1].sends
    for v in early:
        assert any(v in micro.nodes[n].inputs for n in cuts[2].nodes)
    # the stage program reads what it receives in the spec it arrives in
    specs = sent_specs(micro, plan, cuts)
    stage = plan.pipeline.stages[1]
    received = {v: specs[v] for v in cuts[1].receives if micro.nodes[v].op != "placeholder"}
    lowered = lower(micro, stage.plan, autopar.Mesh(tuple(stage.mesh_shape)), nodes=cuts[1].nodes, received=received)
    assert set(lowered.boundary_inputs) <= set(received)
    assert set(lowered.inputs) <= set(micro.inputs)


def test_received_values_are_resharded_to_what_their_readers_want():
    """A value arriving split where the stage's plan reads it whole is gathered on arrival, along
    the steps the plan gives that read (``StagePlan.received``, made by the solver); codegen
    refuses a read the plan gives no steps for."""
    import dataclasses

    from autopar.errors import PlanError
    from autopar.sharding_spec.spec import ShardingSpec
    from autopar.solver.receives import received_edges

    model, inputs = models.build("gpt", layers=2)
    plan, micro = _pipelined(model, inputs, autopar.Mesh((4,)), autopar.Pipeline(stages=2, microbatches=2),
                             force=autopar.Layout(tp=2))
    cuts = cut_stages(micro, plan)
    hidden = next(v for v in cuts[1].receives if micro.nodes[v].op != "placeholder")
    meta = micro.nodes[hidden].meta
    split = ShardingSpec(tuple(meta.shape), ((),) * (len(meta.shape) - 1) + ((0,),), (), 1)
    assert sent_specs(micro, plan, cuts)[hidden] != split
    # the first stage's plan makes the value split: the second stage's reads of it gather it
    first = plan.pipeline.stages[0]
    nodes = dict(first.plan.nodes, **{hidden: dataclasses.replace(first.plan.nodes[hidden], output=split)})
    stages = [dataclasses.replace(first, plan=dataclasses.replace(first.plan, nodes=nodes)), plan.pipeline.stages[1]]
    edges = received_edges(micro, stages)[1]
    reads = [e for e in edges if e.src == hidden]
    assert reads and all(e.src_spec == split and [s.kind for s in e.steps] == ["all_gather"] for e in reads)
    stage = plan.pipeline.stages[1]
    mesh = autopar.Mesh(tuple(stage.mesh_shape))
    received = {**sent_specs(micro, plan, cuts), hidden: split}
    received = {v: received[v] for v in cuts[1].receives if micro.nodes[v].op != "placeholder"}
    lowered = lower(micro, stage.plan, mesh, nodes=cuts[1].nodes, received=received, received_edges=edges)
    assert f"{hidden}_all_gather" in lowered.code
    with pytest.raises(PlanError, match=f"reads {hidden} .* has no steps"):
        lower(micro, stage.plan, mesh, nodes=cuts[1].nodes, received=received)


def test_fixed_layer_cuts_are_checked():
    with pytest.raises(ConfigError, match="at least one layer"):
        autopar.Pipeline(layers=(2, 0))
    with pytest.raises(ConfigError, match="stages given by layers"):
        autopar.Pipeline(stages=3, layers=(2, 2))
    assert autopar.Pipeline(layers=[3, 1]).stages == 2
    model, inputs = models.build("gpt", layers=4)
    with pytest.raises(ConfigError, match="covers 3 layers"):
        autopar.plan(model, autopar.Mesh((2,)), inputs, pipeline=autopar.Pipeline(layers=(2, 1), microbatches=2))


def test_parallelize_plans_equal_stages():
    """torch's schedules pair each rank with one rank per stage: every stage gets as many devices."""
    model, inputs = models.build("gpt", layers=3)
    plan = autopar.plan(model, autopar.Mesh((4,)), inputs, pipeline=autopar.Pipeline(stages=2, microbatches=2))
    assert [len(s.ranks) for s in plan.pipeline.stages] == [2, 2]


def test_state_nothing_reads_is_held_and_lowered_by_the_first_stage():
    # transformers 4.x GPT-2 registers a masked_bias buffer it never reads: every stage's program
    # must still lower (it failed with "the plan has no strategy for node ..._masked_bias")
    model, inputs = models.build("gpt", layers=4)
    model.transformer.h[3].register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)
    plan, micro = _pipelined(model, inputs, autopar.Mesh((2,)), autopar.Pipeline(stages=2, microbatches=2))
    cuts = cut_stages(micro, plan)
    unread = [n for n, node in micro.nodes.items() if node.op == "placeholder" and not node.users]
    assert unread and all(n in cuts[0].nodes for n in unread)
    specs = sent_specs(micro, plan, cuts)
    for cut, stage in zip(cuts, plan.pipeline.stages):
        received = {v: specs[v] for v in cut.receives if micro.nodes[v].op != "placeholder"}
        lowered = lower(micro, stage.plan, autopar.Mesh((1,)), nodes=cut.nodes, received=received)
        assert set(lowered.state) >= {n for n in cut.nodes if micro.nodes[n].op == "placeholder"
                                      and micro.nodes[n].role != Role.INPUT}

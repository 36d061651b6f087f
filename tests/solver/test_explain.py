"""explain's summary: the layout in the field's words for hand-checked plans, memory by kind, the
costliest collectives, and views hidden unless asked for."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import ir, models
from autopar.solver.explain import axis_roles, costliest_collectives, layout_words


@pytest.fixture(scope="module")
def gpt():
    return models.build("gpt", layers=2)


@pytest.mark.parametrize("layout, shape, words, absent", [
    (autopar.Layout(dp=4), (4,), ["data parallel 4"], ["tensor parallel", "ZeRO", "vocabulary-parallel"]),
    (autopar.Layout(tp=4, vocab_parallel=True), (4,),
     ["tensor parallel 4", "Megatron column/row in the blocks", "vocabulary-parallel loss"], ["data parallel", "ZeRO"]),
    (autopar.Layout(dp=2, tp=2), (2, 2), ["data parallel 2 x tensor parallel 2", "Megatron column/row"], ["ZeRO"]),
    (autopar.Layout(dp=2, tp=2, zero=2), (2, 2), ["data parallel 2 x tensor parallel 2", "ZeRO-2"], ["ZeRO-3"]),
    (autopar.Layout(dp=4, zero=3), (4,), ["data parallel 4", "ZeRO-3 / FSDP"], ["tensor parallel", "ZeRO-2"]),
])
def test_layout_in_words_for_hand_checked_plans(gpt, layout, shape, words, absent):
    model, inputs = gpt
    plan = autopar.plan(model, autopar.Mesh(shape), inputs, force=layout)
    text = layout_words(plan)
    for w in words:
        assert w in text, text
    for w in absent:
        assert w not in text, text
    head = plan.explain().splitlines()
    # what the plan is for first: the call in tokens, the parameters and the optimizer priced
    assert head[1] == ("call: idx int64[4, 32], targets int64[4, 32] (batch 4 x sequence 32 = 128 tokens a step); "
                       "119k parameters in float32, adamw states priced"), head[1]
    assert head[2] == "layout: " + text  # then the summary
    assert head[3].startswith("predicted step time") and head[4].startswith("memory per device")
    degrees = plan.summary()
    assert (degrees["dp"], degrees["tp"], degrees["pp"]) == (layout.dp, layout.tp, 1)


@pytest.fixture(scope="module")
def hf_gpt2():
    """transformers' GPT-2 from its default config's shape (Conv1D: its linears are addmm)."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("layout, shape, words", [
    (autopar.Layout(tp=4), (4,), "tensor parallel 4, Megatron column/row in the blocks"),
    (autopar.Layout(dp=2, tp=2), (2, 2), "data parallel 2 x tensor parallel 2, Megatron column/row in the blocks"),
    (autopar.Layout(dp=4), (4,), "data parallel 4"),
])
def test_layout_words_read_conv1d_weights(hf_gpt2, layout, shape, words):
    model, kwargs = hf_gpt2
    plan = autopar.plan(model, autopar.Mesh(shape), example_kwargs=kwargs, force=layout, pipeline=False)
    assert layout_words(plan) == words
    s = plan.summary()
    assert (s["dp"], s["tp"], s["sp"], s["pp"]) == (layout.dp, layout.tp, 1, 1)
    text = plan.explain()
    assert "note: GPT2LMHeadModel traced with config.use_cache=False" in text  # its default config, said once
    assert "batch 4 x sequence 16 = 64 tokens a step" in text


def test_a_gpu_preset_brings_its_memory_as_the_budget():
    model, inputs = models.build("llama3-8b", batch=8, seq=512)
    plan = autopar.plan(model, autopar.Mesh((8,), cluster="h100-80g"), inputs, pipeline=False)
    assert plan.solver["memory_budget"] == 80 * 2**30
    assert plan.solver["memory_budget_from"] == "the h100-80g device memory"
    assert plan.predicted["memory_bytes_per_device"] <= 80 * 2**30
    assert "budget 80.0 GiB (the h100-80g device memory)" in plan.explain()
    cpu = autopar.plan(model, autopar.Mesh((8,)), inputs, pipeline=False)  # a CPU host's memory bounds nothing
    assert cpu.solver["memory_budget"] is None and "no budget given" in cpu.explain()


def test_pipelined_plan_in_words():
    model, inputs = models.build("gpt", device="meta", layers=8, width=1024, heads=16, seq=256, vocab=8192, batch=16)
    plan = autopar.plan(model, autopar.Mesh((4,), cluster="a100-80g"), inputs, pipeline=autopar.Pipeline(stages=2),
                        memory_budget="800MiB")
    text = layout_words(plan)
    per_rank = plan.pipeline.virtual_stages  # (the search may interleave stages)
    assert text.startswith("pipeline parallel 2 x " if per_rank == 1 else f"pipeline parallel 2 ({per_rank} stages per rank) x ")
    assert f"{plan.pipeline.schedule}, {plan.pipeline.microbatches} microbatches" in text
    assert "of which bubble" in plan.explain()


def test_memory_parts_add_up_and_collectives_are_listed(gpt):
    model, inputs = gpt
    plan = autopar.plan(model, autopar.Mesh((2, 2)), inputs, force=autopar.Layout(dp=2, tp=2))
    parts = plan.predicted["memory_parts"]
    assert sum(parts.values()) == pytest.approx(plan.predicted["memory_bytes_per_device"])
    assert parts["gradients"] == parts["parameters"] > 0 and parts["optimizer_states"] > 0
    lines = costliest_collectives(plan)
    assert 1 <= len(lines) <= 5 and all(": " in line for line in lines)
    roles = axis_roles(plan)
    assert roles == {0: "data", 1: "tensor"}


def test_views_are_hidden_unless_asked(gpt):
    model, inputs = gpt
    plan = autopar.plan(model, autopar.Mesh((2,)), inputs)
    short, full = plan.explain(), plan.explain(all=True)
    assert len(full.splitlines()) > len(short.splitlines())
    import re

    row = re.compile(r"\bview {3,}")  # a table row of a view op (its name padded to the column)
    assert any(row.search(line) for line in full.splitlines())
    assert not any(row.search(line) for line in short.splitlines())


def test_what_ifs_price_like_the_plan_and_say_what_does_not_fit(gpt):
    from autopar.errors import ConfigError
    from autopar.solver.compare import parse_config, table

    model, inputs = gpt
    mesh = autopar.Mesh((2, 2), cluster="a100-80g")
    own = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=2, tp=2))
    budget = 0.9 * own.predicted["memory_bytes_per_device"]
    rows = autopar.compare(own, model, inputs, "dp=2,tp=2", "dp=4,zero=3", "tp=4", memory_budget=budget)
    assert rows[0].name == "autopar (dp=2,tp=2,vocab=0)"
    assert [r.name for r in rows[1:]] == ["dp=2,tp=2", "dp=4,zero=3", "tp=4"]
    same = rows[1]
    assert same.step_time_s == pytest.approx(own.predicted["step_time_s"], rel=1e-9)
    assert same.memory_bytes == pytest.approx(own.predicted["memory_bytes_per_device"])
    assert not same.fits and "does not fit: needs" in same.note
    zero3 = rows[2]
    assert zero3.memory_bytes < same.memory_bytes and zero3.plan.mesh["shape"] == [4]
    text = table(rows)
    assert "dp=4,zero=3" in text and "vs first" in text
    assert parse_config("tp=8,pp=4,dp=4,mb=16") == {"tp": 8, "pp": 4, "dp": 4, "mb": 16}
    with pytest.raises(ConfigError, match="keys"):
        parse_config("tensor=8")
    with pytest.raises(ConfigError, match="mesh has 4 devices"):
        autopar.compare(own, model, inputs, "dp=8")


def test_what_if_with_pipeline_stages():
    model, inputs = models.build("gpt", device="meta", layers=4, width=512, heads=8, seq=128, vocab=4096, batch=16)
    mesh = autopar.Mesh((2, 2), cluster="a100-80g")
    plan = autopar.plan(model, mesh, inputs)
    rows = autopar.compare(plan, model, inputs, "tp=2,pp=2,mb=4")
    r = rows[1]
    assert r.step_time_s is not None and r.plan.pipeline is not None
    pipe = r.plan.pipeline  # pp=2: two blocks of ranks (each running v stages if interleaved)
    assert len(pipe.stages) // pipe.virtual_stages == 2 and pipe.microbatches == 4
    assert all(s.mesh_shape == (1, 2) for s in r.plan.pipeline.stages)


def test_what_ifs_say_accumulation_and_recomputation_without_a_pipeline():
    """``mb`` without ``pp`` is gradient accumulation (a one-stage pipeline of ``mb`` microbatches),
    ``recompute=full`` recomputes every layer in backward: each holds fewer activations than the
    plain layout and recomputation costs a forward more; ``recompute=selective`` keeps the matmuls'
    and attention's outputs: between the two in memory and in time."""
    from autopar.errors import ConfigError
    from autopar.record.recompute import Recompute
    from autopar.solver.compare import compare, parse_config

    assert parse_config("dp=4,mb=4,recompute=full") == {"dp": 4, "mb": 4, "recompute": Recompute.FULL}
    assert parse_config("dp=4,recompute=none")["recompute"] is Recompute.NONE
    assert parse_config("dp=4,recompute=selective")["recompute"] is Recompute.SELECTIVE
    with pytest.raises(ConfigError, match="recompute must be none, full or selective"):
        parse_config("dp=4,recompute=some")
    model, inputs = models.build("gpt", device="meta", layers=4, width=512, heads=8, seq=256, vocab=4096, batch=32)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    plain, acc, rc, both, sel = compare(model, mesh, inputs, ["dp=4", "dp=4,mb=4", "dp=4,recompute=full",
                                                              "dp=4,mb=4,recompute=full", "dp=4,recompute=selective"])
    assert plain.plan.pipeline is None
    for r, mb, recompute in ((acc, 4, False), (rc, 1, True), (both, 4, True)):  # no mb: the batch whole
        pipe = r.plan.pipeline
        assert pipe is not None and len(pipe.stages) == 1, r.name
        assert pipe.microbatches == mb and bool(pipe.stages[0].recompute) == recompute, r.name
        assert r.memory_bytes < plain.memory_bytes, r.name
    assert both.memory_bytes < acc.memory_bytes and both.memory_bytes < rc.memory_bytes
    assert rc.step_time_s > plain.step_time_s and both.step_time_s > acc.step_time_s
    assert sel.plan.pipeline.stages[0].recomputed is Recompute.SELECTIVE
    assert rc.memory_bytes < sel.memory_bytes < plain.memory_bytes
    assert plain.step_time_s < sel.step_time_s < rc.step_time_s


def test_the_grid_holds_only_layouts_whose_data_parallel_splits_the_batch():
    """``config_grid``: a layout without microbatches only where dp divides the batch (GPT-3's 1536
    sequences on dp=1024 cannot be run), with them only where dp x mb does."""
    from autopar.solver.compare import config_grid, parse_config

    grid = [parse_config(c) for c in config_grid(8, layers=4, batch=12)]
    assert grid and all(12 % (c["dp"] * c.get("mb", 1)) == 0 for c in grid)
    assert not any(c["dp"] == 8 for c in grid)
    assert any(c["dp"] == 4 and "mb" not in c for c in grid) and any(c["dp"] == 2 and c.get("mb") == 2 for c in grid)


def test_the_auto_plans_own_configuration_prices_the_same(gpt):
    """Read the auto plan's configuration from the plan itself, price it as a what-if: same step."""
    from autopar.solver.compare import config_of

    model, inputs = models.build("gpt", layers=2, batch=16)
    plan = autopar.plan(model, autopar.Mesh((4,), cluster="cpu-gloo"), inputs, idle_axes=())
    config = config_of(plan)
    assert config is not None, layout_words(plan)
    rows = autopar.compare(plan, model, inputs, config)
    assert rows[1].step_time_s == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    assert rows[1].memory_bytes == pytest.approx(plan.predicted["memory_bytes_per_device"], rel=1e-9)


def test_what_if_views_keep_the_hardware_and_pipelines_count_every_microbatch():
    from autopar.solver.mesh_views import config_mesh
    from autopar.solver.explain import bytes_per_step

    mesh = autopar.Mesh((4, 4), cluster="h100-80g")
    assert config_mesh(mesh, 2, 8).links() == autopar.Mesh((2, 8), cluster="h100-80g").links()
    model, inputs = models.build("gpt", device="meta", layers=4, width=512, heads=8, seq=128, vocab=4096, batch=16)
    plan = autopar.plan(model, autopar.Mesh((2, 2), cluster="a100-80g"), inputs,
                        pipeline=autopar.Pipeline(stages=2, microbatches=4))
    m = plan.pipeline.microbatches
    per_micro = sync = 0
    for p in plan.stage_plans():
        s = sum(int(q.grad_sync.nbytes) * len(q.grad_sync.collectives) for q in p.params.values() if q.grad_sync is not None)
        per_micro += sum(c[2] for c in p.collectives()) - s
        sync += s
    assert bytes_per_step(plan) == pytest.approx(m * per_micro + sync)


def test_the_predicted_model_flops_utilization_and_throughput():
    """``summary()`` and ``explain`` read a plan against published runs: model FLOPs (3 x the
    forward's matmuls and attention; an MLP's by hand: 2 x batch x in x out per linear) over the
    step on every device at the preset's peak, and tokens (a language model's) or samples per
    second per device; a pipeline's count the same FLOPs as one stage's."""
    import math

    from autopar.cluster import resolve_cluster

    model, inputs = models.build("mlp", layers=2, width=32, hidden=64, batch=8)
    plan = autopar.plan(model, autopar.Mesh((2,), cluster="a100-80g"), inputs)
    s = plan.summary()
    linears = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert s["model_flops"] == 3 * 2 * 8 * linears
    peak = dict(resolve_cluster("a100-80g").peak_flops)["float32"]
    assert s["mfu"] == pytest.approx(s["model_flops"] / (s["step_time_s"] * 2 * peak), rel=1e-12)
    assert s["samples_per_s_per_device"] == pytest.approx(8 / s["step_time_s"] / 2) and "tokens_per_s_per_device" not in s

    model, inputs = models.build("gpt", device="meta", layers=4, width=256, heads=8, seq=128, vocab=2048, batch=16)
    mesh = autopar.Mesh((4,), cluster="h100-80g")
    one = autopar.plan(model, mesh, inputs, pipeline=False, precision="bf16")
    piped = autopar.plan(model, mesh, inputs, pipeline=autopar.Pipeline(stages=2, microbatches=4), precision="bf16")
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    graph = ir.trace(model, inputs)
    attention = sum(n.flops for n in graph.nodes.values() if "scaled_dot_product" in n.target)
    tokens = 16 * 128
    peak = dict(resolve_cluster("h100-80g").peak_flops)["bfloat16"]
    for plan in (one, piped):
        s = plan.summary()
        assert s["model_flops"] == pytest.approx(3 * (2 * tokens * weights + attention), rel=1e-12)
        assert s["mfu"] == pytest.approx(s["model_flops"] / (s["step_time_s"] * 4 * peak), rel=1e-12)
        assert s["tokens_per_s_per_device"] == pytest.approx(tokens / s["step_time_s"] / 4, rel=1e-12)
        line = next(x for x in plan.explain().splitlines() if "model-FLOPs utilization" in x)
        assert f"{s['mfu']:.1%}" in line and "tokens/s per device" in line
        assert math.isclose(autopar.Plan.from_json(plan.to_json()).summary()["mfu"], s["mfu"])
    assert piped.pipeline is not None and sum("model-FLOPs" in x for x in piped.explain().splitlines()) == 1

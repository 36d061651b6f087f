"""autopar.Layout: hand-style layouts as restrictions of the plan space, checked on the plans they give."""
import sys
from pathlib import Path

import pytest

import autopar
from autopar import Layout, models
from autopar.cost_model.comm import local_sum_time, mesh_collective_time
from autopar.record.grad_sync import ZERO2_SUMS
from autopar.cost_model.step import step_time
from autopar.record.buckets import bucket_count, bucket_sizes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models_zoo import vit  # noqa: E402

GPT = dict(vocab=64, width=32, layers=2, heads=4, seq=16, batch=8)


@pytest.fixture(scope="module")
def gpt():
    model, inputs = models.build("gpt", device="meta", **GPT)
    return model, inputs, autopar.ir.trace(model, inputs)


def plan_of(gpt, shape, **fields):
    model, inputs, graph = gpt
    return autopar.plan(model, autopar.Mesh(shape), graph=graph, force=Layout(**fields))


def linears(plan):
    return [n for n in plan.nodes.values() if "linear" in n.target]


def weights(plan):
    return [p for p in plan.params.values() if len(p.storage.shape) == 2 and "wpe" not in p.name]


def test_data_parallel_splits_every_batch_and_keeps_weights_whole(gpt):
    plan = plan_of(gpt, (4,), dp=4)
    assert plan.solver["layout"] == "dp4-tp1" and plan.idle_axes == ()
    assert {n.family for n in linears(plan)} == {"dp"}
    assert all(p.storage.is_replicated and p.grad_sync.name == "all_reduce" for p in plan.params.values())


def test_data_parallel_follows_a_batch_that_is_not_dim_0():
    """A ViT: a class token expanded to the batch and concatenated (an activation there, not a
    weight), a patch convolution, and nn.MultiheadAttention, whose internals run time-first
    (T, B, D). Data parallel still splits the batch there and keeps every parameter whole."""
    model, inputs = vit(batch=8, image=8, dim=32, depth=2)
    plan = autopar.plan(model, autopar.Mesh((2,)), inputs, force=Layout(dp=2))
    assert all(p.storage.is_replicated for p in plan.params.values())
    conv = next(n for n in plan.nodes.values() if "conv2d" in n.target)
    assert conv.family == "dp" and conv.output.dim_axes[0] == (0,)
    cat = next(n for n in plan.nodes.values() if n.target == "aten.cat.default")
    assert all(spec.dim_axes[0] == (0,) for spec in cat.inputs)  # the expanded class token splits with the batch
    graph = autopar.ir.trace(model, inputs)
    time_first = [n for n in plan.nodes.values() if n.target == "aten.transpose.int"
                  and tuple(graph.nodes[n.name].meta.shape)[:2] == (5, 8)]  # (T, B, D) inside attention
    assert time_first and all(n.output.dim_axes[1] == (0,) for n in time_first)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_shard_gradients_and_states(gpt, zero):
    plan = plan_of(gpt, (4,), dp=4, zero=zero)
    assert all(p.family == "zero2" and p.grad_sync.split and p.grad_sync.sum_by in ZERO2_SUMS for p in plan.params.values())


@pytest.mark.parametrize("cluster, sync", [("cpu-gloo", "all_to_all+all_gather"),
                                           ("a100-80g", "reduce_scatter+all_gather")])
def test_zero2_sums_and_splits_by_the_cheapest_collective(gpt, cluster, sync):
    """gloo's reduce-scatter moves a byte ~4x slower than its all-reduce and its all-to-all faster
    still: there each rank gathers its chunk's parts by all-to-all and sums them; NCCL-class links
    reduce-scatter (the all-to-all moves as many bytes and leaves a sum to do)."""
    model, _, graph = gpt
    mesh = autopar.Mesh((4,), cluster=cluster)
    plan = autopar.plan(model, mesh, graph=graph, force=Layout(dp=4, zero=2))
    assert {p.grad_sync.name for p in plan.params.values()} == {sync}
    nbytes = 64 << 20
    cl = mesh.resolved_cluster()
    by = {k: mesh_collective_time(k, nbytes, mesh, (0,)) + local_sum_time(k, nbytes, 4, cl) for k in ZERO2_SUMS}
    assert f"{min(by, key=by.get)}+all_gather" == sync
    # the sum an all-to-all leaves: read the 4 parts, write one
    assert local_sum_time("all_to_all", nbytes, 4, cl) == pytest.approx(1.25 * nbytes / cl.sustained_memory_bandwidth)
    assert local_sum_time("reduce_scatter", nbytes, 4, cl) == 0.0


def test_zero_3_stores_parameters_split_over_the_data_axis(gpt):
    plan = plan_of(gpt, (4,), dp=4, zero=3)
    assert all(0 in p.storage.used_axes for p in plan.params.values())
    assert {n.family for n in linears(plan)} == {"dp"}  # gathered before use


def test_megatron_splits_every_block_weight_over_the_tensor_axis(gpt):
    plan = plan_of(gpt, (4,), tp=4)
    block = [n for n in linears(plan) if n.layer is not None]
    assert block and all(n.inputs[1] is not None and 0 in n.inputs[1].used_axes for n in block)
    assert {n.family for n in block} <= {"1d-col", "1d-row"}


def test_2d_is_data_by_tensor_parallel(gpt):
    plan = plan_of(gpt, (2, 2), dp=2, tp=2)
    block = [n for n in linears(plan) if n.layer is not None]
    assert all(n.inputs[0].dim_axes[0][:1] == (0,) for n in block)  # batch over dp
    assert all(1 in n.inputs[1].used_axes and 0 not in n.inputs[1].used_axes for n in block)  # weight over tp


@pytest.mark.parametrize("vocab", [True, False])
def test_vocabulary_parallel_loss_is_forced_either_way(gpt, vocab):
    plan = plan_of(gpt, (2, 2), dp=2, tp=2, vocab_parallel=vocab)
    (loss,) = [n for n in plan.nodes.values() if "cross_entropy" in n.target]
    assert loss.family.vocab_parallel == vocab


def test_bad_layouts_say_what_to_do(gpt):
    model, inputs, graph = gpt
    with pytest.raises(autopar.ConfigError, match=r"axes of size > 1 are \(2, 2\)"):
        autopar.plan(model, autopar.Mesh((4,)), graph=graph, force=Layout(dp=2, tp=2))
    with pytest.raises(autopar.ConfigError, match="needs dp > 1"):
        Layout(tp=4, zero=2)
    with pytest.raises(autopar.ConfigError, match="zero stage"):
        Layout(dp=4, zero=5)


def test_bucket_sizes_follow_the_reducer():
    assert bucket_sizes(0) == []
    assert bucket_sizes(100, 64) == [64, 36]
    assert bucket_sizes(3 << 20, 1 << 20) == [1 << 20, 1 << 20, 1 << 20]
    assert bucket_sizes(30 << 20) == [1 << 20, 25 << 20, 4 << 20]
    for total in (0, 1, 1 << 20, (1 << 20) + 1, 26 << 20, (26 << 20) + 1, 350 << 30):
        for size in (1 << 19, 25 << 20):
            assert bucket_count(total, size) == len(bucket_sizes(total, size))


def test_step_time_prices_buckets_not_parameters(gpt):
    """Data parallel over many small parameters: one all-reduce per bucket, not one per parameter."""
    plan = plan_of(gpt, (4,), dp=4)
    model, inputs, graph = gpt
    mesh = plan.mesh_obj
    one = step_time(plan, graph, mesh)
    assert one["buckets"] == 1
    tiny = step_time(plan, graph, mesh, bucket_bytes=1024)
    assert tiny["buckets"] > 10 and tiny["grad_sync_s"] > one["grad_sync_s"]
    parts = one["compute_s"] + one["overhead_s"] + one["comm_s"] + one["optimizer_s"] + one["grad_accumulate_s"]
    assert one["step_time_s"] == pytest.approx(parts)
    # every parameter is replicated and bucketed: each copies its whole gradient into its bucket
    cluster = mesh.resolved_cluster()
    params = graph.param_bytes()
    assert one["grad_accumulate_s"] == pytest.approx(
        2 * params / cluster.sustained_memory_bandwidth + len(graph.params) * cluster.backward_op_overhead_s)


def test_zero3_gathers_are_priced_per_layer_as_they_run():
    """The runtime gathers a layer's split-stored parameters in one collective; the ILP prices each
    parameter's gather with its bytes and its share of that call's latency, so over a ZeRO-3 plan
    the ILP's objective is exactly the grouped collectives' price (a100: no per-kind factors, so a
    reduce-scatter costs what an all-gather does), each with its packing copies (the shards into the
    buffer sent, every full tensor out of the one received)."""
    from autopar.cost_model.comm import layout_copy_time, mesh_collective_time
    from autopar.record.gathers import param_gather_groups

    model, inputs = models.build("mlp", layers=2, device="meta")
    graph = autopar.ir.trace(model, inputs)
    mesh = autopar.Mesh((4,), cluster="a100-80g")
    plan = autopar.plan(model, mesh, graph=graph, force=Layout(dp=4, zero=3))
    groups, grouped = param_gather_groups(graph, plan.edges)
    assert len(groups) == 3 and all(len(m) >= 2 for m in groups.values())  # 2 layers and the rest
    cluster = mesh.resolved_cluster()
    gathers = sum(2 * (mesh_collective_time("all_gather", b, mesh, axes) + layout_copy_time(b / 4 + b, cluster))
                  for (_, axes), m in groups.items() for b in [sum(e.steps[0].nbytes for _, e in m)])
    others = sum(e.cost_s for e in plan.edges if (e.dst, e.position) not in grouped)
    expected = (sum(n.compute_s for n in plan.nodes.values()) + others + gathers
                + sum(p.grad_sync_s for p in plan.params.values()) + plan.predicted["overhead_s"])
    assert plan.solver["objective_s"] == pytest.approx(expected, rel=1e-9)

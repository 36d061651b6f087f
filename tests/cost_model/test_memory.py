"""Memory model: parameter/optimizer bytes, saved activations and the liveness peak."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar.models as models
from autopar.cost_model.memory import (
    activation_memory,
    activation_timeline,
    node_activation_bytes,
    param_memory,
    param_memory_parts,
    saved_for_backward,
    total_param_memory,
)
from autopar.cost_model.ops import is_view
from autopar.errors import ConfigError
from autopar.ir import TensorMeta, trace
from autopar.sharding_spec import Mesh, ShardingSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from memory_fidelity import tracked_peak  # noqa: E402  (the benchmark's measurement)

M = 1_000_000
FP32_1M = TensorMeta((1000, 1000), "float32", 4 * M)
BF16_1M = TensorMeta((1000, 1000), "bfloat16", 2 * M)


def _spec(text, mesh, shape=(1000, 1000)):
    return ShardingSpec.parse(text, shape, mesh.ndim)


# ---- parameters -----------------------------------------------------------------------------------
def test_replicated_adam_is_16_bytes_per_fp32_param():
    mesh = Mesh((4,))
    assert param_memory(FP32_1M, None, mesh) == 16 * M  # 4 param + 4 grad + 2 x 4 Adam states
    assert param_memory(FP32_1M, _spec("[R, R]", mesh), mesh, "adam") == 16 * M
    assert param_memory(FP32_1M, None, mesh, "sgd") == 8 * M
    assert param_memory(FP32_1M, None, mesh, "sgd_momentum") == 12 * M


def test_sharded_storage_divides_everything():
    mesh = Mesh((2, 4))
    assert param_memory(FP32_1M, _spec("[S0, R]", mesh), mesh) == 8 * M
    assert param_memory(FP32_1M, _spec("[S1, R]", mesh), mesh) == 4 * M
    assert param_memory(FP32_1M, _spec("[S0, S1]", mesh), mesh) == 2 * M


def test_zero_shards_optimizer_states_once_per_axis():
    mesh = Mesh((2, 2))
    # ZeRO-2 over both axes: the working copy whole, the updated chunk, its gradient and states / 4
    assert param_memory(FP32_1M, None, mesh, opt_state_sharded_axes=(0, 1)) == (4 + 1 + 1 + 8 // 4) * M
    assert param_memory_parts(FP32_1M, None, mesh, opt_state_sharded_axes=(0, 1)) == {
        "parameters": 5 * M, "gradients": 1 * M, "optimizer_states": 2 * M}
    # storage already split on axis 0: states are not divided by axis 0 twice
    assert param_memory(FP32_1M, _spec("[S0, R]", mesh), mesh, opt_state_sharded_axes=(0,)) == 8 * M
    assert param_memory(FP32_1M, _spec("[S0, R]", mesh), mesh, opt_state_sharded_axes=(0, 1)) == (4 + 2) * M
    assert param_memory(FP32_1M, None, Mesh((2, 2), ("dp", "tp")), opt_state_sharded_axes=("dp",)) == (4 + 4 + 4) * M


def test_bf16_params_are_priced_as_torch_keeps_them_and_a_policy_as_it_runs():
    """A 16-bit parameter without a policy is priced as torch's optimizer keeps it: states in the
    parameter's dtype, no master; under ``precision="bf16"`` (the graph traced in bf16) as the
    runtime keeps it: the fp32 master, the step's bf16 working copy, an fp32 gradient and fp32
    states."""
    from autopar.ir.precision import MixedPrecision

    mesh = Mesh((2,))
    assert param_memory(BF16_1M, None, mesh) == (2 + 2 + 4) * M
    assert param_memory(BF16_1M, None, mesh, "sgd") == (2 + 2) * M
    assert param_memory(TensorMeta((1000, 1000), "float16", 2 * M), None, mesh) == 8 * M
    assert param_memory(BF16_1M, _spec("[S0, R]", mesh), mesh) == 4 * M
    bf16 = MixedPrecision()
    assert param_memory_parts(BF16_1M, None, mesh, precision=bf16) == {
        "parameters": (4 + 2) * M, "gradients": 4 * M, "optimizer_states": 8 * M}
    # ZeRO-2 over 2: the master's chunk and the bf16 working copy it gathers; the chunk's gradient and states
    assert param_memory_parts(BF16_1M, None, mesh, opt_state_sharded_axes=(0,), precision=bf16) == {
        "parameters": (2 + 2) * M, "gradients": 2 * M, "optimizer_states": 4 * M}
    # gradients summed in bf16 still land in the fp32 masters' .grad; the all-reduce bucket also
    # keeps the bf16 buffer it sends (not where nothing is summed: split storage, ZeRO-2's chunk)
    bf16_sums = MixedPrecision(reduce_dtype=torch.bfloat16)
    assert param_memory_parts(BF16_1M, None, mesh, precision=bf16_sums) == {
        "parameters": (4 + 2) * M, "gradients": (4 + 2) * M, "optimizer_states": 8 * M}
    for kw in (dict(storage_spec=_spec("[S0, R]", mesh)), dict(storage_spec=None, opt_state_sharded_axes=(0,))):
        assert (param_memory_parts(BF16_1M, mesh=mesh, precision=bf16_sums, **kw)
                == param_memory_parts(BF16_1M, mesh=mesh, precision=bf16, **kw))
    with pytest.raises(ConfigError, match="optimizer"):
        param_memory(FP32_1M, None, mesh, "lion")


def test_zero2_over_several_microbatches_holds_the_whole_gradient_while_it_adds_up():
    """A step of several microbatches adds ZeRO-2's gradients up in the reducer's whole buckets
    until the last backward sums and splits them: the whole local gradient (in the master dtype)
    besides the chunk's; data parallel's bucket is its gradient either way."""
    from autopar.ir.precision import MixedPrecision

    mesh = Mesh((2, 2))
    assert param_memory_parts(FP32_1M, None, mesh, opt_state_sharded_axes=(0, 1), accumulated=True) == {
        "parameters": 5 * M, "gradients": (1 + 4) * M, "optimizer_states": 2 * M}
    assert param_memory_parts(BF16_1M, None, Mesh((2,)), opt_state_sharded_axes=(0,), precision=MixedPrecision(),
                              accumulated=True) == {"parameters": (2 + 2) * M, "gradients": (2 + 4) * M,
                                                    "optimizer_states": 4 * M}
    for kw in (dict(), dict(storage_spec=_spec("[S0, R]", mesh))):
        kw = dict(dict(storage_spec=None), **kw)
        assert param_memory_parts(FP32_1M, mesh=mesh, accumulated=True, **kw) == param_memory_parts(FP32_1M, mesh=mesh, **kw)


def test_a_buckets_gradient_parts_count_where_they_outlast_the_microbatchs_activations():
    from autopar.cost_model.memory import grad_parts_in_flight

    bucket = 25 << 20
    assert grad_parts_in_flight(10 * M, bucket, 4 * M) == 6 * M  # a small model: its gradients in one bucket
    assert grad_parts_in_flight(100 * M, bucket, 4 * M) == bucket - 4 * M  # at most a bucket at once
    assert grad_parts_in_flight(100 * M, bucket, 200 * M) == 0.0  # a microbatch saving more than a bucket


# ---- activations on a traced 1-hidden-layer MLP ----------------------------------------------------
# x (8, 32) -> linear (8, 64) -> relu -> linear_1 (8, 64) -> relu_1 -> linear_2 (8, 32)
#   -> broadcast_tensors(linear_2, targets) -> getitem, getitem_1 (views) -> mse_loss -> output
# fp32: x, targets, linear_2 are 1024 B; linear, relu, linear_1, relu_1 2048 B; the loss 4 B.
@pytest.fixture(scope="module")
def mlp():
    model, inputs = models.build("mlp", layers=1, width=32, hidden=64, batch=8)
    return trace(model, inputs)


def _batch_split(graph, mesh):
    """Every activation and input split on its batch dim (dp); scalars whole."""
    specs = {}
    for n in graph.nodes.values():
        meta = n.tensor_meta
        if meta is None or str(n.role) in ("parameter", "buffer"):
            continue
        dims = (((0,),) + ((),) * (len(meta.shape) - 1)) if meta.shape else ()
        specs[n.name] = ShardingSpec(meta.shape, dims, (), mesh.ndim)
    return specs


def test_saved_for_backward_by_hand(mlp):
    # linear saves x (its weight needs a grad), relu saves its output, linear_1 reads relu,
    # linear_2 reads relu_1, mse_loss saves both operands: views of linear_2 and targets.
    assert saved_for_backward(mlp) == {"x", "relu", "relu_1", "linear_2", "targets"}
    assert not any(is_view(mlp.nodes[n].target) for n in saved_for_backward(mlp) if mlp.nodes[n].op == "call_function")


def test_activation_peak_by_hand(mlp):
    mesh = Mesh((2,))
    live = dict(activation_timeline(mlp, None, mesh))
    assert live["linear"] == 1024 + 1024 + 2048  # x, targets, linear
    assert live["relu"] == 2048 + 2048 + 2048  # linear is still read by relu
    assert live["relu_1"] == 2048 + 2048 + 2048 + 2048  # x+targets, relu (saved), linear_1, relu_1
    assert live["linear_2"] == 2048 + 2048 + 2048 + 1024  # linear_1 freed
    assert live["getitem_1"] == live["linear_2"]  # views cost nothing
    assert live["mse_loss"] == live["linear_2"] + 4
    assert activation_memory(mlp, None, mesh) == 8192
    # batch split over 2 devices halves every tensor (the 4-byte loss stays whole)
    assert activation_memory(mlp, _batch_split(mlp, mesh), mesh) == 4096


def test_node_activation_bytes(mlp):
    mesh = Mesh((2,))
    saved = saved_for_backward(mlp)
    specs = _batch_split(mlp, mesh)
    relu, lin = mlp.nodes["relu"], mlp.nodes["linear"]
    assert node_activation_bytes(relu, None, mesh, saved) == 2048
    assert node_activation_bytes(relu, specs["relu"], mesh, saved) == 1024
    assert node_activation_bytes(lin, specs["linear"], mesh, saved) == 0  # transient, not saved
    assert node_activation_bytes(mlp.nodes["getitem"], None, mesh, saved) == 0  # a view
    total = sum(node_activation_bytes(n, None, mesh, saved) for n in mlp.nodes.values())
    assert total == 1024 * 3 + 2048 * 2


def test_total_param_memory(mlp):
    mesh = Mesh((2,))
    params = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 32 + 32
    assert total_param_memory(mlp, None, mesh) == 16 * params
    assert total_param_memory(mlp, None, mesh, "sgd") == 8 * params


def test_gpt_saved_set_holds_no_views_or_parameters():
    model, inputs = models.build("gpt", layers=1)
    g = trace(model, inputs)
    saved = saved_for_backward(g)
    assert saved and all(str(g.nodes[n].role) not in ("parameter", "buffer", "constant") for n in saved)
    assert not any(g.nodes[n].op == "call_function" and is_view(g.nodes[n].target) for n in saved)
    assert any(g.nodes[n].target == "aten.scaled_dot_product_attention.default" for n in saved)
    assert activation_memory(g, None, Mesh((2,))) >= sum(node_activation_bytes(g.nodes[n], None, Mesh((2,)), saved) for n in saved)


def test_saved_inputs_follow_views_to_the_weight():
    """A linear layer's matmul keeps its input, and its weight where its input needs a gradient
    (the first layer's does not: backward there only makes the weight's gradient, from the input)."""
    import torch

    from autopar.cost_model.memory import saved_inputs

    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 2, bias=False))
    graph = trace(model, (torch.randn(4, 8),))
    kept = saved_inputs(graph)
    weights = [n.name for n in graph.nodes.values() if str(n.role) == "parameter"]
    readers = [next(n for n in graph.nodes.values() if w in n.inputs) for w in weights]
    assert [(r.name, r.inputs.index(w)) in kept for r, w in zip(readers, weights)] == [False, True]
    assert all((r.name, 0) in kept for r in readers)
    relu = next(n for n in graph.nodes.values() if "relu" in str(n.target))
    assert (relu.name, 0) not in kept  # relu keeps its output, not its input


def test_zero3_plan_holds_each_gathered_weight_until_backward():
    import autopar
    from autopar.cost_model.memory import saved_inputs
    from autopar.cost_model.ops import alias_roots, local_numel

    model, inputs = models.build("gpt", layers=2, width=64, heads=4, seq=16, vocab=128, batch=8)
    mesh = autopar.Mesh((4,))
    plan = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=4, zero=3), pipeline=False)
    graph = trace(model, inputs)
    kept, roots = saved_inputs(graph), alias_roots(graph)
    gathered = 0
    for e in plan.edges:
        from_weight = all(str(graph.nodes[r].role) == "parameter" for r in roots[e.src])
        if (e.dst, e.position) in kept and from_weight and e.src_spec != e.dst_spec:
            gathered += local_numel(e.dst_spec.shape, e.dst_spec, mesh) * 4
    weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "wpe" not in name) * 4
    assert gathered >= 0.9 * weights  # every matrix the matmuls read whole (the embedding's table excepted)
    # the nodes' memory adds up to the plan's, gathers included, and the gradients: ZeRO-3's
    # reduce-scatter makes them in backward, after the peak (memory.gradients_made_late)
    held = sum(n.memory_bytes for n in plan.nodes.values()) - plan.predicted["memory_bytes_per_device"]
    assert plan.predicted["memory_parts"]["gradients"] == 0.0
    assert held == pytest.approx(plan.predicted["memory_parts"]["parameters"], abs=1.0)  # (fp32: as large)
    without = autopar.plan(model, mesh, inputs, force=autopar.Layout(dp=4), pipeline=False)
    assert plan.predicted["memory_parts"]["activations"] == pytest.approx(
        without.predicted["memory_parts"]["activations"] + gathered, rel=1e-6)


def test_the_step_peaks_in_the_losss_backward_by_hand(mlp):
    """mse_loss's backward reads the loss's gradient (4 B) and makes its inputs' (1024 B each: both
    come out of broadcast_tensors, whose outputs all need one as one of its inputs does) while
    every saved value (7168 B) and the returned loss (4 B) live: 9224 B, over the forward's 8192."""
    from autopar.cost_model.memory import node_peak_bytes, step_peak
    from autopar.sharding_spec.strategy import Strategy

    peak = step_peak(mlp)
    loss = next(n for n in mlp.nodes.values() if "mse_loss" in n.target)
    assert (peak.node, peak.backward) == (loss.name, True)
    assert [loss.inputs[k] for k in peak.grads] == ["getitem", "getitem_1"]
    saved, mesh = saved_for_backward(mlp), Mesh((2,))
    metas = [mlp.nodes[i].meta for i in loss.inputs]
    whole = Strategy((None, None), None, "replicate", 1.0)
    at_peak = node_peak_bytes(loss, whole, mesh, saved, peak, metas)
    assert at_peak == 4 + 4 + 2 * 1024  # its value (returned), its gradient, its inputs'
    assert sum(node_activation_bytes(n, None, mesh, saved) for n in mlp.nodes.values()) + at_peak == 9224


def _language_model(**loss_kw):
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(512, 16), torch.nn.Linear(16, 512)

        def forward(self, idx, targets):
            return torch.nn.functional.cross_entropy(self.head(self.emb(idx)).view(-1, 512), targets.view(-1), **loss_kw)

    idx = torch.randint(0, 512, (4, 32))
    return LM(), (idx, torch.randint(0, 512, (4, 32)))


@pytest.mark.parametrize("loss_kw, fused", [({}, True), ({"label_smoothing": 0.1}, False)])
def test_atens_cross_entropy_peaks_in_backward_and_autopars_fused_one_in_forward(loss_kw, fused):
    """A vocabulary-sized loss: ATen's backward makes the log-probabilities' and the logits'
    gradients beside the saved log-probabilities (3 logits-sized tensors); autopar's fused loss
    makes the logits' gradient in place of what it keeps, so its peak is the forward's (the logits
    and the log-probabilities). The single-device plan predicts each, and runs each (measured)."""
    import autopar
    from autopar.cost_model.memory import step_peak
    from autopar.ir.losses import fused_cross_entropy

    model, inputs = _language_model(**loss_kw)
    graph = trace(model, inputs)
    loss = next(n for n in graph.nodes.values() if "cross_entropy" in n.target)
    assert fused_cross_entropy(graph, loss) == fused
    peak = step_peak(graph)
    assert (peak.node == loss.name and peak.backward) == (not fused)
    logits = 4 * 32 * 512 * 4
    assert not dist.is_initialized()
    try:
        pm = autopar.parallelize(model, autopar.Mesh((1,)), inputs, pipeline=False)  # (a world of one)
        activations = pm.plan.predicted["memory_parts"]["activations"]
        assert activations == pytest.approx((2 if fused else 3) * logits, rel=0.05)
        with torch.no_grad():
            assert float(pm(*inputs)) == pytest.approx(float(model(*inputs)), rel=1e-6)
        params = list(pm.parameters())
        peak = tracked_peak(lambda: pm(*inputs).backward(), params)  # (the gradients made after the peak)
        assert peak - sum(p.numel() * p.element_size() for p in params) == pytest.approx(activations, rel=0.05)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_value_every_reader_reshards_is_freed_and_a_gathered_gradient_moves_the_peak():
    """gelu's whole output read split by the row-parallel matmul after it, which keeps the slice (a
    new tensor) for backward: gelu's output is freed once sliced and the slice is kept in its place
    (``released_by_reshards``). The slice's backward over the identical axis gathers the gradient
    whole (a received buffer and a concatenated copy) while the first layer's activations are
    still kept: the step's peak moves into that backward (``plan_backward_peak``), off the
    replicated timeline's (the loss). Without either, the prediction was 12.5% under the dry run;
    freeing the source without pricing the gather, 35% under."""
    import autopar
    from autopar.compose.dry_run import dry_run
    from autopar.cost_model.memory import released_by_reshards, step_peak

    model, inputs = models.build("gpt", layers=2, width=128, heads=4, seq=64, vocab=256, batch=8)
    graph = trace(model, inputs)
    gelus = [n for n in graph.nodes.values() if "gelu" in n.target]
    fc = [graph.nodes[g.inputs[0]] for g in gelus]
    proj = [next(m for m in graph.nodes.values() if g.name in m.inputs) for g in gelus]
    force = {**{f.name: "replicate" for f in fc}, **{g.name: "replicate" for g in gelus}, **{p.name: "1d-row" for p in proj}}
    mesh = autopar.Mesh((4,))
    plan = autopar.plan(model, mesh, inputs, force=force, pipeline=False)
    sliced = {(e.dst, e.position) for e in plan.edges if e.src in {g.name for g in gelus} and e.src_spec != e.dst_spec}
    assert len(sliced) == len(gelus)
    released, holding = released_by_reshards(graph, sliced)
    assert {g.name for g in gelus} <= released and sliced <= holding
    assert released_by_reshards(graph, set(list(sliced)[:1]))[0] & {g.name for g in gelus} != {g.name for g in gelus}
    assert step_peak(graph).node == "cross_entropy_loss"  # the replicated timeline's peak
    run = dry_run(plan, model, inputs, ranks=[0]).runs[0]
    assert run.peak_bytes == pytest.approx(run.predicted_bytes, rel=0.05)


def test_a_reshards_backward_holds_the_gradients_it_makes_and_its_collectives_buffers():
    """By hand, on (8, 64, 512) fp32 (1 MiB) over 4 ranks: a slice of the last dim over an axis
    whose gradients are whole all-gathers the gradient in backward (a packed copy of the 0.25 MiB
    chunk, a 1 MiB receive buffer and the 1 MiB concatenated result); elsewhere it pads the chunk
    with zeros (the 1 MiB result only). An all_to_all from the last dim to the batch sends back
    from the batch (no packing) into a buffer it concatenates from."""
    from autopar.cost_model.memory import reshard_backward_bytes, step_buffer_bytes
    from autopar.solver.plan import StepPlan

    mesh = Mesh((4,))
    whole = ShardingSpec.parse("[R, R, R]", (8, 64, 512), 1)
    mib = 2**20
    slice_last = [StepPlan("slice", (0,), mib, 0.0, None, 2)]
    assert reshard_backward_bytes(slice_last, whole, mesh, 4, identical=(0,)) == mib + mib // 4 + mib
    assert reshard_backward_bytes(slice_last, whole, mesh, 4) == mib
    cols = ShardingSpec.parse("[R, R, S0]", (8, 64, 512), 1)
    to_batch = [StepPlan("all_to_all", (0,), mib // 4, 0.0, 2, 0)]
    assert reshard_backward_bytes(to_batch, cols, mesh, 4) == mib // 4 + mib // 4
    assert step_buffer_bytes("all_gather", 0, None, 10, 40) == 0
    assert step_buffer_bytes("all_gather", 2, None, 10, 40) == 50
    assert step_buffer_bytes("all_to_all", 2, 0, 10, 10) == 10
    assert step_buffer_bytes("reduce_scatter", None, 0, 40, 10) == 40
    assert step_buffer_bytes("reduce_scatter", None, 1, 40, 10) == 50


def test_a_projection_split_into_heads_is_kept_through_its_split_and_freed_when_each_head_copy_is():
    """q, k and v are getitems of a split of the projection: backward keeps the projection through
    them (a reshard on the projection's edge into the split is kept, ``saved_inputs``); once each
    of the three reads reshards to a new tensor, the projection is freed and the copy nearest each
    reader kept (a whole copy further back goes too)."""
    from autopar.cost_model.memory import keeping_reads, released_by_reshards, saved_inputs

    model, inputs = models.build("gpt", layers=1, width=64, heads=4, seq=16, vocab=64, batch=2)
    graph = trace(model, inputs)
    split = next(n for n in graph.nodes.values() if n.target == "aten.split.Tensor")
    proj = split.inputs[0]
    assert (split.name, 0) in saved_inputs(graph)
    reads = keeping_reads(graph)[proj]
    assert len(reads) == 3 and all(r[-1] == (split.name, 0) for r in reads)
    heads = {r[0] for r in reads}  # the attention's reads of q, k and v
    released, holding = released_by_reshards(graph, heads | {(split.name, 0)})
    assert proj in released and holding == heads
    released, holding = released_by_reshards(graph, {(split.name, 0)})
    assert proj in released and holding == {(split.name, 0)}
    assert proj not in released_by_reshards(graph, set(list(heads)[:2]))[0]
    # a user's input (the token ids the embedding keeps) stays with the caller, resharded or not
    every_read = {(n.name, k) for n in graph.nodes.values() for k in range(len(n.inputs))}
    inputs = {n.name for n in graph.nodes.values() if n.op == "placeholder" and str(n.role) == "input"}
    assert inputs & set(keeping_reads(graph)) and not inputs & released_by_reshards(graph, every_read)[0]

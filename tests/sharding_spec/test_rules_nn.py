"""Embedding, attention and loss rules: exact strategies checked per rank; the strategies whose
family needs codegen lowering (vocab-parallel embedding and cross entropy, mean loss over split
samples) are skipped by the per-rank check, and their lowerings' math is checked here in plain torch."""
import pytest
import torch
import torch.nn.functional as F
from rules_harness import MESH_3D, Mesh, check_op, context, ints, make_node, rand

from autopar.ir import NodeRef as R
from autopar.sharding_spec import simulator
from autopar.sharding_spec.rules import strategies_for
from autopar.sharding_spec.strategy import needs_lowering

V = {
    "emb": rand(16, 8),
    "tok": ints(4, 6, lo=0, hi=16, dtype=torch.int64),
    "pos": ints(1, 6, lo=0, hi=16, dtype=torch.int64),
    "q": rand(2, 4, 8, 4),
    "kv2": rand(2, 2, 8, 4),
    "q3": rand(2, 8, 4),
    "mask": ints(2, 1, 8, 8, lo=0, hi=2, dtype=torch.bool) | torch.eye(8, dtype=torch.bool),
    "bias": rand(4, 8, 8),
    "fmask": rand(2, 1, 8, 8, seed=5),
    "logits": rand(8, 16),
    "logits3": rand(4, 16, 6),
    "tgt": torch.tensor([1, 5, -100, 15, 0, 9, 9, 3]),
    "tgt3": ints(4, 6, lo=0, hi=16, dtype=torch.int64),
    "probs": torch.softmax(rand(8, 16, seed=3), -1),
    "cw": rand(16).abs() + 0.5,
    "x": rand(8, 6),
    "y": rand(8, 6, seed=1),
}


def _strategies(target, args, kwargs=None, mesh=Mesh((2,))):
    node, _ = make_node(target, args, kwargs, V)
    return strategies_for(context(node, V, mesh))


# ---- embedding ----------------------------------------------------------------------------------------
def test_embedding():
    seen = check_op("aten.embedding.default", (R("emb"), R("tok")), values=V, meshes=[Mesh((2,)), Mesh((2, 2)), MESH_3D],
                    families={"replicate", "dp", "sp", "embedding-hidden", "embedding-vocab-parallel"})
    fams = {s.family for s in seen}
    assert {"dp", "sp", "embedding-hidden", "embedding-vocab-parallel", "dp+embedding-hidden"} <= fams
    vocab = [s for s in seen if s.family == "embedding-vocab-parallel" and len(s.inputs[0].dim_axes) == 2][0]
    assert vocab.inputs[0].dim_axes[0] and vocab.output.partial == vocab.inputs[0].dim_axes[0]
    check_op("aten.embedding.default", (R("emb"), R("pos")), values=V)


def vocab_parallel_embedding(weight_shard, indices, offset):
    """The lowering codegen owes "embedding-vocab-parallel" (see rules/embedding.py)."""
    local = indices - offset
    hit = (local >= 0) & (local < weight_shard.shape[0])
    out = F.embedding(local.masked_fill(~hit, 0), weight_shard)
    return out.masked_fill(~hit[..., None], 0)


@pytest.mark.parametrize("mesh", [Mesh((2,)), Mesh((2, 2))])
def test_vocab_parallel_embedding_lowering(mesh):
    node, expected = make_node("aten.embedding.default", (R("emb"), R("tok")), None, V)
    for s in strategies_for(context(node, V, mesh)):
        if not needs_lowering(s.family):
            continue
        w = simulator.shard(V["emb"], s.inputs[0], mesh)
        idx = simulator.shard(V["tok"], s.inputs[1], mesh)
        local = {}
        for r in range(mesh.size):
            offset = s.inputs[0].local_offset(mesh, r)[0]
            local[r] = vocab_parallel_embedding(w[r], idx[r], offset)
        torch.testing.assert_close(simulator.unshard(local, s.output, mesh), expected)


# ---- attention -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,kwargs,families",
    [
        ((R("q"), R("q"), R("q")), {"is_causal": True}, {"dp", "heads", "dp+heads"}),
        ((R("q"), R("q"), R("q"), R("mask")), {}, {"dp", "heads", "sp", "dp+heads", "dp+sp", "heads+sp"}),
        ((R("q"), R("q"), R("q"), R("bias")), {"scale": 0.3}, {"dp", "heads", "sp", "heads+sp"}),
        ((R("q"), R("kv2"), R("kv2")), {"enable_gqa": True}, {"dp", "heads", "sp"}),
        ((R("q3"), R("q3"), R("q3")), {}, {"dp", "sp"}),
    ],
)
def test_sdpa(args, kwargs, families):
    seen = check_op("aten.scaled_dot_product_attention.default", args, kwargs, values=V)
    fams = {s.family for s in seen}
    assert families <= fams, fams
    if kwargs.get("is_causal"):
        assert "sp" not in " ".join(fams)
    # ring attention (lowered: codegen/ring_attention.py, exact in tests/codegen) for 4-D self-attention
    ring = "ring(causal)" if kwargs.get("is_causal") else "ring"
    assert any(f.has(ring) for f in fams) == (args[0].name == "q"), fams  # 4-D, L == S
    for s in seen:
        if s.family.ring:  # q, k, v and the output split alike along the sequence
            assert s.inputs[0].dim_axes[-2] and all(x.dim_axes[-2] == s.inputs[0].dim_axes[-2] for x in s.inputs[:3])
            assert s.output.dim_axes[-2] == s.inputs[0].dim_axes[-2], str(s)
            continue
        for spec in s.inputs[:3]:  # otherwise the key length and head dims are never split
            assert spec.dim_axes[-1] == () and (spec is s.inputs[0] or spec.dim_axes[-2] == ()), str(s)


def test_sdpa_three_axis_mesh():
    check_op("aten.scaled_dot_product_attention.default", (R("q"), R("q"), R("q"), R("mask")), values=V, meshes=[MESH_3D])


def test_flash_attention_for_cpu():
    seen = check_op("aten._scaled_dot_product_flash_attention_for_cpu.default", (R("q"), R("q"), R("q")),
                    {"attn_mask": R("fmask")}, values=V)
    assert all(isinstance(s.output, tuple) and len(s.output) == 2 for s in seen)


# ---- losses --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        (R("logits"), R("tgt"), None, 0),
        (R("logits"), R("tgt"), None, 2),
        (R("logits"), R("tgt"), R("cw"), 2),
        (R("logits"), R("tgt"), None, 2, -100, 0.1),
        (R("logits3"), R("tgt3"), None, 0),
        (R("logits3"), R("tgt3"), None, 1),
        (R("logits"), R("probs"), None, 2),
        (R("logits"), R("tgt")),
    ],
)
def test_cross_entropy(args):
    reduction = args[3] if len(args) > 3 else 1
    seen = check_op("aten.cross_entropy_loss.default", args, values=V,
                    families={"replicate", "dp", "loss-batch-split(mean)", "loss-vocab-parallel"})
    fams = {s.family for s in seen}
    assert ("loss-batch-split(mean)" in fams) == (reduction == 1)
    assert ("loss-vocab-parallel" in " ".join(fams)) == (args[1] != R("probs") and args[2:3] in ((), (None,)) and len(args) < 6)


def test_nll_and_elementwise_losses():
    lsm = "lsm"
    V[lsm] = torch.log_softmax(V["logits"], -1)
    for reduction in (0, 1, 2):
        check_op("aten.nll_loss_forward.default", (R(lsm), R("tgt"), None, reduction, -100), values=V)
        check_op("aten.mse_loss.default", (R("x"), R("y"), reduction), values=V)
    check_op("aten.nll_loss_forward.default", (R(lsm), R("tgt"), R("cw"), 2, -100), values=V)


def mean_loss_lowering(local_logits, local_target, ignore_index, global_count):
    """The lowering codegen owes "loss-batch-split(mean)": local sum / global denominator."""
    return F.cross_entropy(local_logits, local_target, reduction="sum", ignore_index=ignore_index) / global_count


def vocab_parallel_cross_entropy(logits_parts, target, offsets, ignore_index=-100):
    """The lowering codegen owes "loss-vocab-parallel" (see rules/loss.py), with the all-reduces
    written as sums and maxes over the ranks' parts. Returns the per-sample loss."""
    m = torch.stack([p.max(-1).values for p in logits_parts]).max(0).values  # all_reduce_max
    s = sum((p - m[:, None]).exp().sum(-1) for p in logits_parts)  # all_reduce_sum
    t = 0
    for p, off in zip(logits_parts, offsets):  # masked pick, all_reduce_sum
        local = target - off
        hit = (local >= 0) & (local < p.shape[-1])
        t = t + p.gather(-1, local.clamp(0, p.shape[-1] - 1)[:, None])[:, 0].masked_fill(~hit, 0)
    loss = s.log() + m - t
    return loss.masked_fill(target == ignore_index, 0)


def test_codegen_lowerings_math():
    logits, tgt = V["logits"], V["tgt"]
    # mean over split samples: each rank's sum over the global count of non-ignored targets.
    count = (tgt != -100).sum()
    parts = [mean_loss_lowering(logits[i : i + 4], tgt[i : i + 4], -100, count) for i in (0, 4)]
    torch.testing.assert_close(sum(parts), F.cross_entropy(logits, tgt))
    # vocabulary-parallel cross entropy over 4 class shards.
    shards = list(torch.chunk(logits, 4, dim=-1))
    per_sample = vocab_parallel_cross_entropy(shards, tgt, [0, 4, 8, 12])
    torch.testing.assert_close(per_sample, F.cross_entropy(logits, tgt, reduction="none"))
    torch.testing.assert_close(per_sample.sum() / count, F.cross_entropy(logits, tgt))


def test_lowered_strategies_are_labelled():
    ce = _strategies("aten.cross_entropy_loss.default", (R("logits"), R("tgt")), mesh=Mesh((2, 2)))
    vocab = [s for s in ce if s.family.has("loss-vocab-parallel")]
    assert vocab and all(needs_lowering(s.family) for s in vocab)
    for s in vocab:  # the lowered loss is whole over the vocab axes: no pending sum left there
        assert not set(s.output.partial) & set(s.inputs[0].dim_axes[1])
    assert all(not needs_lowering(s.family) for s in _strategies("aten.cross_entropy_loss.default", (R("logits"), R("tgt"), None, 2)) if not s.family.vocab_parallel)

"""The lowerings on one rank, through the real functions against torch: the fused vocabulary-
parallel cross entropy (the class axes of size 1), the fused whole-class cross entropy, batch-split
mean losses, split means. Loss and gradient equal torch's, ignored targets included. Split over ranks it runs in
tests/runtime/test_parallelize.py (the vocab-parallel lm and every GPT plan with that loss)."""
import pytest
import torch
import torch.nn.functional as F

from autopar.codegen.groups import GroupHandle
from autopar.codegen.lowerings import VocabParallelCrossEntropy, WholeClassCrossEntropy


def one_rank() -> GroupHandle:
    return GroupHandle(axes=(0,), ranks=(0,), index=0, pg=None, pg_ranks=(0,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_and_gradient_equal_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(12, 40, generator=g, dtype=dtype) * 5).requires_grad_()
    target = torch.randint(0, 40, (12,), generator=g)
    target[[2, 7]] = -100
    upstream = torch.rand(12, generator=g, dtype=dtype)
    loss = VocabParallelCrossEntropy.apply(x, target, -100, one_rank())
    (gx,) = torch.autograd.grad(loss, x, upstream)
    x_ref = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(x_ref, target, ignore_index=-100, reduction="none")
    (gref,) = torch.autograd.grad(ref, x_ref, upstream)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert torch.allclose(loss, ref, rtol=tol, atol=tol)
    assert torch.allclose(gx, gref, rtol=tol, atol=tol)
    assert loss[2] == 0 and gx[7].abs().max() == 0  # ignored targets: no loss, no gradient


@pytest.mark.parametrize("shape", [(12, 40), (5, 7, 3), (9,)])
def test_whole_class_loss_equals_torch(shape):
    # torch's log_softmax kernel forward: the loss bit for bit; backward (exp(log p) - one_hot) * grad
    # as torch's nll and log_softmax backward make it, up to exp's last bit (ignored targets included)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=g) * 6).requires_grad_()
    target_shape = (shape[0], *shape[2:]) if len(shape) >= 2 else ()
    target = torch.randint(0, shape[1] if len(shape) >= 2 else shape[0], target_shape, generator=g)
    if target.dim():
        target.view(-1)[[0, 3]] = -100
    upstream = torch.rand(target_shape, generator=g)
    loss = WholeClassCrossEntropy.apply(x, target, -100)
    (gx,) = torch.autograd.grad(loss, x, upstream)
    x_ref = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(x_ref, target, ignore_index=-100, reduction="none")
    (gref,) = torch.autograd.grad(ref, x_ref, upstream)
    assert torch.equal(loss, ref)
    assert torch.allclose(gx, gref, rtol=1e-6, atol=1e-7)
    if len(shape) == 2:  # an ignored target: no loss, no gradient
        assert loss[3] == 0 and gx[0].abs().max() == 0


def _grad_fns(t):
    """Names of every autograd node behind ``t``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(type(f).__name__)
        todo.extend(n for n, _ in f.next_functions)
    return names


CE = "aten.cross_entropy_loss.default"


@pytest.mark.parametrize("case", ["2d", "ignored", "spatial", "weight", "smoothing", "probabilities"])
def test_batch_split_mean_cross_entropy_equals_torch(case):
    # one rank holding the whole batch (no batch axes): the lowered loss equals torch's mean, fused
    # where the fused loss computes the op (class indices, no weight, no smoothing: the lowering
    # says so from the graph, ir.losses.fused_cross_entropy), ATen's otherwise
    from autopar.codegen.lowerings import autopar_loss_global_mean

    g = torch.Generator().manual_seed(1)
    shape = (6, 10, 3) if case == "spatial" else (12, 40)
    x = (torch.randn(*shape, generator=g) * 4).requires_grad_()
    classes = shape[1]
    target = torch.randint(0, classes, (shape[0], *shape[2:]), generator=g)
    kwargs, fused = {}, case in ("2d", "ignored", "spatial")
    if case in ("ignored", "spatial"):
        target.view(-1)[[1, 4]] = -100
    if case == "weight":
        kwargs["weight"] = torch.rand(classes, generator=g)
    if case == "smoothing":
        kwargs["label_smoothing"] = 0.1
    count = None
    if case == "probabilities":
        target = torch.softmax(torch.randn(*shape, generator=g), 1)
        count = shape[0]
    args = (x, target, kwargs.get("weight"), 1, -100, kwargs.get("label_smoothing", 0.0))
    loss = autopar_loss_global_mean(CE, args, {}, batch_axes=(), count=count, fused=fused)
    (gx,) = torch.autograd.grad(loss, x)
    x_ref = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(x_ref, target, ignore_index=-100, **kwargs)
    (gref,) = torch.autograd.grad(ref, x_ref)
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(gx, gref, rtol=1e-5, atol=1e-7)
    assert ("WholeClassCrossEntropyBackward" in _grad_fns(loss)) == fused


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["2d", "ignored", "spatial"])
def test_a_whole_class_cross_entropy_runs_fused_and_equals_torch(case, reduction):
    """A cross entropy no lowering computes (replicated, or split by sample with sum/none) runs
    fused too: torch's values and gradients, one logits-sized tensor kept."""
    from autopar.codegen.lowerings import autopar_cross_entropy

    g = torch.Generator().manual_seed(2)
    shape = (6, 10, 3) if case == "spatial" else (12, 40)
    x = (torch.randn(*shape, generator=g) * 4).requires_grad_()
    target = torch.randint(0, shape[1], (shape[0], *shape[2:]), generator=g)
    if case != "2d":
        target.view(-1)[[1, 4]] = -100
    code = {"none": 0, "mean": 1, "sum": 2}[reduction]
    loss = autopar_cross_entropy(x, target, None, code, -100, 0.0)
    seed = torch.rand(loss.shape, generator=g)
    (gx,) = torch.autograd.grad(loss, x, seed)
    x_ref = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(x_ref, target, ignore_index=-100, reduction=reduction)
    (gref,) = torch.autograd.grad(ref, x_ref, seed)
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(gx, gref, rtol=1e-5, atol=1e-7)
    assert "WholeClassCrossEntropyBackward" in _grad_fns(loss)


@pytest.mark.parametrize("kw, fused", [({}, True), ({"reduction": "sum"}, True), ({"label_smoothing": 0.1}, False),
                                       ({"weight": "w"}, False), ({"probabilities": True}, False)])
def test_which_cross_entropies_run_fused_is_read_from_the_graph(kw, fused):
    from autopar.ir import trace
    from autopar.ir.losses import fused_cross_entropy

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 5)
            self.register_buffer("w", torch.rand(5))

        def forward(self, x, y):
            opts = {k: (self.w if v == "w" else v) for k, v in kw.items() if k != "probabilities"}
            return F.cross_entropy(self.fc(x), y, **opts)

    y = torch.softmax(torch.randn(4, 5), 1) if kw.get("probabilities") else torch.randint(0, 5, (4,))
    graph = trace(Head(), (torch.randn(4, 8), y))
    (loss,) = [n for n in graph.nodes.values() if n.target == CE]
    assert fused_cross_entropy(graph, loss) == fused


@pytest.mark.parametrize("op, ref, extra", [
    ("aten.mse_loss.default", F.mse_loss, ()),
    ("aten.l1_loss.default", F.l1_loss, ()),
    ("aten.smooth_l1_loss.default", lambda x, y: F.smooth_l1_loss(x, y, beta=0.5), (0.5,)),
    ("aten.huber_loss.default", lambda x, y: F.huber_loss(x, y, delta=2.0), (2.0,)),
    ("aten.binary_cross_entropy_with_logits.default", F.binary_cross_entropy_with_logits, (None, None)),
])
def test_batch_split_mean_of_elementwise_losses_equals_torch(op, ref, extra):
    # the lowering runs the op with reduction="sum" and divides by the global element count: on one
    # rank holding everything, torch's mean, value and gradient
    from autopar.codegen.lowerings import REDUCTION_POS, autopar_loss_global_mean

    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, generator=g).requires_grad_()
    y = torch.rand(6, 5, generator=g) * 3 if "binary" not in op else torch.rand(6, 5, generator=g)
    args = [x, y, *extra]
    args.insert(REDUCTION_POS[op], 1)  # reduction=mean, as traced; the lowering makes it a sum
    loss = autopar_loss_global_mean(op, tuple(args), {}, batch_axes=(), count=x.numel())
    (gx,) = torch.autograd.grad(loss, x)
    x_ref = x.detach().clone().requires_grad_()
    expected = ref(x_ref, y)
    (gref,) = torch.autograd.grad(expected, x_ref)
    assert torch.allclose(loss, expected, rtol=1e-6, atol=1e-7)
    assert torch.allclose(gx, gref, rtol=1e-5, atol=1e-7)


def test_mean_as_sum_divides_by_the_global_count():
    from autopar.codegen.lowerings import autopar_mean_as_sum

    x = torch.randn(4, 6, 8)
    # a rank holding a quarter of dim 0 of a (16, 6, 8) tensor: its share of the global mean
    assert torch.allclose(autopar_mean_as_sum("aten.mean.dim", (x, [0, 2]), {}, count=16 * 8), x.sum((0, 2)) / 128)
    assert torch.allclose(autopar_mean_as_sum("aten.mean.default", (x,), {}, count=x.numel()), x.mean())


@pytest.mark.parametrize("weighted", [False, True])
def test_batch_split_mean_counts_the_whole_target_without_collectives(weighted):
    # each "rank" holds half of the batch (batch axis 0 of size 2, no group bound: an all-reduce
    # would fail) and the whole batch's targets, recomputed from the inputs: its loss is its
    # share of torch's mean over the whole batch, ignored targets counted once, the halves
    # holding 3 and 1 of them
    from autopar.codegen.lowerings import autopar_loss_global_mean

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 12, generator=g) * 3).requires_grad_()
    target = torch.randint(0, 12, (8,), generator=g)
    target[[0, 1, 3, 6]] = -100
    weight = torch.rand(12, generator=g) + 0.5 if weighted else None
    total = 0.0
    for half in (slice(0, 4), slice(4, 8)):
        args = (x[half], target[half], weight, 1, -100, 0.0)
        total = total + autopar_loss_global_mean(CE, args, {}, batch_axes=(0,), whole_target=target)
    ref = F.cross_entropy(x, target, weight=weight, ignore_index=-100)
    assert torch.allclose(total, ref, rtol=1e-6, atol=1e-7)
    (gx,) = torch.autograd.grad(total, x)
    (gref,) = torch.autograd.grad(ref, x)
    assert torch.allclose(gx, gref, rtol=1e-5, atol=1e-7)

"""The parts of a plain training loop around forward/backward/step stay exact on a parallelized
model: global-norm clipping (``pmodel.clip_grad_norm_`` and torch's own utility), train/eval
modes (dropout, batch norm running statistics), batches of other shapes, gradient accumulation,
parameter names and order, parameter groups by name, and the state dict round trip.

Every case runs next to a single-process copy of the model and returns relative errors; one spawn
per world size runs every case inside the same ranks."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import ir, models
from autopar.errors import AutoparError
from autopar.runtime.outputs import SplitOutput
from autopar.runtime.process_groups import MeshGroups
from parallel_harness import ADAM_EPS, TOL, rel, run_case, spawn_by_tag
from test_parallelize import HF_VOCAB, hf_model

MAX_NORM = 0.05  # far below the built-in GPT's gradient norm (~1): clipping bites every step
# Trained parameters after a few optimizer steps: tensor-parallel plans sum in another order, and
# those roundings grow by a few ulps per step (observed up to ~1e-5 relative on 2-D plans).
STATE_TOL = 5e-5


def _gpt(**kw):
    return models.build("gpt", layers=2, **kw)


def _hf_gpt2(dropout: float):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=HF_VOCAB, n_layer=1, n_embd=32, n_head=2, n_positions=16, resid_pdrop=dropout,
                                  embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _batch(inputs, step: int, batch: int | None = None):
    """Fresh inputs like ``inputs`` (batch rows ``batch``), different per step."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for t in inputs:
        shape = (batch if batch is not None else t.shape[0], *t.shape[1:])
        out.append(torch.randn(shape, generator=g, dtype=t.dtype) if t.is_floating_point()
                   else torch.randint(0, int(t.max()) + 1, shape, generator=g, dtype=t.dtype))
    return tuple(out)


def _loss(out):
    return out.loss if hasattr(out, "loss") else (out[-1] if isinstance(out, tuple) else out)


def _state_err(pm, ref) -> float:
    full, want = pm.full_state_dict(), ref.state_dict()
    return max(rel(full[k], want[k]) for k in want)


# ---- cases ------------------------------------------------------------------------------------------
def clip_case(tag, mesh, groups, layout, *, norm_type=2.0, use_torch=False, hf=False):
    """Three clipped SGD-with-momentum steps: the norm each rank gets and the parameters after."""
    if hf:
        model = hf_model("gpt2")
        ids = torch.randint(0, HF_VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
        inputs = (ids, ids)
        call = lambda m, x: m(input_ids=x[0], labels=x[1], use_cache=False)  # noqa: E731
        pm = autopar.parallelize(model, mesh, (), example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
                                 groups=groups, force=layout, pipeline=False)
    else:
        model, inputs = _gpt()
        call = lambda m, x: m(*x)  # noqa: E731
        pm = autopar.parallelize(model, mesh, inputs, groups=groups, force=layout, pipeline=False)
    ref = copy.deepcopy(model)
    o_p = torch.optim.SGD(pm.parameters(), lr=0.5, momentum=0.9)
    o_r = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    norms, grad_err = [], 0.0
    for step in range(3):
        x = inputs if step == 0 else _batch(inputs, step)
        _loss(call(pm, x)).backward()
        _loss(call(ref, x)).backward()
        if use_torch:
            n_p = torch.nn.utils.clip_grad_norm_(pm.parameters(), MAX_NORM, norm_type)
        else:
            n_p = pm.clip_grad_norm_(MAX_NORM, norm_type)
        n_r = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type)  # routed to torch's own
        norms.append((float(n_p), float(n_r)))
        for fqn, g in pm.full_grads().items():
            grad_err = max(grad_err, rel(g, ref.get_parameter(fqn).grad))
        o_p.step(), o_r.step(), o_p.zero_grad(), o_r.zero_grad()
    return {"tag": tag, "norms": norms, "grad_err": grad_err, "state_err": _state_err(pm, ref)}


def clip_errors_case(tag, mesh, groups):
    """error_if_nonfinite as torch's; mixing a ParallelModule's parameters with others is refused; a model whose
    code does not depend on the mode runs eval on its main program."""
    model, inputs = _gpt()
    pm = autopar.parallelize(model, mesh, inputs, groups=groups, force=autopar.Layout(dp=mesh.size))
    _loss(pm(*inputs)).backward()
    p0 = next(pm.parameters())
    p0.grad[(0,) * p0.grad.dim()] = math.inf
    out = {"tag": tag}
    try:
        pm.clip_grad_norm_(1.0, error_if_nonfinite=True)
        out["nonfinite"] = None
    except RuntimeError as err:
        out["nonfinite"] = str(err)
    out["inf_norm"] = float(pm.clip_grad_norm_(1.0, norm_type="inf"))
    pm.zero_grad()
    _loss(pm(*inputs)).backward()
    ref = copy.deepcopy(model)
    _loss(ref(*inputs)).backward()
    out["zero_norm"] = (float(pm.clip_grad_norm_(1e9, norm_type=0)), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=0)))
    last = list(pm.parameters())[-1]
    last.grad.view(-1)[-1] = math.nan  # a NaN in a later gradient: the inf norm must see it on every rank
    try:
        pm.clip_grad_norm_(1.0, norm_type=math.inf, error_if_nonfinite=True)
        out["nan_inf"] = None
    except RuntimeError as err:
        out["nan_inf"] = str(err)
    mlp, mlp_inputs = models.build("mlp")
    pmlp = autopar.parallelize(mlp, mesh, mlp_inputs, groups=groups, pipeline=False)
    pmlp.eval()
    with torch.no_grad():
        out["mode_free_eval_err"] = rel(pmlp(*mlp_inputs), mlp.eval()(*mlp_inputs))
    out["mode_free_programs"] = len(pmlp.programs)
    try:
        torch.nn.utils.clip_grad_norm_(list(pm.parameters()) + [nn.Parameter(torch.ones(2))], 1.0)
        out["mixed"] = None
    except AutoparError as err:
        out["mixed"] = str(err)
    return out


class Scaled(nn.Module):
    """A forward with a Python number argument (export bakes it into the graph)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y, scale: float = 1.0):
        return F.mse_loss(self.lin(x) * scale, y)


def call_values_case(tag, mesh, groups):
    """Another value of a non-tensor argument runs a program of its own (not the traced value);
    a module holding the ParallelModule saves and loads it through torch's own recursion."""
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pm = autopar.parallelize(model, mesh, (x, y), example_kwargs={"scale": 2.0}, groups=groups, pipeline=False)
    out = {"tag": tag, "same_value": rel(pm(x, y, scale=2.0), ref(x, y, scale=2.0)),
           "other_value": rel(pm(x, y, scale=5.0), ref(x, y, scale=5.0)), "programs": len(pm.programs)}
    outer = nn.ModuleDict({"inner": pm})
    sd = outer.state_dict()
    out["outer_keys"] = sorted(sd) == sorted("inner." + k for k in ref.state_dict())
    full = {"inner." + k: v + 1 for k, v in ref.state_dict().items()}
    outer.load_state_dict(full)
    out["outer_load_err"] = max(rel(v, full["inner." + k]) for k, v in pm.full_state_dict().items())
    try:
        outer.load_state_dict({"inner.lin.weight": full["inner.lin.weight"]})
        out["outer_strict"] = None
    except RuntimeError as err:  # torch's own strict error, naming our missing key
        out["outer_strict"] = str(err)
    return out


def eval_case(tag, mesh, groups, *, hf=False):
    """eval(): dropout off, deterministic, equal to the original's eval(); train() turns it back on."""
    if hf:
        model = _hf_gpt2(dropout=0.1)
        ids = torch.randint(0, HF_VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
        kw = {"input_ids": ids, "labels": ids, "use_cache": False}
        pm = autopar.parallelize(model, mesh, (), example_kwargs=kw, groups=groups, pipeline=False)
        call = lambda m: m(**kw).loss  # noqa: E731
    else:
        model, inputs = _gpt(dropout=0.1)
        pm = autopar.parallelize(model, mesh, inputs, groups=groups, pipeline=False)
        call = lambda m: _loss(m(*inputs))  # noqa: E731
    ref = copy.deepcopy(model).eval()
    torch.manual_seed(groups.rank)
    train_loss = call(pm).item()  # dropout on (different masks per rank: not compared)
    pm.eval()
    with torch.no_grad():
        a, b = call(pm), call(pm)
    with torch.inference_mode():
        c = call(pm)
    with torch.no_grad():
        want = call(ref)
    pm.train()
    train_again = call(pm).item()
    return {"tag": tag, "eval_err": rel(a, want), "repeat_err": rel(b, a), "inference_err": rel(c, want),
            "train_differs": abs(train_loss - want.item()) > 1e-6 and abs(train_again - want.item()) > 1e-6,
            "programs": [k[0] for k in pm.programs], "requires_grad": a.requires_grad}


def train_step_case(tag, mesh, groups, layout):
    """train_step runs the program with the loss as its only output: a language model's logits are
    not gathered whole (nothing reads them), the loss's data-parallel sum is left to train_step
    (no barrier between forward and backward), and the step is exact. A plain call still returns
    them whole, when read."""
    model = _hf_gpt2(dropout=0.0)
    ids = torch.randint(0, HF_VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    kw = {"input_ids": ids, "labels": ids, "use_cache": False}
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh, (), example_kwargs=kw, groups=groups, force=layout, pipeline=False)
    o_p = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
    o_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    loss_err = grad_err = 0.0
    for step in range(2):
        b = _batch((ids,), step)[0]
        lp, lr_ = pm.train_step(input_ids=b, labels=b, use_cache=False), ref(input_ids=b, labels=b, use_cache=False).loss
        lr_.backward()
        loss_err = max(loss_err, rel(lp, lr_))
        grad_err = max([grad_err] + [rel(g, ref.get_parameter(k).grad) for k, g in pm.full_grads().items()])
        o_p.step(), o_r.step(), o_p.zero_grad(), o_r.zero_grad()
    with torch.no_grad():
        logits = pm(**kw).logits
        logits_split = isinstance(logits, SplitOutput) and not logits.gathered
        logits_err = rel(logits, ref(**kw).logits)
    main = pm._ap.main
    return {"tag": tag, "loss_err": loss_err, "grad_err": grad_err, "logits_err": logits_err,
            "lp_requires_grad": lp.requires_grad, "state_err": _state_err(pm, ref), "logits_split": logits_split,
            "gathers": (main.lowered.code.count("autopar_all_gather("), main.loss_only().code.count("autopar_all_gather(")),
            "sums": (main.lowered.code.count("autopar_all_reduce("), main.loss_only().code.count("autopar_all_reduce(")),
            "loss_sum_axes": main.loss_sum_axes}


class ConvNet(nn.Module):
    """A small CNN with batch norm (running statistics), as torchvision-style models use."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, 5)

    def forward(self, x, y):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h))).mean((2, 3))
        return F.cross_entropy(self.head(self.drop(h)), y)


class EmaNorm(nn.Module):
    """Buffers updated in place by the forward in training (an EMA of activations, a step count)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)
        self.register_buffer("ema", torch.zeros(16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x, y):
        h = torch.tanh(self.lin(x))
        if self.training:
            self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
            self.steps.add_(1)
        return F.mse_loss(self.out(h - self.ema).squeeze(-1), y)


def batchnorm_case(tag, mesh, groups, force=None, ema=False):
    """Training steps (one with a partial batch) keep the running statistics exact; eval uses them.
    Dropout is off in this comparison (p=0 while training). ``ema``: the in-place buffer model."""
    torch.manual_seed(0)
    if ema:
        model = EmaNorm()
        x, y = torch.randn(8, 8), torch.randn(8)
    else:
        model = ConvNet()
        model.drop.p = 0.0
        x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 5, (8,))
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh, (x, y), groups=groups, force=force,
                             idle_axes=() if force is None else "auto", pipeline=False)
    o_p, o_r = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_err = 0.0
    for step, b in enumerate((8, 6, 8)):
        xs, ys = _batch((x, y), step, b)
        lp, lr_ = pm(xs, ys), ref(xs, ys)
        loss_err = max(loss_err, rel(lp, lr_))
        lp.backward(), lr_.backward()
        o_p.step(), o_r.step(), o_p.zero_grad(), o_r.zero_grad()
    state_err = _state_err(pm, ref)
    pm.eval(), ref.eval()
    with torch.no_grad():
        eval_err = rel(pm(x[:5], y[:5]), ref(x[:5], y[:5]))
    return {"tag": tag, "loss_err": loss_err, "state_err": state_err, "eval_err": eval_err,
            "running_var_moved": float((ref.ema if ema else ref.bn1.running_var - 1).abs().max()) > 1e-3,
            "families": pm.plan.summary()["families"]}


def shapes_case(tag, mesh, groups, layout):
    """Batches of other sizes (one the mesh does not divide) and a shorter sequence train exactly;
    each new shape builds one program, reused on its next call."""
    model, inputs = _gpt()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh, inputs, groups=groups, force=layout, pipeline=False)
    o_p = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
    o_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    b, t = inputs[0].shape
    shapes = [(b, t), (b - 1, t), (b, t // 2), (b - 1, t), (b, t)]
    loss_err = 0.0
    for step, (bb, tt) in enumerate(shapes):
        x = tuple(v[:, :tt].contiguous() for v in _batch(inputs, step, bb))
        lp, lr_ = _loss(pm(*x)), _loss(ref(*x))
        loss_err = max(loss_err, rel(lp, lr_))
        lp.backward(), lr_.backward()
        o_p.step(), o_r.step(), o_p.zero_grad(), o_r.zero_grad()
    return {"tag": tag, "loss_err": loss_err, "state_err": _state_err(pm, ref), "programs": len(pm.programs)}


def accumulation_case(tag, mesh, groups, layout):
    """Four micro-steps (the first three under no_sync) equal one step on their concatenation, and
    synchronise once: as many collectives as the reducer has buckets."""
    model, inputs = _gpt()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh, inputs, groups=groups, force=layout, pipeline=False)
    o_p = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
    o_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    launches = []
    for step in range(2):
        micros = [_batch(inputs, 10 * step + i) for i in range(4)]
        before = pm.reducer.launched
        for i, x in enumerate(micros):
            if i < 3:
                with pm.no_sync():
                    (_loss(pm(*x)) / 4).backward()
            else:
                (_loss(pm(*x)) / 4).backward()
        launches.append(pm.reducer.launched - before)
        big = tuple(torch.cat(parts) for parts in zip(*micros))
        _loss(ref(*big)).backward()
        o_p.step(), o_r.step(), o_p.zero_grad(), o_r.zero_grad()
    return {"tag": tag, "state_err": _state_err(pm, ref), "launches": launches, "buckets": len(pm.reducer.buckets),
            "programs": len(pm.programs)}


def names_case(tag, mesh, groups, layout):
    """Names and order like the original; AdamW groups by name (no decay on biases and norms)
    train exactly; state_dict is DTensors under the original keys and round-trips, into this
    plan and into another."""
    from torch.distributed.tensor import DTensor

    model, inputs = _gpt()
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh, inputs, groups=groups, force=layout, pipeline=False)
    out = {"tag": tag, "names_equal": [n for n, _ in pm.named_parameters()] == [n for n, _ in ref.named_parameters()],
           "buffers_equal": [n for n, _ in pm.named_buffers()][:len(list(ref.named_buffers()))] == [n for n, _ in ref.named_buffers()]}

    def groups_of(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in m.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    o_p = torch.optim.AdamW(groups_of(pm), lr=1e-2, eps=ADAM_EPS)
    o_r = torch.optim.AdamW(groups_of(ref), lr=1e-2, eps=ADAM_EPS)
    for step in range(2):
        x = _batch(inputs, step)
        _loss(pm(*x)).backward(), _loss(ref(*x)).backward()
        o_p.step(), o_r.step(), o_p.zero_grad(), o_r.zero_grad()
    out["groups_state_err"] = _state_err(pm, ref)
    sd = pm.state_dict()
    out["keys_equal"] = list(sd) == list(ref.state_dict())
    out["all_dtensor"] = all(isinstance(v, DTensor) for v in sd.values())
    out["full_err"] = max(rel(v.full_tensor(), ref.state_dict()[k]) for k, v in sd.items())
    saved_local = {k: v.detach().clone() for k, v in sd.items()}  # DTensors of this plan
    saved_full = {k: v.full_tensor().clone() for k, v in sd.items()}
    _loss(pm(*_batch(inputs, 5))).backward()
    o_p.step(), o_p.zero_grad()
    out["moved"] = _state_err(pm, ref) > 1e-4
    pm.load_state_dict(saved_local)
    out["dtensor_roundtrip_err"] = _state_err(pm, ref)
    pm.load_state_dict({k: v + 1 for k, v in saved_full.items()})
    pm.load_state_dict(saved_full)
    out["full_roundtrip_err"] = _state_err(pm, ref)
    other_model, _ = _gpt()
    n = mesh.size
    other_layout = (autopar.Layout(dp=2, tp=2, zero=3) if mesh.ndim == 2
                    else autopar.Layout(tp=n) if layout.tp == 1 else autopar.Layout(dp=n))
    other = autopar.parallelize(other_model, mesh, inputs, groups=groups, force=other_layout, pipeline=False)
    other.load_state_dict(pm.state_dict())  # another plan's DTensors
    out["cross_plan_err"] = _state_err(other, ref)
    try:
        pm.load_state_dict({k: v for k, v in saved_full.items() if "ln_f" not in k})
        out["strict"] = None
    except AutoparError as err:
        out["strict"] = str(err)
    out["missing"] = list(pm.load_state_dict({k: v for k, v in saved_full.items() if "ln_f" not in k}, strict=False).missing_keys)
    return out


# ---- rank functions -----------------------------------------------------------------------------------
def _layouts(mesh):
    n = mesh.size
    if mesh.ndim == 2:
        return {"2d": autopar.Layout(dp=2, tp=2), "2d-zero2": autopar.Layout(dp=2, tp=2, zero=2)}
    return {"dp": autopar.Layout(dp=n), "tp": autopar.Layout(tp=n), "zero2": autopar.Layout(dp=n, zero=2),
            "zero3": autopar.Layout(dp=n, zero=3)}


def _cases(mesh, groups):
    out = []
    for name, layout in _layouts(mesh).items():
        out.append(run_case(f"clip {name}", clip_case, f"clip {name}", mesh, groups, layout))
        out.append(run_case(f"shapes {name}", shapes_case, f"shapes {name}", mesh, groups, layout))
        out.append(run_case(f"accumulate {name}", accumulation_case, f"accumulate {name}", mesh, groups, layout))
        out.append(run_case(f"names {name}", names_case, f"names {name}", mesh, groups, layout))
    out.append(run_case("eval gpt", eval_case, "eval gpt", mesh, groups))
    out.append(run_case("eval transformers", eval_case, "eval transformers", mesh, groups, hf=True))
    out.append(run_case("batchnorm", batchnorm_case, "batchnorm", mesh, groups))
    out.append(run_case("batchnorm ema", batchnorm_case, "batchnorm ema", mesh, groups, ema=True))
    if mesh.ndim == 1:  # data parallel around the ops that only run whole
        dp = autopar.Layout(dp=mesh.size)
        out.append(run_case("batchnorm dp", batchnorm_case, "batchnorm dp", mesh, groups, dp))
        out.append(run_case("batchnorm ema dp", batchnorm_case, "batchnorm ema dp", mesh, groups, dp, ema=True))
        for family in CONV_FAMILIES:  # each way a convolution splits, with batch norm between
            out.append(run_case(f"batchnorm conv {family}", batchnorm_case, f"batchnorm conv {family}", mesh, groups,
                                _conv_force(family)))
    return out


# the batch, the output channels (weight rows, bias), the input channels (a pending sum out)
CONV_FAMILIES = ("dp", "1d-col", "1d-row")


def _conv_force(family: str) -> dict:
    """ConvNet's convolutions forced to ``family`` (the input-channel split only on the second:
    the first reads 3 channels)."""
    model = ConvNet()
    graph = ir.trace(model, (torch.randn(8, 3, 6, 6), torch.randint(0, 5, (8,))))
    convs = [n.name for n in graph if n.target == "aten.conv2d.default"]
    return {name: family for name in (convs[1:] if family == "1d-row" else convs)}


def rank_2(rank, world_size):
    warnings.simplefilter("ignore")
    mesh = autopar.Mesh((2,), cluster="cpu-gloo")
    groups = MeshGroups(mesh)
    out = _cases(mesh, groups)
    dp = autopar.Layout(dp=2)
    out.append(run_case("clip torch dp", clip_case, "clip torch dp", mesh, groups, dp, use_torch=True))
    out.append(run_case("clip inf tp", clip_case, "clip inf tp", mesh, groups, autopar.Layout(tp=2), norm_type=math.inf))
    out.append(run_case("clip transformers", clip_case, "clip transformers", mesh, groups, None, hf=True, use_torch=True))
    out.append(run_case("clip errors", clip_errors_case, "clip errors", mesh, groups))
    out.append(run_case("call values", call_values_case, "call values", mesh, groups))
    out.append(run_case("train_step dp", train_step_case, "train_step dp", mesh, groups, dp))
    return out


def rank_4(rank, world_size):
    warnings.simplefilter("ignore")
    out = []
    for shape in ((4,), (2, 2)):
        mesh = autopar.Mesh(shape, cluster="cpu-gloo")
        groups = MeshGroups(mesh)
        out += [dict(c, tag=f"{c['tag']} {shape}") for c in _cases(mesh, groups)]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_by_tag(tmp_path_factory, [(rank_2, 2), (rank_4, 4)], timeout_s=900)


def _tags(results, prefix):
    tags = [t for t in results if t.startswith(prefix)]
    assert tags, f"no case starts with {prefix!r}"
    return tags


def _ok(case):
    assert "error" not in case, case["error"]


def test_clipping_is_exact_and_every_rank_gets_the_global_norm(results):
    for tag in _tags(results, "clip"):
        if tag.startswith("clip errors"):
            continue
        per_rank = results[tag]
        for c in per_rank:
            _ok(c)
            for got, want in c["norms"]:
                assert abs(got - want) <= TOL * want, (tag, c["norms"])
                assert want > MAX_NORM  # the clip bites
            assert c["grad_err"] <= 1e-4 and c["state_err"] <= STATE_TOL, (tag, c["grad_err"], c["state_err"])
        assert len({tuple(c["norms"]) for c in per_rank}) == 1, f"{tag}: ranks got different norms"


def test_clipping_errors_behave_like_torch(results):
    for c in results["clip errors"]:
        _ok(c)
        assert c["nonfinite"] and "non-finite" in c["nonfinite"]
        assert c["inf_norm"] == math.inf
        assert c["zero_norm"][0] == c["zero_norm"][1]  # torch: how many gradients are nonzero
        assert c["nan_inf"] and "non-finite" in c["nan_inf"]
        assert c["mixed"] and "mixed" in c["mixed"]
        # a model whose code does not depend on the mode runs eval on its main program
        assert c["mode_free_programs"] == 0 and c["mode_free_eval_err"] <= TOL


def test_non_tensor_arguments_and_a_wrapping_module(results):
    for c in results["call values"]:
        _ok(c)
        assert c["same_value"] <= TOL and c["other_value"] <= TOL and c["programs"] == 1, c
        assert c["outer_keys"] and c["outer_load_err"] == 0.0, c
        assert c["outer_strict"] and "lin.bias" in c["outer_strict"]


def test_eval_mode_equals_the_original_eval_and_is_deterministic(results):
    for tag in _tags(results, "eval"):
        for c in results[tag]:
            _ok(c)
            assert c["eval_err"] <= TOL and c["repeat_err"] == 0.0 and c["inference_err"] <= TOL, c
            assert c["train_differs"], f"{tag}: train() after eval() must turn dropout back on"
            assert c["programs"] == [False], f"{tag}: one eval program, the train program is the main one"


def test_batch_norm_and_in_place_buffers_stay_exact(results):
    for tag in _tags(results, "batchnorm"):
        for c in results[tag]:
            _ok(c)
            assert c["running_var_moved"]
            assert c["loss_err"] <= TOL and c["state_err"] <= STATE_TOL and c["eval_err"] <= TOL, c
    for family in CONV_FAMILIES:
        (c, *_) = results[f"batchnorm conv {family}"]
        assert c["families"].get(family) == (1 if family == "1d-row" else 2), c["families"]


def test_other_batch_shapes_train_exactly(results):
    for tag in _tags(results, "shapes"):
        for c in results[tag]:
            _ok(c)
            assert c["loss_err"] <= TOL and c["state_err"] <= STATE_TOL, c
            assert c["programs"] == 2, f"{tag}: two new shapes, each built once"


def test_accumulation_equals_one_big_step_and_syncs_once(results):
    for tag in _tags(results, "accumulate"):
        for c in results[tag]:
            _ok(c)
            assert c["state_err"] <= STATE_TOL, c
            assert c["launches"] == [c["buckets"]] * 2, c
            assert c["programs"] == 0


def test_names_parameter_groups_and_state_dict(results):
    for tag in _tags(results, "names"):
        for c in results[tag]:
            _ok(c)
            assert c["names_equal"] and c["buffers_equal"] and c["keys_equal"] and c["all_dtensor"], c
            assert c["groups_state_err"] <= STATE_TOL and c["full_err"] <= STATE_TOL, c
            assert c["moved"]
            assert c["dtensor_roundtrip_err"] <= STATE_TOL and c["full_roundtrip_err"] <= STATE_TOL, c
            assert c["cross_plan_err"] <= STATE_TOL, c
            assert c["strict"] and "missing keys" in c["strict"] and "ln_f" in c["strict"]
            assert c["missing"] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]


def test_train_step_leaves_unread_outputs_sharded(results):
    (case,) = results["train_step dp"][:1]
    _ok(case)
    assert case["loss_err"] <= TOL and case["grad_err"] <= TOL and case["state_err"] <= STATE_TOL, case
    assert case["logits_err"] <= TOL and not case["lp_requires_grad"]
    # data parallel: neither program gathers the logits (a call returns them split: runtime.outputs)
    assert case["gathers"] == (0, 0) and case["logits_split"], case["gathers"]
    # the loss's closing sum over the data-parallel axis is train_step's (started before backward)
    assert case["loss_sum_axes"] == (0,) and case["sums"][1] == case["sums"][0] - 1, case

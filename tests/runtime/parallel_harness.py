"""Inside a rank: run a parallelized model next to the single-process original and measure how far
apart they are (forward output, every parameter's gradient, losses over AdamW steps, the final
unsharded state). Every number is a relative error, max|a - b| / max|b|."""
from __future__ import annotations

import copy
import time
import traceback
import warnings

import torch

import autopar
from autopar import models

TOL = 1e-5
# A difference this many times the reference's own rounding error (its float32 run against the same
# step in float64) is rounding, whatever its size relative to the value: a gradient that is zero in
# exact arithmetic (a separate key-projection bias: softmax ignores a per-row constant) is pure
# rounding noise in every float32 run, one process or many.
NOISE_FACTOR = 10.0
# AdamW's epsilon in these comparisons. With the default 1e-8, an entry whose gradient is zero in
# exact arithmetic (attention key biases: softmax ignores a per-row constant) but rounding noise in
# practice gets a step of about lr in a random direction (m / sqrt(v) of noise is ~1), so the two
# runs' parameters would differ by ~lr there. With 1e-3 such noise moves nothing while real
# gradients still take Adam-sized steps, so trained parameters can be compared at TOL.
ADAM_EPS = 1e-3
TRAINED_STATE_TOL = TOL


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def fresh_inputs(inputs, step: int):
    """Inputs shaped like ``inputs``, different per step (integers within the original range)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for t in inputs:
        if t.is_floating_point():
            out.append(torch.randn(t.shape, generator=g, dtype=t.dtype))
        else:
            out.append(torch.randint(0, int(t.max()) + 1, t.shape, generator=g, dtype=t.dtype))
    return tuple(out)


def loss_of(out):
    return out.loss if hasattr(out, "loss") else (out[0] if isinstance(out, tuple) else out)


def compare(model, inputs, mesh, groups, *, steps: int = 5, lr: float = 1e-2, kwargs_fn=None, **parallelize_kw) -> dict:
    """Parallelize ``model`` and train it next to a copy for ``steps`` AdamW steps. ``kwargs_fn(inputs)``
    turns positional inputs into the call's keyword arguments (for models called by keyword)."""
    warnings.simplefilter("ignore")
    ref = copy.deepcopy(model)
    initial = copy.deepcopy(model)  # to replay the steps in float64 where a check needs the exact run
    # Use every mesh axis unless a case asks otherwise: small test models would otherwise run
    # redundantly on idle axes and exercise no collectives.
    parallelize_kw.setdefault("idle_axes", ())
    # One stage, called as a module (pipelined plans train through train_step: test_pipeline_runtime).
    parallelize_kw.setdefault("pipeline", False)
    if kwargs_fn is None:
        pm = autopar.parallelize(model, mesh, inputs, groups=groups, **parallelize_kw)
    else:
        pm = autopar.parallelize(model, mesh, (), example_kwargs=kwargs_fn(inputs), groups=groups, **parallelize_kw)
    res0 = _state_err(pm, ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, eps=ADAM_EPS)
    opt_par = torch.optim.AdamW(pm.parameters(), lr=lr, eps=ADAM_EPS)
    res = {"losses": [], "out_err": 0.0, "grad_err": {}, "code": pm.code, "plan": pm.plan,
           "init_state_err": res0[0], "state_keys_equal": res0[1]}

    def call(m, x):
        return m(**kwargs_fn(x)) if kwargs_fn is not None else m(*x)

    batches = []
    for step in range(steps):
        x = inputs if step == 0 else fresh_inputs(inputs, step)
        batches.append(x)
        out_ref, out_par = call(ref, x), call(pm, x)
        if step == 0:
            res["type"] = (type(out_ref).__name__, type(out_par).__name__)
            leaves_r = [t for t in torch.utils._pytree.tree_leaves(out_ref) if isinstance(t, torch.Tensor)]
            leaves_p = [t for t in torch.utils._pytree.tree_leaves(out_par) if isinstance(t, torch.Tensor)]
            res["out_err"] = max([rel(a, b) for a, b in zip(leaves_p, leaves_r)] + [0.0 if len(leaves_p) == len(leaves_r) else float("inf")])
        l_ref, l_par = loss_of(out_ref), loss_of(out_par)
        res["losses"].append((l_par.item(), l_ref.item()))
        l_ref.backward()
        l_par.backward()
        errs = grad_errors(pm, ref, exact=lambda: exact_grads(ref, lambda m: loss_of(call(m, to_double(x)))))
        for fqn, err in errs.items():  # every step's gradients
            res["grad_err"][fqn] = max(err, res["grad_err"].get(fqn, 0.0))
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
    res["state_err"] = _state_err(pm, ref, lambda: exact_training(initial, batches, lambda m, x: loss_of(call(m, x)), lr))[0]
    res["loss_err"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in res["losses"])
    return res


def _state_err(pm, ref, exact=None) -> tuple[float, bool]:
    """(the largest relative error of the full state against ``ref``'s, whether the keys agree).
    Where an entry is over TRAINED_STATE_TOL and ``exact()`` gives the state the same steps reach in
    float64, that entry is measured against the reference's own rounding error (``within_noise``):
    Adam turns the noise of a gradient that is zero in exact arithmetic into full-size steps."""
    full, want = pm.full_state_dict(), ref.state_dict()
    errs = {k: rel(full[k], want[k]) for k in want if k in full}
    noisy = [k for k, e in errs.items() if not e <= TRAINED_STATE_TOL and full[k].shape == want[k].shape]
    if noisy and exact is not None:
        truth = exact()
        errs.update({k: within_noise(full[k], want[k], truth[k], TRAINED_STATE_TOL) for k in noisy})
    return max(errs.values(), default=0.0), set(full) == set(want)


def exact_training(initial, batches, loss_fn, lr: float, clip: float | None = None) -> dict:
    """The state ``initial`` reaches in float64 after an AdamW step on each batch (as ``compare``;
    ``clip``: the gradients clipped to that norm first, as a loop that clips does)."""
    m64 = copy.deepcopy(initial).double()
    opt = torch.optim.AdamW(m64.parameters(), lr=lr, eps=ADAM_EPS)
    for x in batches:
        loss_fn(m64, to_double(x)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m64.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return m64.state_dict()


def grad_errors(pm, ref, exact=None) -> dict:
    """Parameter -> its gradient's error against ``ref``'s: relative (``rel``), or, where that is
    over TOL and ``exact()`` gives the float64 gradients of the same step, measured against the
    reference's own rounding error (``within_noise``)."""
    out, noisy = {}, []
    for fqn, full in pm.full_grads().items():
        if not ref.get_parameter(fqn).requires_grad:
            continue
        want = ref.get_parameter(fqn).grad
        if full is None or want is None:
            out[fqn] = 0.0 if full is None and want is None else float("inf")
            continue
        out[fqn] = rel(full, want)
        if not out[fqn] <= TOL:
            noisy.append((fqn, full, want))
    if noisy and exact is not None:
        grads64 = exact()
        for fqn, full, want in noisy:
            out[fqn] = within_noise(full, want, grads64[fqn], TOL)
    return out


def within_noise(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor, tol: float) -> float:
    """max|got - want| relative to max|want|, or to NOISE_FACTOR / ``tol`` times the reference's
    own error ``max|want - truth|`` where that is larger: at most ``tol`` when ``got`` is within
    ``tol`` of ``want`` or within NOISE_FACTOR times ``want``'s distance from exact arithmetic."""
    diff = (got.detach().double() - want.detach().double()).abs().max().item()
    noise = (want.detach().double() - truth.detach().double()).abs().max().item()
    scale = max(want.detach().abs().max().item(), NOISE_FACTOR * noise / tol, 1e-30)
    return diff / scale


def to_double(tree):
    return torch.utils._pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def exact_grads(model, loss_fn) -> dict:
    """Parameter -> its gradient in float64 (a copy of ``model`` at its current values)."""
    m64 = copy.deepcopy(model).double()
    m64.zero_grad(set_to_none=True)
    loss_fn(m64).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in m64.named_parameters()}


def worst(res: dict) -> float:
    """The largest error that must be within TOL (the trained state has its own tolerance)."""
    return max([res["out_err"], res["loss_err"], res["init_state_err"], *res["grad_err"].values()])


def summary(tag: str, res: dict) -> dict:
    """What goes back to the test process (small and picklable)."""
    return {
        "tag": tag,
        "worst": worst(res),
        "out_err": res["out_err"],
        "loss_err": res["loss_err"],
        "state_err": res["state_err"],
        "init_state_err": res["init_state_err"],
        "state_keys_equal": res["state_keys_equal"],
        "bad_grads": {k: v for k, v in res["grad_err"].items() if not v <= TOL},
        "n_grads": len(res["grad_err"]),
        "type": res.get("type"),
        "families": res["plan"].summary()["families"],
        "plan_cluster": (res["plan"].mesh.get("cluster") or {}).get("name"),
        "storage": {p.name: (str(p.storage), p.family) for p in res["plan"].params.values()},
        "grad_syncs": sorted({p.grad_sync.name for p in res["plan"].params.values() if p.grad_sync}),
        "code": res["code"],
    }


def run_case(tag: str, fn, *args, **kw) -> dict:
    """``fn(*args, **kw)`` -> summary, or the error's traceback (so one case cannot hide others)."""
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kw)
    except Exception:
        out = {"tag": tag, "error": traceback.format_exc()}
    out["seconds"] = time.perf_counter() - t0
    return out


def model_case(tag, name, mesh, groups, build_kw=None, **kw) -> dict:
    def go():
        model, inputs = models.build(name, **(build_kw or {}))
        return summary(tag, compare(model, inputs, mesh, groups, **kw))

    return run_case(tag, go)


def spawn_by_tag(tmp_path_factory, runs, timeout_s: float) -> dict[str, list[dict]]:
    """In the test process: run each ``(rank_fn, world_size)`` of ``runs`` on spawned ranks that share
    a fresh AUTOPAR_CACHE_DIR (they inherit the environment), and group every rank's cases by tag."""
    import pytest

    from autopar.runtime.launch import spawn

    by_tag: dict[str, list[dict]] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        for fn, n in runs:
            for rank_out in spawn(fn, n, timeout_s=timeout_s):
                for case in rank_out:
                    by_tag.setdefault(case["tag"], []).append(case)
    return by_tag

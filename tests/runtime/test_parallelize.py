"""autopar.parallelize on real gloo groups: the built-in models and transformers' GPT2LMHeadModel
and LlamaForCausalLM (tied and untied embeddings) on meshes (2,), (4,), (2, 2) and (2, 2, 2) compute
what the single-process model computes: forward output, loss, every parameter's gradient (gathered
to full through the plan's storage specs) within 1e-5 relative, three AdamW steps tracking the
single-process losses, and the same final state.

Hand-forced plans cover each matmul family (1D column, 1D row, 2D, 2.5D, 3D), data parallel and
ZeRO-3 storage. One spawn per world size runs every case inside it; the meshes carry the cpu-gloo
cluster so plans do not depend on timings, except in the case that checks live profiling. Two more
spawns check that a rank failing or stuck mid-step makes every rank stop with an error."""
from __future__ import annotations

import copy
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import ir, models
from autopar.errors import AutoparError, ConfigError, RankError
from autopar.runtime.launch import spawn
from autopar.runtime.process_groups import MeshGroups
from parallel_harness import TOL, TRAINED_STATE_TOL, compare, model_case, rel, run_case, summary

pytestmark = pytest.mark.multirank

SMALL = {"mlp": {}, "gpt": {"layers": 2}, "llama": {"layers": 2}}


class TinyLM(nn.Module):
    """A table lookup with a padding row, a head, and cross entropy with ignored targets, an
    optional class-weight buffer and label smoothing: the lowered loss and embedding families."""

    def __init__(self, vocab=16, width=8, weighted=False, smoothing=0.0, shift=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=3)
        self.head = nn.Linear(width, vocab)
        self.smoothing, self.shift = smoothing, shift
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, vocab) if weighted else None)

    def forward(self, idx, targets):
        logits = self.head(torch.tanh(self.emb(idx)))  # (B, T, V)
        if self.shift:  # each position predicts the next target, as causal LMs shift their labels
            logits, targets = logits[:, :-1], targets[:, 1:]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=self.class_weight,
                               ignore_index=-100, label_smoothing=self.smoothing)


def tiny_lm_case(tag, mesh, groups, force, **kw):
    def go():
        torch.manual_seed(0)
        model = TinyLM(**kw)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 16, (4, 6), generator=g)
        targets = torch.randint(0, 16, (4, 6), generator=g)
        targets[0, :3] = -100
        targets[3, 5] = -100
        idx[1, 2] = 3  # the padding row
        res = compare(model, (idx, targets), mesh, groups, force=force)
        return summary(tag, res)

    return run_case(tag, go)


# ---- cases (run inside ranks) ---------------------------------------------------------------------
def matmul_force(model, inputs, family: str, *, params: str | None = None) -> dict:
    """Every linear of ``model`` forced to ``family`` (and every parameter's storage to ``params``)."""
    graph = ir.trace(model, inputs)
    force = {n.name: family for n in graph if n.target == "aten.linear.default"}
    if params is not None:
        force.update({ph: params for ph in graph.params.values()})
    return force


def zoo_case(tag, factory: str, mesh, groups, layout, *, float64: bool = False, **build):
    """A model of tests/models_zoo.py under a hand-style layout, given as a ``PlanConfig`` (as a
    user sharing one config between jobs passes it; ``float64``: model and float inputs in
    float64)."""
    def go():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import models_zoo

        model, inputs = getattr(models_zoo, factory)(**build)
        if float64:
            model, inputs = model.double(), tuple(t.double() if t.is_floating_point() else t for t in inputs)
        config = autopar.PlanConfig(force=layout, idle_axes=(), pipeline=False)
        return summary(tag, compare(model, inputs, mesh, groups, config=config))

    return run_case(tag, go)


def vit_case(tag, mesh, groups, layout):
    """The hand-written ViT (tests/models_zoo.py: class token, patch convolution,
    nn.MultiheadAttention running time-first inside) under a hand-style layout, in float64: in
    float32 five AdamW steps grew rounding in a layer-norm weight's gradient (a sum that cancels)
    to 2e-5 of its largest entry under dp2 x tp2 (6.6e-7 at the first step; 1e-14 in float64)."""
    return zoo_case(tag, "vit", mesh, groups, layout, float64=True, batch=8, image=8, dim=32, depth=2)


def ulysses_hybrid_case(tag, mesh, groups):
    """The block layout the planner picks for GPT-3's stages on (nodes, 8): batch on axis 0; on axis
    1 the attention's tokens (its linears' weights whole, heads split inside attention, so
    all-to-alls around it) and the MLP Megatron-style (column then row, the batch split kept)."""
    def go():
        model, inputs = models.build("gpt", layers=2, seq=8, batch=4)
        graph = ir.trace(model, inputs)
        force = {}
        for n in graph:
            if n.layer is None or n.op != "call_function":
                continue
            if n.target == "aten.scaled_dot_product_attention.default":
                force[n.name] = "dp+heads"
            elif n.target == "aten.linear.default":
                force[n.name] = ("dp+sp" if ".attn." in n.module_path else
                                 "2d" if n.module_path.endswith("c_fc") else "2d-mk")
        return summary(tag, compare(model, inputs, mesh, groups, force=force))

    return run_case(tag, go)


def low_precision_case(tag, name, mesh, groups, layout=None, autocast: bool = False):
    """A bfloat16 model, or (``autocast``) a float32 one run under ``torch.autocast`` to bfloat16:
    its gradients cannot match one device's to 1e-5, since splitting a sum rounds it differently.
    The bar: each parameter's gradient is no further from the float32 model's than about twice as
    far as one device's low-precision gradient is (plus two bf16 ulps), so parallelizing adds no
    more error than bfloat16 itself; a lost or doubled sum is off by O(1)."""
    def go():
        model, inputs = models.build(name, layers=2, dtype=torch.float32 if autocast else torch.bfloat16)
        one, fp32 = copy.deepcopy(model), copy.deepcopy(model).float()
        pm = autopar.parallelize(model, mesh, inputs, groups=groups, idle_axes=(), pipeline=False,
                                 **({} if layout is None else {"force": layout}))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss_par, loss_one = pm(*inputs), one(*inputs)
        loss_32 = fp32(*inputs)
        for loss in (loss_par, loss_one, loss_32):
            loss.backward()
        errs = {}
        for fqn, g in pm.full_grads().items():
            truth = fp32.get_parameter(fqn).grad
            errs[fqn] = (rel(g.float(), truth), rel(one.get_parameter(fqn).grad.float(), truth))
        return {"tag": tag, "errs": errs, "losses": (float(loss_par), float(loss_one), float(loss_32)),
                "loss_dtypes": (str(loss_par.dtype), str(loss_one.dtype)),
                "dtypes": {str(g.dtype) for g in pm.full_grads().values()},
                "families": pm.plan.summary()["families"]}

    return run_case(tag, go)


def forced_case(tag, mesh, groups, family, *, params=None, build_kw=None):
    def go():
        model, inputs = models.build("mlp", **(build_kw or {}))
        res = compare(model, inputs, mesh, groups, force=matmul_force(model, inputs, family, params=params))
        return summary(tag, res)

    return run_case(tag, go)


class MeanLossMLP(nn.Module):
    """A hand-written mean-squared loss: `mean` over a batch-split tensor is the lowered family
    "reduce-partial(mean)" (local sum / global count)."""

    def __init__(self, d=16):
        super().__init__()
        self.fc1 = nn.Linear(d, 32)
        self.fc2 = nn.Linear(32, d)

    def forward(self, x, y):
        return ((self.fc2(torch.relu(self.fc1(x))) - y) ** 2).mean()


def mean_loss_case(tag, mesh, groups):
    def go():
        torch.manual_seed(0)
        model = MeanLossMLP()
        g = torch.Generator().manual_seed(2)
        inputs = (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))
        force = matmul_force(model, inputs, "dp")
        force.update({n.name: "reduce-partial(mean)" for n in ir.trace(model, inputs) if n.target == "aten.mean.default"})
        return summary(tag, compare(model, inputs, mesh, groups, force=force))

    return run_case(tag, go)


HF_VOCAB = 64


def hf_model(arch: str):
    """A small transformers causal LM: "gpt2" (tied embeddings), "llama" or "llama-tied"."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=HF_VOCAB, bos_token_id=0, eos_token_id=0, use_cache=False)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, max_position_embeddings=16,
                                   tie_word_embeddings=arch == "llama-tied", **common)
    return transformers.LlamaForCausalLM(cfg)


def hf_case(tag, mesh, groups, arch="gpt2"):
    def go():
        model = hf_model(arch)
        g = torch.Generator().manual_seed(0)
        ids, labels = (torch.randint(0, HF_VOCAB, (4, 16), generator=g) for _ in range(2))
        res = compare(model, (ids, labels), mesh, groups,
                      kwargs_fn=lambda x: {"input_ids": x[0], "labels": x[1], "use_cache": False})
        out = summary(tag, res)
        out["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        out["n_params"] = len(list(model.parameters()))  # a tied weight once
        return out

    return run_case(tag, go)


HF_ARCHS = ("gpt2", "llama", "llama-tied")


def profile_case(groups):
    """A mesh without a cluster: parallelize prices the plan with a short profile of the live
    groups, cached (in the test's AUTOPAR_CACHE_DIR), and runs it exactly; ``profile=False`` prices
    with cpu-gloo."""
    from autopar.compose.live_profile import cached_live_op_table, live_cluster

    mesh = autopar.Mesh(groups.mesh.shape)
    t0 = time.perf_counter()
    cluster = live_cluster(mesh, groups)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = live_cluster(mesh, groups)
    cached_s = time.perf_counter() - t0
    model, inputs = models.build("mlp")
    res = summary("profiled", compare(model, inputs, mesh, groups))
    model, inputs = models.build("mlp")
    preset = autopar.parallelize(model, mesh, inputs, groups=groups, profile=False, pipeline=False).plan
    ops = cached_live_op_table("cpu", cluster.rank_contention)
    return {"tag": "profile", "first_s": first_s, "cached_s": cached_s, "same": cluster == again,
            "name": cluster.name, "links": len(cluster.axis_links or ()),
            "overheads": [cluster.op_overhead_s, cluster.backward_op_overhead_s, cluster.optimizer_s_per_element,
                          cluster.optimizer_s_per_tensor],
            "overlap": cluster.comm_overlap, "op_keys": len(ops), "op_table": ops.device,
            "plan_cluster": res["plan_cluster"], "preset_cluster": (preset.mesh.get("cluster") or {}).get("name"),
            "train": res}


def idle_case(tag, mesh, groups, idle_axes):
    """Idle mesh axes: every rank along them computes the same thing, seeds its own backward and
    needs no gradient sync there; the result is still exact."""
    def go():
        model, inputs = models.build("mlp")
        force = {} if idle_axes == "auto" else matmul_force(model, inputs, "1d-col")
        res = compare(model, inputs, mesh, groups, force=force, idle_axes=idle_axes)
        out = summary(tag, res)
        out["idle_axes"] = tuple(res["plan"].idle_axes)
        out["grad_sync_axes"] = sorted({a for p in res["plan"].params.values() if p.grad_sync for a in p.grad_sync.axes})
        return out

    return run_case(tag, go)


def shape_error_case(mesh, groups):
    """Another batch size than traced runs exactly on a program of its own (built once, then
    reused); a call of another structure is a clear autopar error; a keyword call binds like the
    original signature."""
    model, inputs = models.build("mlp", batch=4)
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh, inputs, groups=groups, max_programs=1, pipeline=False)
    same = torch.equal(pm(inputs[0], targets=inputs[1]), pm(*inputs))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    other = rel(pm(*x), ref(*x))
    again = rel(pm(*x), ref(*x))
    n_programs = len(pm.programs)
    x3 = torch.randn(3, 32), torch.randn(3, 32)
    try:
        pm(*x3)  # a second program: over max_programs=1
        bound = None
    except AutoparError as err:
        bound = str(err)
    try:
        pm(inputs[0], inputs[1], inputs[1])
        message = None
    except AutoparError as err:
        message = str(err)
    return {"tag": "shape-error", "message": message, "keyword_call_same": same, "other_shape_error": other,
            "again_error": again, "programs": n_programs, "bound": bound}


def meta_init_case(mesh, groups):
    """A meta-device MLP, materialized shard by shard with ZeRO-3 storage: each rank holds 1/n of
    every parameter, and the shards equal slices of the same init run on a real model."""
    model, meta_inputs = models.build("mlp", device="meta")
    force = {ph: "sharded" for ph in ir.trace(model, meta_inputs).params.values()}
    torch.manual_seed(7)
    pm = autopar.parallelize(model, mesh, meta_inputs, groups=groups, force=force, device="cpu", pipeline=False)
    torch.manual_seed(7)
    real, inputs = models.build("mlp")  # its own seed, in a forked RNG: the global one stays at 7
    with torch.no_grad():  # Module.apply visits children first, as materialization does
        real.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    n = mesh.size
    local = {k: v for k, v in pm.local_state().items()}
    numel_ok = all(v.numel() * n == real.get_parameter(k).numel() for k, v in local.items())
    rank = groups.rank
    value_err = max(
        (v - real.get_parameter(k).detach()[pm.storage_spec(k).local_slices(mesh, rank)]).abs().max().item()
        for k, v in local.items()
    )
    still_meta = all(p.is_meta for p in model.parameters())
    # And it trains exactly like the real model.
    res = compare(real, inputs, mesh, groups, force=force)
    return {"tag": "meta-init", "numel_ok": numel_ok, "value_err": value_err, "still_meta": still_meta,
            "local_numel": sum(v.numel() for v in local.values()), "global_numel": sum(p.numel() for p in real.parameters()),
            "train": summary("meta-init-train", res)}


# ---- rank functions ---------------------------------------------------------------------------------
def rank_2(rank, world_size):
    warnings.simplefilter("ignore")
    mesh = autopar.Mesh((2,), cluster="cpu-gloo")
    groups = MeshGroups(mesh)
    out = [model_case(f"{name} (2,)", name, mesh, groups, kw) for name, kw in SMALL.items()]
    out.append(model_case("mlp batch 3 (2,)", "mlp", mesh, groups, {"batch": 3}))
    out.append(model_case("gpt batch 3 (2,)", "gpt", mesh, groups, {"layers": 1, "batch": 3}))
    out += [hf_case(f"transformers {arch} (2,)", mesh, groups, arch) for arch in HF_ARCHS]
    for family in ("1d-col", "1d-row", "dp"):
        out.append(forced_case(f"forced {family} (2,)", mesh, groups, family))
    out.append(forced_case("forced zero3 (2,)", mesh, groups, "dp", params="sharded"))
    out.append(tiny_lm_case("vocab-parallel lm (2,)", mesh, groups,
                            {"embedding": "embedding-vocab-parallel", "cross_entropy_loss": "loss-vocab-parallel"}))
    out.append(tiny_lm_case("batch-split mean lm (2,)", mesh, groups,
                            {"cross_entropy_loss": "loss-batch-split(mean)"}, weighted=True, smoothing=0.1))
    out.append(tiny_lm_case("batch-split mean lm counted (2,)", mesh, groups,
                            {"cross_entropy_loss": "loss-batch-split(mean)"}, shift=True))
    out.append(mean_loss_case("mean-partial dp (2,)", mesh, groups))
    out.append(run_case("shape-error", shape_error_case, mesh, groups))
    out.append(run_case("meta-init", meta_init_case, mesh, groups))
    for name in ("gpt", "llama"):
        out += [low_precision_case(f"bf16 {name} {tag} (2,)", name, mesh, groups, layout)
                for tag, layout in BF16_LAYOUTS.items()]
    out.append(vit_case("vit dp (2,)", mesh, groups, autopar.Layout(dp=2)))
    for tag, layout in AUTOCAST_LAYOUTS.items():
        out.append(low_precision_case(f"autocast gpt {tag} (2,)", "gpt", mesh, groups, layout, autocast=True))
    return out


BF16_LAYOUTS = {"auto": None, "dp": autopar.Layout(dp=2), "tp": autopar.Layout(tp=2), "zero3": autopar.Layout(dp=2, zero=3)}
# under autocast the losses autopar lowers itself (fused batch-split, vocabulary-parallel) must run
# in float32 as autocast runs cross_entropy
AUTOCAST_LAYOUTS = {"auto": None, "zero2": autopar.Layout(dp=2, zero=2), "vocab-parallel": autopar.Layout(tp=2, vocab_parallel=True)}

# hand-style layouts (autopar.Layout) per 4-rank mesh: each must run exactly
LAYOUTS = {
    (4,): [autopar.Layout(dp=4, zero=3), autopar.Layout(tp=4, vocab_parallel=False)],
    (2, 2): [autopar.Layout(dp=2, tp=2, zero=2), autopar.Layout(dp=2, tp=2, zero=3, vocab_parallel=True)],
}


def rank_4(rank, world_size):
    warnings.simplefilter("ignore")
    out = []
    for shape in ((4,), (2, 2)):
        mesh = autopar.Mesh(shape, cluster="cpu-gloo")
        groups = MeshGroups(mesh)
        out += [model_case(f"{name} {shape}", name, mesh, groups, kw) for name, kw in SMALL.items()]
        out += [hf_case(f"transformers {arch} {shape}", mesh, groups, arch) for arch in HF_ARCHS]
        out += [model_case(f"layout {layout.name} {shape}", "gpt", mesh, groups, {"layers": 2}, force=layout)
                for layout in LAYOUTS[shape]]
    out.append(forced_case("forced 2d (2, 2)", mesh, groups, "2d"))
    out.append(ulysses_hybrid_case("ulysses hybrid gpt (2, 2)", mesh, groups))
    out.append(vit_case("vit dp2 x tp2 (2, 2)", mesh, groups, autopar.Layout(dp=2, tp=2)))
    # a top-2 mixture of experts (dense dispatch): router softmax, topk, one_hot, an auxiliary loss
    out.append(zoo_case("moe dp2 x tp2 (2, 2)", "moe", mesh, groups, autopar.Layout(dp=2, tp=2), batch=8))
    out.append(zoo_case("mingpt dp2 x tp2 (2, 2)", "mingpt", mesh, groups, autopar.Layout(dp=2, tp=2)))
    mesh4 = autopar.Mesh((4,), cluster="cpu-gloo")
    out.append(zoo_case("moe dp4 (4,)", "moe", mesh4, MeshGroups(mesh4), autopar.Layout(dp=4), batch=8))
    out.append(idle_case("idle axis 0 (2, 2)", mesh, groups, (0,)))
    out.append(idle_case("idle auto (2, 2)", mesh, groups, "auto"))
    out.append(run_case("profile", profile_case, groups))
    out.append({"tag": "timeouts", "groups": groups.timeout.total_seconds(),
                "axes": [_pg_timeout(groups.group(axes)) for axes in ((0,), (1,), (0, 1))]})
    return out


def _pg_timeout(pg) -> float:
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def rank_8(rank, world_size):
    warnings.simplefilter("ignore")
    mesh = autopar.Mesh((2, 2, 2), cluster="cpu-gloo")
    groups = MeshGroups(mesh)
    out = [forced_case(f"forced {fam} (2, 2, 2)", mesh, groups, fam) for fam in ("2.5d", "3d")]
    # an uneven 2-D mesh: 4-way inside, 2-way across
    mesh = autopar.Mesh((2, 4), cluster="cpu-gloo")
    groups = MeshGroups(mesh)
    out.append(model_case("gpt auto (2, 4)", "gpt", mesh, groups, {"layers": 2, "heads": 4, "batch": 8}))
    out.append(model_case("gpt dp2 x tp4 (2, 4)", "gpt", mesh, groups, {"layers": 2, "heads": 4, "batch": 8},
                          force=autopar.Layout(dp=2, tp=4, zero=2)))
    return out


MID_STEP_TIMEOUT_S = 8.0


def fail_mid_step(rank, world_size, mode):
    """Every rank trains one step; in the second, rank 1 raises (or, ``mode="hang"``, sleeps)
    after forward, while the others enter backward's collectives with it."""
    warnings.simplefilter("ignore")
    # Data parallel, forced: every rank's gradient all-reduce needs rank 1 (left to itself the
    # planner may replicate so small an MLP and communicate nothing).
    mesh = autopar.Mesh((world_size,), cluster="cpu-gloo")
    model, inputs = models.build("mlp")
    pm = autopar.parallelize(model, mesh, inputs, timeout=MID_STEP_TIMEOUT_S, force=autopar.Layout(dp=world_size),
                             pipeline=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm(*inputs).backward()
    opt.step()
    opt.zero_grad()
    loss = pm(*inputs)
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("rank 1 fails after forward, before backward")
        time.sleep(3600)  # alive and stuck outside any collective
    loss.backward()  # gradient all-reduces need rank 1
    opt.step()
    return "finished"


# ---- checks in the test process -----------------------------------------------------------------------
def _by_tag(results) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for per_rank in results:
        for case in per_rank:
            out.setdefault(case["tag"], []).append(case)
    return out


def _assert_exact(cases: list[dict]) -> None:
    for c in cases:
        assert "error" not in c, f"{c['tag']} raised:\n{c['error']}"
        assert c["worst"] <= TOL, (
            f"{c['tag']}: out {c['out_err']:.2e}, loss {c['loss_err']:.2e}, state {c['init_state_err']:.2e}, "
            f"grads {c['bad_grads']}; families {c['families']}"
        )
        assert c["state_err"] <= TRAINED_STATE_TOL, f"{c['tag']}: trained state differs by {c['state_err']:.2e}"
        assert c["state_keys_equal"], f"{c['tag']}: full_state_dict keys differ from the original's"
        assert c["n_grads"] > 0


FOUR_RANK_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A fresh AUTOPAR_CACHE_DIR for the spawned ranks (they inherit the environment)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("autopar-cache")
        mp.setenv("AUTOPAR_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def two_ranks(cache_dir):
    return _by_tag(spawn(rank_2, 2, timeout_s=400))


@pytest.fixture(scope="module")
def four_ranks(cache_dir):
    return _by_tag(spawn(rank_4, 4, timeout_s=FOUR_RANK_TIMEOUT_S))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_models_on_mesh_2(two_ranks, name):
    _assert_exact(two_ranks[f"{name} (2,)"])


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("shape", ["(4,)", "(2, 2)"])
def test_models_on_4_ranks(four_ranks, name, shape):
    _assert_exact(four_ranks[f"{name} {shape}"])


@pytest.mark.parametrize("shape, layout", [(s, l) for s, ls in LAYOUTS.items() for l in ls], ids=str)
def test_hand_style_layouts_on_4_ranks(four_ranks, shape, layout):
    _assert_exact(four_ranks[f"layout {layout.name} {shape}"])


def test_tensor_parallel_plans_insert_collectives(four_ranks):
    code = four_ranks["gpt (2, 2)"][0]["code"]
    assert "autopar_backward_seed(" in code
    assert any(f"autopar_{k}(" in code for k in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"))
    assert code == four_ranks["gpt (2, 2)"][3]["code"], "the program should be the same text on every rank"


def test_batch_not_divisible_by_the_mesh_is_exact(two_ranks):
    _assert_exact(two_ranks["mlp batch 3 (2,)"])
    _assert_exact(two_ranks["gpt batch 3 (2,)"])


@pytest.mark.parametrize("tag", ["vocab-parallel lm (2,)", "batch-split mean lm (2,)", "batch-split mean lm counted (2,)"])
def test_lowered_loss_and_embedding_families(two_ranks, tag):
    """Vocabulary-parallel embedding (with a padding row) and cross entropy (with ignored targets);
    a batch-split mean cross entropy with class weights (a buffer: the ranks all-reduce their
    counts), label smoothing and ignored targets; one without class weights on shifted targets,
    whose count every rank makes from the whole targets (no all-reduce), the ranks' halves holding
    3 and 1 ignored targets."""
    cases = two_ranks[tag]
    _assert_exact(cases)
    fams = cases[0]["families"]
    if tag.startswith("vocab"):
        assert fams.get("embedding-vocab-parallel") == 1 and fams.get("loss-vocab-parallel") == 1
        assert "autopar_vocab_parallel_cross_entropy(" in cases[0]["code"]
    else:
        assert fams.get("loss-batch-split(mean)") == 1
        assert "autopar_loss_global_mean(" in cases[0]["code"]
        assert ("whole_target = " in cases[0]["code"]) == tag.startswith("batch-split mean lm counted")


def test_other_input_shape_runs_on_a_program_of_its_own(two_ranks):
    for c in two_ranks["shape-error"]:
        assert "error" not in c, c.get("error")
        assert c["other_shape_error"] <= TOL and c["again_error"] <= TOL
        assert c["programs"] == 1
        assert c["bound"] and "max_programs=1" in c["bound"]
        assert c["message"] and "cannot call" in c["message"]
        assert c["keyword_call_same"]


def test_transformers_model_output(two_ranks):
    cases = two_ranks["transformers gpt2 (2,)"]
    _assert_exact(cases)
    assert cases[0]["type"] == ("CausalLMOutputWithCrossAttentions",) * 2


@pytest.mark.parametrize("arch", HF_ARCHS)
@pytest.mark.parametrize("shape", ["(2,)", "(4,)", "(2, 2)"])
def test_transformers_causal_lms(two_ranks, four_ranks, arch, shape):
    """GPT2LMHeadModel (tied), LlamaForCausalLM untied and tied: output, loss, every gradient and
    three AdamW steps exact on every mesh."""
    cases = (two_ranks if shape == "(2,)" else four_ranks)[f"transformers {arch} {shape}"]
    _assert_exact(cases)
    assert cases[0]["tied"] == (arch != "llama")
    assert cases[0]["type"][0] == cases[0]["type"][1] and cases[0]["type"][0].startswith("CausalLMOutput")
    assert cases[0]["n_grads"] == cases[0]["n_params"]  # every parameter's gradient was compared


def test_mesh_groups_inherit_the_default_groups_timeout(four_ranks):
    """new_group's own default (30 min for gloo) would let a stuck collective hang for half an
    hour; MeshGroups gives every group the timeout spawn (init_process_group) set."""
    for c in four_ranks["timeouts"]:
        assert c["groups"] == FOUR_RANK_TIMEOUT_S and c["axes"] == [FOUR_RANK_TIMEOUT_S] * 3


def test_mesh_without_cluster_is_profiled_once(four_ranks, cache_dir):
    for c in four_ranks["profile"]:
        assert "error" not in c, c.get("error")
        assert c["name"] == "cpu-gloo+profiled+live" and c["links"] == 2 and c["same"]
        assert c["first_s"] < 30 and c["cached_s"] < c["first_s"]
        assert c["plan_cluster"] == "cpu-gloo+profiled+live" and c["preset_cluster"] in (None, "cpu-gloo")
        # framework overheads measured with every rank busy; 4 one-thread ranks fill 2 cores
        assert all(0 < v < 1e-3 for v in c["overheads"]), c["overheads"]
        assert c["overlap"] == (0.0 if os.cpu_count() <= 4 else c["overlap"])
        # the planner's candidates were timed at their shard shapes, cached per ranks on the host
        # keyed by the ranks sharing the host and the contention its timings are scaled by
        assert c["op_keys"] > 5 and "-4ranks-c" in c["op_table"]
        _assert_exact([c["train"]])
    assert (cache_dir / "parallelize" / "comm-gloo-2x2.json").is_file()


@pytest.mark.parametrize("family", ["1d-col", "1d-row", "dp"])
def test_forced_matmul_families_on_mesh_2(two_ranks, family):
    cases = two_ranks[f"forced {family} (2,)"]
    _assert_exact(cases)
    assert cases[0]["families"].get(family, 0) >= 4


def test_mean_over_a_split_batch(two_ranks):
    cases = two_ranks["mean-partial dp (2,)"]
    _assert_exact(cases)
    assert cases[0]["families"].get("reduce-partial(mean)") == 1


def test_forced_zero3_storage(two_ranks):
    cases = two_ranks["forced zero3 (2,)"]
    _assert_exact(cases)
    assert all(fam == "sharded" for _, fam in cases[0]["storage"].values())
    # the layer's parameters are gathered together, FSDP-style (one collective per layer)
    groups = [line for line in cases[0]["code"].splitlines() if "autopar_all_gather_group(" in line]
    assert any("p_proj_in_weight" in line for line in groups), groups


def test_idle_axes_are_exact(four_ranks):
    fixed = four_ranks["idle axis 0 (2, 2)"]
    _assert_exact(fixed)
    assert fixed[0]["idle_axes"] == (0,) and 0 not in fixed[0]["grad_sync_axes"]
    auto = four_ranks["idle auto (2, 2)"]
    _assert_exact(auto)
    assert auto[0]["idle_axes"]  # the tiny MLP on cpu-gloo links is cheapest run redundantly somewhere


def test_forced_2d_on_mesh_2x2(four_ranks):
    cases = four_ranks["forced 2d (2, 2)"]
    _assert_exact(cases)
    assert cases[0]["families"].get("2d", 0) >= 4


@pytest.mark.parametrize("tag", ["vit dp (2,)", "vit dp2 x tp2 (2, 2)"])
def test_vit_with_hand_layouts(two_ranks, four_ranks, tag):
    cases = (two_ranks if "(2,)" in tag else four_ranks)[tag]
    _assert_exact(cases)
    assert cases[0]["families"].get("dp", 0) >= 1  # the patch convolution splits the batch


def test_mingpt_with_a_hand_layout(four_ranks):
    """minGPT's attention by hand: a causal-mask buffer, masked_fill with -inf, softmax, NewGELU as math."""
    cases = four_ranks["mingpt dp2 x tp2 (2, 2)"]
    _assert_exact(cases)
    # tensor parallel inside the blocks: column- and row-parallel linears (how many of each is the
    # planner's choice: since the loss sums its ranks' shares the tail splits rows, 1 row-parallel)
    assert cases[0]["families"].get("2d", 0) >= 2 and cases[0]["families"].get("2d-mk", 0) >= 1, cases[0]["families"]


@pytest.mark.parametrize("tag", ["moe dp4 (4,)", "moe dp2 x tp2 (2, 2)"])
def test_mixture_of_experts_with_hand_layouts(four_ranks, tag):
    cases = four_ranks[tag]
    _assert_exact(cases)
    fams = cases[0]["families"]
    assert fams.get("select", 0) >= 4  # the router's topk and one_hot split with the tokens
    if "tp2" in tag:
        assert fams.get("2d", 0) >= 8 and fams.get("2d-mk", 0) >= 8, fams  # every expert column / row parallel


def test_sequence_parallel_attention_with_tensor_parallel_mlp(four_ranks):
    """GPT-3's planned block layout (see ulysses_hybrid_case) runs exactly on real ranks."""
    cases = four_ranks["ulysses hybrid gpt (2, 2)"]
    _assert_exact(cases)
    fams = cases[0]["families"]
    assert fams.get("dp+sp", 0) >= 4 and fams.get("dp+heads") == 2 and fams.get("2d") == 2 and fams.get("2d-mk") == 2, fams
    assert "all_to_all" in cases[0]["code"]


def _assert_low_precision(c, grad_dtype: str):
    assert "error" not in c, c.get("error")
    assert c["dtypes"] == {grad_dtype}
    ulp = 2.0 ** -7
    bad = {k: v for k, v in c["errs"].items() if not v[0] <= 2 * v[1] + 2 * ulp}
    assert not bad and len(c["errs"]) >= 10, bad
    par, one, fp32 = c["losses"]
    assert abs(par - one) <= 2 * ulp * abs(one) and abs(par - fp32) <= 4 * ulp * abs(fp32), c["losses"]


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("layout", sorted(BF16_LAYOUTS))
def test_bfloat16_models_add_no_error_beyond_bfloat16(two_ranks, name, layout):
    """See low_precision_case: a bf16 model's gradients, parallel, are within twice one device's
    bf16 error of the float32 gradients (plus two ulps), in bf16."""
    (c, *_) = two_ranks[f"bf16 {name} {layout} (2,)"]
    _assert_low_precision(c, "torch.bfloat16")
    if layout == "tp":
        assert c["families"].get("1d-col", 0) + c["families"].get("1d-row", 0) >= 4, c["families"]


@pytest.mark.parametrize("layout", sorted(AUTOCAST_LAYOUTS))
def test_autocast_runs_like_one_device_under_autocast(two_ranks, layout):
    """A float32 GPT called under torch.autocast(bfloat16): the loss comes back in float32 as one
    device's does (cross_entropy runs in float32 under autocast, lowered losses included) and
    within 1e-4 of it; gradients meet the bf16 bar."""
    (c, *_) = two_ranks[f"autocast gpt {layout} (2,)"]
    _assert_low_precision(c, "torch.float32")
    assert c["loss_dtypes"] == ("torch.float32", "torch.float32")
    par, one, _ = c["losses"]
    assert abs(par - one) <= 1e-4 * abs(one), c["losses"]
    if layout == "vocab-parallel":
        assert c["families"].get("loss-vocab-parallel", 0) == 1, c["families"]


def test_meta_init_holds_only_shards(two_ranks):
    for c in two_ranks["meta-init"]:
        assert "error" not in c, c.get("error")
        assert c["numel_ok"] and c["local_numel"] * 2 == c["global_numel"]
        assert c["value_err"] == 0.0 and c["still_meta"]
        _assert_exact([c["train"]])


def test_forced_2_5d_and_3d_and_a_2x4_mesh_on_8_ranks():
    cases = _by_tag(spawn(rank_8, 8, timeout_s=600))
    for fam in ("2.5d", "3d"):
        _assert_exact(cases[f"forced {fam} (2, 2, 2)"])
        assert cases[f"forced {fam} (2, 2, 2)"][0]["families"].get(fam, 0) >= 4
    _assert_exact(cases["gpt auto (2, 4)"])
    hybrid = cases["gpt dp2 x tp4 (2, 4)"]
    _assert_exact(hybrid)
    # batch on axis 0, Megatron column / row on axis 1: both 2-D matmul families ran (which linears
    # go row-parallel is the ILP's choice: on gloo's prices, latency-bound all-reduces of these small
    # activations lose to gathers in some layers)
    fams = hybrid[0]["families"]
    assert fams.get("2d", 0) >= 2 and fams.get("2d-mk", 0) >= 1, fams


def test_parallelize_outside_ranks_is_a_config_error(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    model, inputs = models.build("mlp")
    with pytest.raises(ConfigError, match="inside each rank"):
        autopar.parallelize(model, autopar.Mesh((2,)), inputs, pipeline=False)


def test_a_rank_raising_mid_step_stops_every_rank():
    """Rank 1 raises between forward and backward: its peers' collectives fail (the dead peer
    closes its connections) and every rank exits with an error by itself, long before any
    timeout; spawn names rank 1."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(fail_mid_step, 4, args=("raise",), timeout_s=300, grace_s=120)
    err = info.value
    assert err.rank == 1 and "rank 1 fails after forward, before backward" in str(err)
    assert sorted(err.failures) == [0, 1, 2, 3] and not err.stuck, str(err)
    assert time.monotonic() - t0 < 120


def test_a_stuck_rank_makes_the_others_time_out():
    """Rank 1 stays alive but never joins backward: the others' collectives on parallelize's
    groups raise after ``timeout`` (not torch's 30-minute default), and spawn reports them."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(fail_mid_step, 2, args=("hang",), timeout_s=300, grace_s=2)
    err = info.value
    assert err.rank == 0 and err.stuck == [1], str(err)
    assert f"Timed out waiting {int(MID_STEP_TIMEOUT_S * 1000)}ms" in err.failures[0]
    assert time.monotonic() - t0 < 120

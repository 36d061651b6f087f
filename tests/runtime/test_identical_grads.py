"""Gradients kept whole on identical axes (Megatron's tensor-parallel convention,
``autopar.cost_model.gradients``), run on real ranks: every case trains 3 AdamW steps next to one
process (loss, every gradient each step and the trained parameters within 1e-5), and asserts the
convention the plan ran with and the gradient syncs it dropped.

Layer norms, the row-parallel biases added after the all-reduce and every other parameter that
no tensor-parallel op splits need no gradient all-reduce over the tensor-parallel axis: they are
whole there because every op that splits the axis sums its replicated inputs' gradients at once.
One spawn of 4 ranks runs every case."""
import pytest

import autopar
from autopar import models
from autopar.runtime.launch import spawn

from parallel_harness import TOL, compare, run_case, summary

pytestmark = pytest.mark.multirank

GPT = dict(vocab=64, width=32, layers=2, heads=4, seq=8, batch=4)
LLAMA = dict(vocab=64, width=32, layers=2, heads=4, kv_heads=2, hidden=48, seq=8, batch=4)


def _case(tag, name, build_kw, mesh_shape, groups, layout, identical):
    def go():
        model, inputs = models.build(name, **build_kw)
        mesh = autopar.Mesh(mesh_shape, cluster="cpu-gloo")
        res = compare(model, inputs, mesh, groups, steps=3, force=layout,
                      idle_axes=(), identical_axes=identical)
        out = summary(tag, res)
        plan = res["plan"]
        out["identical"] = tuple(plan.identical_axes)
        out["sync"] = {p.name: (None if p.grad_sync is None else p.grad_sync.axes) for p in plan.params.values()
                       if not p.buffer}
        out["zero2"] = sum(1 for p in plan.params.values() if p.grad_sync is not None and p.grad_sync.split)
        out["sums"] = res["code"].count("autopar_grad_sum(")
        out["whole_steps"] = res["code"].count("whole = True")
        return out

    return run_case(tag, go)


CASES = [
    # tag, model, build kwargs, mesh, layout, identical axes
    ("gpt-dp2-tp2", "gpt", GPT, (2, 2), autopar.Layout(dp=2, tp=2), (1,)),
    ("llama-dp2-tp2", "llama", LLAMA, (2, 2), autopar.Layout(dp=2, tp=2), (1,)),
    ("gpt-tp4-vocab", "gpt", GPT, (4,), autopar.Layout(tp=4, vocab_parallel=True), (0,)),
    ("llama-tp4", "llama", LLAMA, (4,), autopar.Layout(tp=4), (0,)),
    ("gpt-dp4", "gpt", GPT, (4,), autopar.Layout(dp=4), (0,)),
    ("gpt-dp4-zero3", "gpt", GPT, (4,), autopar.Layout(dp=4, zero=3), (0,)),
    ("gpt-dp2-tp2-both", "gpt", GPT, (2, 2), autopar.Layout(dp=2, tp=2), (0, 1)),
    ("gpt-2x2-auto", "gpt", GPT, (2, 2), None, "auto"),
    # ZeRO-2 over the data-parallel axis of parameters replicated on a whole tensor-parallel axis
    ("llama-dp2-tp2-zero2", "llama", LLAMA, (2, 2), autopar.Layout(dp=2, tp=2, zero=2), (1,)),
]


def _other_shapes_case(groups):
    """The main program keeps gradients whole on both axes; a call with another batch size runs a
    program planned on its own (its convention priced afresh), whose parameter gradients must reach
    the main program's reducer pending on exactly the axes it syncs."""
    def go():
        import copy

        import torch

        from parallel_harness import ADAM_EPS, grad_errors, rel

        model, (idx, tgt) = models.build("gpt", **GPT)
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, autopar.Mesh((2, 2), cluster="cpu-gloo"), (idx, tgt), groups=groups,
                                 force=autopar.Layout(dp=2, tp=2), idle_axes=(), identical_axes=(0, 1))
        o_p = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
        o_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
        worst = 0.0
        for step, rows in enumerate((4, 2, 2, 4)):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, GPT["vocab"], (rows, GPT["seq"]), generator=g)
            y = torch.randint(0, GPT["vocab"], (rows, GPT["seq"]), generator=g)
            lp, lr_ = pm.train_step(x, y), ref(x, y)
            lr_.backward()
            worst = max([worst, rel(lp, lr_), *grad_errors(pm, ref).values()])
            o_p.step(), o_r.step(), o_p.zero_grad(), o_r.zero_grad()
        (other,) = pm.programs.values()
        code = other.lowered.code
        return {"tag": "other-shapes", "worst": worst, "main": tuple(pm.plan.identical_axes),
                "other": tuple(other.plan.identical_axes),
                "handed": code.count("autopar_grad_share(") + code.count("autopar_grad_sum(")}

    return run_case("other-shapes", go)


def ranks(rank, world):
    from autopar.runtime.process_groups import MeshGroups

    groups = {(2, 2): MeshGroups(autopar.Mesh((2, 2))), (4,): MeshGroups(autopar.Mesh((4,)))}
    return [_case(tag, name, kw, shape, groups[shape], layout, identical)
            for tag, name, kw, shape, layout, identical in CASES] + [_other_shapes_case(groups[(2, 2)])]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the spawned ranks inherit the environment
        mp.setenv("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("autopar-cache")))
        return {c["tag"]: c for c in spawn(ranks, 4, timeout_s=600)[0]}


def _ok(case):
    assert "error" not in case, case.get("error")
    assert case["worst"] <= TOL, (case["tag"], case["worst"], case["bad_grads"])
    assert case["state_err"] <= TOL, (case["tag"], case["state_err"])


@pytest.mark.parametrize("tag", [c[0] for c in CASES])
def test_exact(results, tag):
    _ok(results[tag])


@pytest.mark.parametrize("tag, tp_axis", [("gpt-dp2-tp2", 1), ("llama-dp2-tp2", 1)])
def test_megatron_parameters_need_no_tensor_parallel_sync(results, tag, tp_axis):
    case = results[tag]
    assert case["identical"] == (tp_axis,)
    norms = [k for k in case["sync"] if "norm" in k or ".ln" in k]
    assert norms, case["sync"]
    # the blocks' layer norms (and every other parameter of a block) synchronise over the
    # data-parallel axis only; the tail (final norm, head) may be split along the tensor-parallel
    # axis too (its rows, as sequence parallelism splits them), and then syncs over both
    block = {k: v for k, v in case["sync"].items() if ".h." in k or ".layers." in k}
    assert block and all(axes == (0,) for axes in block.values()), case["sync"]
    assert all(axes in ((0,), (0, 1)) for axes in case["sync"].values()), case["sync"]
    assert case["sums"] > 0
    if tag.startswith("llama"):
        # a normed block input read by q, k and v (and by gate and up) is summed once, not per
        # projection: at most 3 sums per block (+1 for the head), against 6 split reads per block
        assert case["sums"] <= 2 * 3 + 1, case["sums"]


def test_zero2_shards_over_the_data_parallel_axis_alone(results):
    case = results["llama-dp2-tp2-zero2"]
    assert case["identical"] == (1,)
    norms = {k: v for k, v in case["sync"].items() if "norm" in k and ".layers." in k}
    assert norms and all(axes == (0,) for axes in norms.values()), case["sync"]
    assert case["zero2"] > 0, case


def test_vocab_parallel_loss_and_1d_megatron(results):
    case = results["gpt-tp4-vocab"]
    assert case["identical"] == (0,)
    assert "loss-vocab-parallel" in " ".join(case["families"])
    # replicated parameters (norms, row-parallel biases) are whole: nothing left to synchronise
    assert not any(case["sync"].values()), case["sync"]
    assert case["whole_steps"] > 0


def test_data_parallel_and_zero3_keep_their_syncs(results):
    dp = results["gpt-dp4"]
    assert dp["identical"] == (0,)
    # Every weight's reads split the batch: its pending sum stays deferred to the reducer. The
    # position table is looked up whole (positions are not split), so its gradient is whole once
    # the one op that splits the batch reading it (the add into the token embeddings) sums its share.
    wpe = dp["sync"].pop("transformer.wpe.weight")
    assert wpe is None and dp["sums"] == 1
    assert all(axes == (0,) for axes in dp["sync"].values()), dp["sync"]
    z3 = results["gpt-dp4-zero3"]
    assert z3["identical"] == (0,) and z3["sums"] > 0  # gathered weights: summed, then sliced back


def test_auto_picks_a_convention_and_runs_it(results):
    assert results["gpt-2x2-auto"]["identical"] in ((), (0,), (1,), (0, 1))


def test_a_program_for_other_inputs_hands_its_gradients_to_the_main_reducer(results):
    case = results["other-shapes"]
    assert "error" not in case, case.get("error")
    assert case["worst"] <= TOL, case
    # the batch of 2 is priced to whole gradients on fewer axes than the main program (cpu-gloo
    # preset): the parameters it leaves whole where the main program does not are handed to the
    # reducer as shares, and the step is exact
    assert case["main"] == (0, 1) and set(case["other"]) < {0, 1}, case
    assert case["handed"] > 0, case

"""Checkpoints survive the processes and move between plans: train 3 AdamW steps under one plan,
save, let the ranks exit, start new ranks under another plan (or one process), load, train 2 more:
losses and parameters equal 5 uninterrupted single-process steps. A rank killed in the middle of a
save leaves the previous checkpoint loadable; partial, foreign and mismatched checkpoints raise
CheckpointError; export writes one safetensors file the original model (and transformers) loads."""
from __future__ import annotations

import os
import signal

import pytest
import torch

import autopar
from autopar import models
from autopar.errors import CheckpointError, RankError
from autopar.runtime.launch import spawn
from parallel_harness import ADAM_EPS, fresh_inputs, rel

LR = 1e-2
TOL = 1e-5
STATE_TOL = TOL  # parameters after 5 AdamW steps, as the losses


def _model():
    return models.build("gpt", layers=2)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


def _train(module, inputs, start: int, steps: int, opt) -> list[float]:
    out = []
    for s in range(start, start + steps):
        x = fresh_inputs(inputs, s)
        if hasattr(module, "train_step"):
            loss = module.train_step(*x)
        else:
            loss = module(*x)
            loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _phase(rank, world, path, shape, layout, pipeline, load: bool, steps: int, save: bool):
    """Inside each rank: parallelize under one plan, maybe load, train, maybe save."""
    model, inputs = _model()
    pm = autopar.parallelize(model, autopar.Mesh(shape), inputs, force=layout, pipeline=pipeline, profile=False)
    opt = _optimizer(pm.parameters())
    start = autopar.load(path, pm, opt)["step"] if load else 0
    losses = _train(pm, inputs, start, steps, opt)
    if save:
        autopar.save(path, pm, opt, extra={"step": start + steps, "note": "three steps"})
    state = pm.full_state_dict()  # a collective
    return {"losses": losses, "state": state if rank == 0 else None, "start": start}


@pytest.fixture(scope="module")
def reference():
    """Losses and parameters after each of 5 single-process steps."""
    model, inputs = _model()
    opt = _optimizer(model.parameters())
    losses = _train(model, inputs, 0, 5, opt)
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    """3 steps of a 2x2 data x tensor parallel plan, saved; the ranks then exit."""
    path = tmp_path_factory.mktemp("ck") / "run"
    spawn(_phase, 4, args=(path, (2, 2), autopar.Layout(dp=2, tp=2), None, False, 3, True))
    return path


def _check(reference, first_losses, res):
    losses = first_losses + res[0]["losses"]
    errs = [rel(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, reference["losses"])]
    assert max(errs) <= TOL, (losses, reference["losses"])
    state = res[0]["state"]
    worst = max(rel(state[k], v) for k, v in reference["state"].items())
    assert worst <= STATE_TOL, worst


@pytest.mark.parametrize("target", ["data parallel (4,)", "2-stage pipeline x dp2", "2 ranks, default plan"])
def test_resume_under_another_plan(reference, saved_2x2, target):
    world, shape, layout, pipeline = {
        "data parallel (4,)": (4, (4,), autopar.Layout(dp=4), None),
        "2-stage pipeline x dp2": (4, (4,), autopar.Layout(dp=2), autopar.Pipeline(stages=2, microbatches=2)),
        "2 ranks, default plan": (2, (2,), None, "auto"),  # whatever the planner chooses (stages allowed)
    }[target]
    res = spawn(_phase, world, args=(saved_2x2, shape, layout, pipeline, True, 2, False))
    assert res[0]["start"] == 3
    _check(reference, reference["losses"][:3], res)


def test_resume_in_one_process(reference, saved_2x2):
    model, inputs = _model()
    with torch.no_grad():  # start from something else: every value must come from the checkpoint
        for p in model.parameters():
            p.mul_(0.5)
    opt = _optimizer(model.parameters())
    extra = autopar.load(saved_2x2, model, opt)
    assert extra == {"step": 3, "note": "three steps"}
    losses = _train(model, inputs, 3, 2, opt)
    _check(reference, reference["losses"][:3], [{"losses": losses, "state": model.state_dict()}])
    full = autopar.load_full(saved_2x2)
    assert set(full) == set(model.state_dict())


def test_pipeline_with_zero2_resumes_as_tensor_parallel(reference, tmp_path):
    """Saved by 2 stages (each rank holding its stage's keys, ZeRO-2 chunks of optimizer states),
    loaded by a 2x2 plan."""
    path = tmp_path / "run"
    first = spawn(_phase, 4, args=(path, (4,), autopar.Layout(dp=2, zero=2), autopar.Pipeline(stages=2, microbatches=2),
                                   False, 3, True))
    res = spawn(_phase, 4, args=(path, (2, 2), autopar.Layout(dp=2, tp=2), None, True, 2, False))
    _check(reference, first[0]["losses"], res)


def _die_in_save(rank, world, path):
    """Save once (committed), train on, then save again with rank 1 killed while DCP writes."""
    from torch.distributed.checkpoint import filesystem

    model, inputs = _model()
    pm = autopar.parallelize(model, autopar.Mesh((2, 2)), inputs, force=autopar.Layout(dp=2, tp=2), profile=False)
    opt = _optimizer(pm.parameters())
    _train(pm, inputs, 0, 3, opt)
    autopar.save(path, pm, opt, extra={"step": 3})
    _train(pm, inputs, 3, 1, opt)
    original = filesystem.FileSystemWriter.write_data

    def dying(self, plan, planner):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)

    filesystem.FileSystemWriter.write_data = dying
    autopar.save(path, pm, opt, extra={"step": 4})


def test_a_save_killed_midway_leaves_the_previous_checkpoint(reference, tmp_path):
    from autopar.runtime.checkpoint import committed_version

    path = tmp_path / "run"
    with pytest.raises(RankError, match="rank 1 died"):
        spawn(_die_in_save, 4, args=(path,), timeout_s=120)
    versions = sorted(p.name for p in path.iterdir() if p.is_dir())
    assert versions[0] == "v000001" and versions[1:] in ([], ["v000002"])  # the second began, never committed
    assert committed_version(path).name == "v000001"
    if versions[1:]:
        with pytest.raises(CheckpointError, match="incomplete"):
            committed_version(path / "v000002")
    res = spawn(_phase, 4, args=(path, (4,), autopar.Layout(dp=4), None, True, 2, False))
    assert res[0]["start"] == 3
    _check(reference, reference["losses"][:3], res)


def test_foreign_partial_and_mismatched_checkpoints_are_refused(tmp_path, saved_2x2):
    from autopar.runtime.checkpoint import committed_version

    with pytest.raises(CheckpointError, match="no checkpoint"):
        committed_version(tmp_path / "nothing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="not an autopar checkpoint"):
        autopar.load_full(tmp_path / "other")
    other, _ = models.build("gpt", layers=3)  # one layer more: keys the checkpoint lacks
    with pytest.raises(CheckpointError, match="transformer.h.2"):
        autopar.load(saved_2x2, other)
    model, _ = _model()
    spare = tmp_path / "model-only"
    _save_model_only(spare)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        autopar.load(spare, model, _optimizer(model.parameters()))
    assert autopar.load(spare, model) is None  # the model alone loads (nothing extra was saved)


def _save_into(rank, world, path):
    """Every rank hears rank 0's refusal of the directory (none waits for the others)."""
    model, inputs = _model()
    pm = autopar.parallelize(model, autopar.Mesh((2,)), inputs, profile=False, pipeline=False)
    try:
        autopar.save(path, pm)
    except CheckpointError as err:
        return str(err)
    return "saved"


def test_saving_into_a_foreign_directory_is_refused_on_every_rank(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    said = spawn(_save_into, 2, args=(tmp_path / "other",), timeout_s=120)
    assert all("not an autopar checkpoint" in s for s in said), said


def _model_only(rank, world, path):
    model, inputs = _model()
    pm = autopar.parallelize(model, autopar.Mesh((2,)), inputs, profile=False, pipeline=False)
    autopar.save(path, pm)


def _save_model_only(path):
    spawn(_model_only, 2, args=(path,))


def _export(rank, world, path, hf_dir):
    from test_parallelize import hf_model

    model, inputs = _model()
    pm = autopar.parallelize(model, autopar.Mesh((2, 2)), inputs, force=autopar.Layout(dp=2, tp=2), profile=False)
    autopar.export(path, pm)
    hf = hf_model("gpt2")
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    hpm = autopar.parallelize(hf, autopar.Mesh((2, 2)), (), example_kwargs={"input_ids": ids, "labels": ids},
                              force=autopar.Layout(dp=2, tp=2), profile=False)
    if rank == 0:
        hf.config.save_pretrained(hf_dir)
    autopar.export(os.path.join(hf_dir, "model.safetensors"), hpm)
    return None


def test_export_loads_into_the_original_model_and_transformers(tmp_path):
    from safetensors.torch import load_file

    from test_parallelize import hf_model

    path, hf_dir = tmp_path / "gpt.safetensors", tmp_path / "hf"
    spawn(_export, 4, args=(str(path), str(hf_dir)))
    model, _ = _model()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, _ = models.build("gpt", layers=2, seed=1)
    fresh.load_state_dict(load_file(str(path)), strict=True)
    assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)

    import transformers

    original = hf_model("gpt2")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(hf_dir))
    for k, v in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

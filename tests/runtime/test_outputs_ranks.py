"""Outputs a call returns split over ranks, on real gloo ranks: a language model's logits under data
parallel, tensor parallel and a pipeline are gathered only when read, then equal the model's; a loss
made from them trains exactly (every parameter's gradient, per tensor, on every rank); a read on some
ranks only, or of different calls, is a ConfigError naming what each rank read, not a hang.

One spawn of 4 ranks runs every case."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.errors import ConfigError
from autopar.runtime.outputs import SplitOutput
from autopar.runtime.process_groups import MeshGroups
from parallel_harness import TOL, rel, run_case, spawn_by_tag
from test_parallelize import HF_VOCAB, hf_model

BATCH, SEQ = 8, 16


def _batch(step: int) -> dict:
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, HF_VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": torch.randint(0, HF_VOCAB, (BATCH, SEQ), generator=g)}


def _model(arch: str):
    """``hf_model(arch)``, or "gpt2-2": a GPT-2 of two layers (a pipeline cuts between them)."""
    if arch != "gpt2-2":
        return hf_model(arch)
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, vocab_size=HF_VOCAB, bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _grad_errs(pm, ref) -> dict:
    grads = pm.full_grads()
    return {k: rel(grads[k], p.grad) for k, p in ref.named_parameters() if p.grad is not None}


def logits_case(tag, mesh, groups, arch, **options):
    """Three calls: the loss alone (logits unread, never gathered); the logits read after backward;
    a loss made of the logits themselves. Each against one process."""
    model = _model(arch)
    ref = copy.deepcopy(model)
    pm = autopar.parallelize(model, mesh, (), example_kwargs=_batch(0), groups=groups, **options)
    out = {"tag": tag, "split": [], "gathered_unread": [], "logits_err": [], "loss_err": [], "grad_err": []}
    for step in range(3):
        b = _batch(step)
        got, want = pm(**b), ref(**b)
        out["split"].append(isinstance(got.logits, SplitOutput))
        if step < 2:
            got.loss.backward()
            want.loss.backward()
            out["gathered_unread"].append(isinstance(got.logits, SplitOutput) and got.logits.gathered)
            out["loss_err"].append(rel(got.loss, want.loss))
        else:  # the caller's own loss, over the whole logits
            mine = F.cross_entropy(got.logits.flatten(0, 1), b["labels"].flatten()) + 0.5 * got.loss
            theirs = F.cross_entropy(want.logits.flatten(0, 1), b["labels"].flatten()) + 0.5 * want.loss
            mine.backward()
            theirs.backward()
            out["loss_err"].append(rel(mine, theirs))
        out["logits_err"].append(rel(got.logits, want.logits))
        out["grad_err"].append(max(_grad_errs(pm, ref).values()))
        pm.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    pm.eval()
    ref.eval()
    with torch.no_grad():
        got, want = pm(**_batch(9)), ref(**_batch(9))
    out["eval_split"] = isinstance(got.logits, SplitOutput)
    out["eval_err"] = rel(got.logits, want.logits)
    out["plan"] = pm.plan.summary().get("pipeline") is not None
    return out


def snapshot_case(tag, mesh, groups):
    """``full_grads()`` hands copies: a later backward (which writes the reducer's buckets, of which
    a replicated parameter's ``.grad`` is a view) leaves them as they were."""
    pm = autopar.parallelize(hf_model("gpt2"), mesh, (), example_kwargs=_batch(0), groups=groups, pipeline=False,
                             idle_axes=(), force=autopar.Layout(dp=mesh.size))
    pm(**_batch(0)).loss.backward()
    first = pm.full_grads()
    kept = {k: g.clone() for k, g in first.items() if g is not None}
    pm.zero_grad(set_to_none=False)
    pm(**_batch(1)).loss.backward()
    second = pm.full_grads()
    return {"tag": tag, "unchanged": all(torch.equal(first[k], v) for k, v in kept.items()),
            "moved": any(not torch.equal(second[k], v) for k, v in kept.items())}


def one_rank_reads_case(tag, mesh):
    """Rank 0 alone reads the logits: it gets a ConfigError after the timeout; the others go on."""
    pm = autopar.parallelize(hf_model("gpt2"), mesh, (), example_kwargs=_batch(0), pipeline=False, idle_axes=(),
                             force=autopar.Layout(dp=mesh.size), timeout=3)
    out = pm(**_batch(0))
    error = None
    if torch.distributed.get_rank() == 0:
        try:
            out.logits.sum()
        except ConfigError as err:
            error = str(err)
    return {"tag": tag, "error_text": error}


def other_calls_case(tag, mesh, groups):
    """Rank 0 reads call 1's logits while the others read call 2's: every rank names the mismatch."""
    pm = autopar.parallelize(hf_model("gpt2"), mesh, (), example_kwargs=_batch(0), groups=groups, pipeline=False,
                             idle_axes=(), force=autopar.Layout(dp=mesh.size))
    first, second = pm(**_batch(0)), pm(**_batch(1))
    mine = first if torch.distributed.get_rank() == 0 else second
    try:
        mine.logits.sum()
        error = None
    except ConfigError as err:
        error = str(err)
    return {"tag": tag, "error_text": error}


def rank_4(rank, world_size):
    warnings.simplefilter("ignore")
    out = []
    line = autopar.Mesh((4,), cluster="cpu-gloo")
    square = autopar.Mesh((2, 2), cluster="cpu-gloo")
    g_line, g_square = MeshGroups(line), MeshGroups(square)
    common = dict(pipeline=False, idle_axes=())
    out.append(run_case("dp gpt2", logits_case, "dp gpt2", line, g_line, "gpt2", force=autopar.Layout(dp=4), **common))
    out.append(run_case("zero3 llama", logits_case, "zero3 llama", line, g_line, "llama",
                        force=autopar.Layout(dp=4, zero=3), **common))
    out.append(run_case("dp x tp llama", logits_case, "dp x tp llama", square, g_square, "llama",
                        force=autopar.Layout(dp=2, tp=2), **common))
    out.append(run_case("default gpt2", logits_case, "default gpt2", line, g_line, "gpt2", idle_axes=()))
    out.append(run_case("pipeline gpt2", logits_case, "pipeline gpt2", square, g_square, "gpt2-2", idle_axes=(),
                        pipeline=autopar.Pipeline(stages=2, microbatches=2)))
    out.append(run_case("other calls", other_calls_case, "other calls", line, g_line))
    out.append(run_case("snapshot", snapshot_case, "snapshot", line, g_line))
    out.append(run_case("one rank reads", one_rank_reads_case, "one rank reads", line))  # last: its group times out
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_by_tag(tmp_path_factory, [(rank_4, 4)], timeout_s=600)


@pytest.mark.parametrize("tag", ["dp gpt2", "zero3 llama", "dp x tp llama", "default gpt2", "pipeline gpt2"])
def test_logits_are_gathered_when_read_and_train_exactly(results, tag):
    for c in results[tag]:
        assert "error" not in c, c["error"]
        assert all(c["split"]) and c["eval_split"], (tag, c["split"])  # every plan here leaves the logits split
        assert not any(c["gathered_unread"]), "an unread output was gathered"
        assert max(c["logits_err"]) <= TOL and c["eval_err"] <= TOL, (tag, c["logits_err"], c["eval_err"])
        assert max(c["loss_err"]) <= TOL, (tag, c["loss_err"])
        assert max(c["grad_err"]) <= 1e-4, (tag, c["grad_err"])
    assert results["pipeline gpt2"][0]["plan"]


def test_reads_of_different_calls_are_named(results):
    texts = [c["error_text"] for c in results["other calls"]]
    assert all(t is not None for t in texts), texts
    assert "rank 0 read output 1 of call 1" in texts[1]
    assert "rank 1 read output 1 of call 2" in texts[0]


def test_a_read_on_one_rank_alone_times_out_with_a_config_error(results):
    cases = results["one rank reads"]
    for c in cases:
        assert "error" not in c, c["error"]
    assert "read a split output on every rank" in cases[0]["error_text"]
    assert all(c["error_text"] is None for c in cases[1:])


def test_full_grads_are_copies(results):
    for c in results["snapshot"]:
        assert "error" not in c, c["error"]
        assert c["unchanged"] and c["moved"], c

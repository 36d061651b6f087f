"""Pipelined plans run exactly: ``pmodel.train_step`` on every stage layout (2 stages x 2-way tensor
parallel, 2 stages x 2-way data parallel, 4 stages, uneven layer splits, 2 stages per rank), the
schedules autopar runs (GPipe, 1F1B, interleaved 1F1B), with and without recomputation, on the built-in GPT and LLaMA and on
transformers' GPT-2 (embedding tied to the head across stages) and LLaMA: losses and every
gradient against one process, then 3 AdamW steps and the trained state.

One spawn of 4 gloo ranks runs every case; each returns relative errors (max|a - b| / max|b|)."""
from __future__ import annotations

import copy
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar import models
from autopar.errors import ConfigError
from autopar.runtime.launch import spawn
from autopar.runtime.stage_program import _Checkpointed
from parallel_harness import ADAM_EPS, TOL, fresh_inputs, rel, run_case
from test_parallelize import HF_VOCAB

STEPS = 2  # a step, an optimizer update, and a step from the updated weights
# Trained parameters after 3 AdamW steps: sums over microbatches and shards round differently
# from one process, and those roundings grow by a few ulps per step.
STATE_TOL = 5e-5


def _hf(arch: str, layers: int):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=HF_VOCAB, bos_token_id=0, eos_token_id=0, use_cache=False)
    if arch == "gpt2":  # else "hf-llama"
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, max_position_embeddings=16, **common)
    return transformers.LlamaForCausalLM(cfg)


def _loss(out):
    return out.loss if hasattr(out, "loss") else (out[0] if isinstance(out, tuple) else out)


class _CountSplit:
    """Counts, on this rank, the parts the taps hand in (a whole backward reaching the buckets), the
    weight halves handed to the reducer (``accumulate``), the backwards whose end started the
    gradient sync (``in_backward_syncs``), the collectives launched inside those backwards before
    their end (``launched_in_backward``) and those still in flight when they returned
    (``left_in_flight``: the runner waits for them after the schedule)."""

    def __init__(self):
        from autopar.runtime import reducer

        self.taps = self.weight_halves = self.in_backward_syncs = self.launched_in_backward = self.left_in_flight = 0
        self._patches = [(reducer.GradReducer, "_on_part"), (reducer.GradReducer, "accumulate"),
                         (reducer.GradReducer, "_end_of_backward")]
        self._saved = [getattr(cls, name) for cls, name in self._patches]
        counter = self

        def on_part(self, *a, **k):
            counter.taps += 1
            return counter._saved[0](self, *a, **k)

        def accumulate(self, *a, **k):
            counter.weight_halves += 1
            return counter._saved[1](self, *a, **k)

        def end_of_backward(self):
            counter.in_backward_syncs += 1
            counter.launched_in_backward += len(self._inflight)
            counter._saved[2](self)
            counter.left_in_flight += len(self._inflight)

        reducer.GradReducer._on_part = on_part
        reducer.GradReducer.accumulate = accumulate
        reducer.GradReducer._end_of_backward = end_of_backward

    def close(self):
        for (cls, name), fn in zip(self._patches, self._saved):
            setattr(cls, name, fn)


def _padded(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Targets ``x`` with each row's first ``ids[row, 0] % 13`` positions ignored (-100): padding
    that differs per sample and per step, so microbatches count different numbers of targets."""
    return x.masked_fill(torch.arange(x.shape[1]) < (ids[:, :1] % 13), -100)


def _masked(kwargs: dict) -> dict:
    """A transformers call with an attention mask that pads each row's last ``ids[row, 0] % 5``
    positions (their labels ignored): transformers' masks read it per sample by index."""
    ids = kwargs["input_ids"]
    keep = torch.arange(ids.shape[1]) < ids.shape[1] - ids[:, :1] % 5
    return {**kwargs, "attention_mask": keep.long(), "labels": kwargs["labels"].masked_fill(~keep, -100)}


def pipeline_case(tag, mesh_shape, pipeline, *, model="gpt", layers=4, layout=None, clip=False, padded=False,
                  masked=False, tied_whole=False):
    """Train ``STEPS`` AdamW steps with ``train_step`` next to one process; errors and the stages.
    ``padded``: targets partly ignored (``_padded``); ``masked``: a padding attention mask too
    (``_masked``, transformers models); ``tied_whole``: a tied parameter's gradient summed across
    stages as whole tensors, as where the stages store it differently (``_stored_alike`` false)."""
    def go():
        from autopar.runtime.pipeline import PipelineRunner

        counts = _CountSplit()
        alike, tied = PipelineRunner._stored_alike, []

        def stored_alike(self, fqn, stages):  # records which way each tied gradient is summed
            tied.append(False if tied_whole else alike(self, fqn, stages))
            return tied[-1]

        PipelineRunner._stored_alike = stored_alike
        try:
            return {**run(), "taps": counts.taps, "weight_halves": counts.weight_halves,
                    "in_backward_syncs": counts.in_backward_syncs, "launched_in_backward": counts.launched_in_backward,
                    "left_in_flight": counts.left_in_flight, "tied_alike": sorted(set(tied))}
        finally:
            counts.close()
            PipelineRunner._stored_alike = alike

    def run():
        warnings.simplefilter("ignore")
        if model == "vit":  # tests/models_zoo.py, in float64 (see test_parallelize.vit_case)
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            import models_zoo

            net, inputs = models_zoo.vit(batch=8, image=8, dim=32, depth=layers)
            net, inputs = net.double(), tuple(t.double() if t.is_floating_point() else t for t in inputs)
            kwargs_fn = None
        elif model in ("gpt", "llama"):
            net, inputs = models.build(model, layers=layers)
            kwargs_fn = (lambda x: {"idx": x[0], "targets": _padded(x[1], x[0])}) if padded else None  # noqa: E731
        else:
            net = _hf(model, layers)
            g = torch.Generator().manual_seed(0)
            inputs = tuple(torch.randint(0, HF_VOCAB, (8, 16), generator=g) for _ in range(2))
            def kwargs_fn(x):
                kwargs = {"input_ids": x[0], "labels": _padded(x[1], x[0]) if padded else x[1]}
                return _masked(kwargs) if masked else kwargs
        ref = copy.deepcopy(net)
        mesh = autopar.Mesh(mesh_shape)
        if kwargs_fn is None:
            pm = autopar.parallelize(net, mesh, inputs, pipeline=pipeline, force=layout, profile=False)
        else:
            pm = autopar.parallelize(net, mesh, (), example_kwargs=kwargs_fn(inputs), pipeline=pipeline, force=layout,
                                     profile=False)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
        loss_err, grad_err, norm_err = 0.0, 0.0, 0.0
        for step in range(STEPS):
            x = fresh_inputs(inputs, step)
            loss = pm.train_step(**kwargs_fn(x)) if kwargs_fn else pm.train_step(*x)
            want = _loss(ref(**kwargs_fn(x)) if kwargs_fn else ref(*x))
            want.backward()
            loss_err = max(loss_err, rel(loss, want))
            for fqn, g in pm.full_grads().items():
                grad_err = max(grad_err, rel(g, ref.get_parameter(fqn).grad) if g is not None else math.inf)
            if clip:
                norm = pm.clip_grad_norm_(0.05)
                want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                norm_err = max(norm_err, rel(norm, want_norm))
            opt.step()
            ropt.step()
            opt.zero_grad()
            ropt.zero_grad()
        full, want_sd = pm.full_state_dict(), ref.state_dict()
        state_err = max(rel(full[k], want_sd[k]) for k in want_sd)
        summary = pm.plan.summary()["pipeline"]
        pieces = sum(isinstance(m, _Checkpointed) for stage in pm._ap.pipeline.modules for m in stage.modules())
        selective = sum(isinstance(m, _Checkpointed) and m.selective for stage in pm._ap.pipeline.modules
                        for m in stage.modules())
        # the last stage's program against the lowered one it was cut from: outputs and collectives
        last = [(_outputs_and_gathers(m.feeds.lowered.gm), _outputs_and_gathers(m.program))
                for m in pm._ap.pipeline.modules if m.last and isinstance(m.program, torch.fx.GraphModule)]
        return {"pieces": pieces, "selective": selective, "tag": tag, "last_stage": last, "loss_err": loss_err, "grad_err": grad_err, "norm_err": norm_err, "state_err": state_err,
                "keys_equal": set(full) == set(want_sd), "n_params": len(list(pm.parameters())),
                "stages": [(s["layers"], s["mesh_shape"], s["recompute_kind"]) for s in summary["stages"]],
                "schedule": summary["schedule"], "microbatches": summary["microbatches"], "stage": pm.stage,
                "rank_stages": pm.stages, "virtual": summary["virtual_stages"]}

    return run_case(tag, go)


def _outputs_and_gathers(gm) -> tuple[int, int]:
    """(outputs, all-gathers) of a lowered program."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return len(out.args[0]), sum(n.op == "call_function" and "all_gather" in getattr(n.target, "__name__", "")
                                 for n in gm.graph.nodes)


def errors_case():
    """A pipelined module refuses a plain call (naming train_step) and inputs of other shapes."""
    def go():
        net, inputs = models.build("gpt", layers=2)
        pm = autopar.parallelize(net, autopar.Mesh((4,)), inputs, profile=False,
                                 pipeline=autopar.Pipeline(stages=2, microbatches=2), force=autopar.Layout(dp=2))
        out = {"tag": "errors"}
        try:
            pm.train_step(*(t[:2] for t in inputs))
            out["shape"] = "no error"
        except ConfigError as e:
            out["shape"] = str(e)
        pm.train_step(*inputs)  # still runs after refusing
        # a loss adding a term to a mean over counted targets: exact while microbatches count alike
        net, inputs = _CrossEntropyPlusTerm(), (torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6)))
        pm = autopar.parallelize(net, autopar.Mesh((4,)), inputs, profile=False,
                                 pipeline=autopar.Pipeline(stages=2, microbatches=2), force=autopar.Layout(dp=2))
        pm.train_step(*inputs)
        try:
            pm.train_step(inputs[0], _padded(inputs[1], torch.tensor([[0], [3], [1], [1]])))
            out["uneven"] = "no error"
        except ConfigError as e:
            out["uneven"] = str(e)
        return out

    return run_case("errors", go)


class _CrossEntropyPlusTerm(torch.nn.Module):
    """Two layers; the loss is a cross entropy plus a small mean of the logits' squares."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, 16), targets.view(-1)) + 0.01 * logits.pow(2).mean()


CASES = [
    ("gpt 2 stages x tp2 1f1b", (4,), dict(stages=2, microbatches=2, schedule="1f1b"), dict(layout=autopar.Layout(tp=2))),
    ("gpt 2 stages x dp2 gpipe", (4,), dict(stages=2, microbatches=2, schedule="gpipe"), dict(layout=autopar.Layout(dp=2))),
    ("gpt 4 stages 1f1b", (4,), dict(stages=4, microbatches=4, schedule="1f1b"), {}),
    ("gpt 4 stages gpipe recompute", (4,), dict(stages=4, microbatches=2, schedule="gpipe", recompute=True), {}),
    ("gpt 2 stages x tp2 recompute clip", (4,), dict(stages=2, microbatches=2, schedule="1f1b", recompute=True),
     dict(layout=autopar.Layout(tp=2), clip=True)),
    # selective: the matmuls' and attention's outputs kept, the rest (norms, gelu, collectives) recomputed
    ("gpt 2 stages x tp2 selective recompute clip", (4,), dict(stages=2, microbatches=2, schedule="1f1b",
                                                               recompute="selective"),
     dict(layout=autopar.Layout(tp=2), clip=True)),
    ("gpt 3+1 layers x dp2 zero2", (4,), dict(layers=(3, 1), microbatches=2, schedule="1f1b"),
     dict(layout=autopar.Layout(dp=2, zero=2))),
    ("gpt 2x2 mesh, stages over axis 0", (2, 2), dict(stages=2, microbatches=2, schedule="1f1b"), dict(layout=autopar.Layout(tp=2))),
    ("llama 2 stages x tp2", (4,), dict(stages=2, microbatches=2, schedule="1f1b"), dict(model="llama", layout=autopar.Layout(tp=2))),
    # tied, stored alike on both stages: each rank's ZeRO-2 chunk of the tied gradient summed with its peer's as it is
    ("hf gpt2 2 stages x dp2 zero2 (tied across stages)", (4,), dict(stages=2, microbatches=2, schedule="1f1b"),
     dict(model="gpt2", layers=2, layout=autopar.Layout(dp=2, zero=2), clip=True)),
    ("hf llama 2 stages x tp2", (4,), dict(stages=2, microbatches=2, schedule="1f1b"),
     dict(model="hf-llama", layers=2, layout=autopar.Layout(tp=2))),
    ("gpt interleaved 2 ranks x 2 stages x dp2", (4,), dict(stages=2, virtual_stages=2, microbatches=2),
     dict(layout=autopar.Layout(dp=2), clip=True)),
    ("llama interleaved 4 ranks x 2 stages recompute", (4,), dict(stages=4, virtual_stages=2, microbatches=4, recompute=True),
     dict(model="llama", layers=8)),
    ("hf gpt2 interleaved (tied across ranks)", (4,), dict(stages=2, virtual_stages=2, microbatches=2),
     dict(model="gpt2", layers=4, layout=autopar.Layout(tp=2))),
    ("hf llama 1+3 layers", (4,), dict(layers=(1, 3), microbatches=4, schedule="gpipe"), dict(model="hf-llama", layers=4)),
    ("hf llama selective recompute interleaved x dp2", (4,), dict(stages=2, virtual_stages=2, microbatches=2,
                                                                  recompute="selective"),
     dict(model="hf-llama", layers=4, layout=autopar.Layout(dp=2))),
    ("gpt zero bubble 4 stages", (4,), dict(stages=4, microbatches=4, schedule="zero-bubble"), {}),
    ("gpt zero bubble 3+1 layers x dp2 zero2", (4,), dict(layers=(3, 1), microbatches=2, schedule="zero-bubble"),
     dict(layout=autopar.Layout(dp=2, zero=2))),
    ("llama zero bubble 2 stages x tp2 clip", (4,), dict(stages=2, microbatches=4, schedule="zero-bubble"),
     dict(model="llama", layout=autopar.Layout(tp=2), clip=True)),
    # tied under zero bubble, as the stages store it (alike: summed as it is) and forced whole (gathered
    # in the stage, summed, sliced again), as where stages store it differently
    ("hf gpt2 zero bubble (tied across stages)", (4,), dict(stages=2, microbatches=2, schedule="zero-bubble"),
     dict(model="gpt2", layers=2, layout=autopar.Layout(dp=2))),
    ("hf gpt2 zero bubble (tied across stages, summed whole)", (4,), dict(stages=2, microbatches=2, schedule="zero-bubble"),
     dict(model="gpt2", layers=2, layout=autopar.Layout(dp=2), tied_whole=True)),
    # ignored targets that differ per microbatch: each microbatch weighs its share of the count
    ("hf gpt2 padded labels 2 stages x dp2", (4,), dict(stages=2, microbatches=4, schedule="1f1b"),
     dict(model="gpt2", layers=2, layout=autopar.Layout(dp=2), padded=True)),
    ("gpt padded targets interleaved 4 ranks x 2 stages", (4,), dict(stages=4, virtual_stages=2, microbatches=4),
     dict(layers=8, padded=True)),
    # transformers' masks index the attention mask by an arange over the batch: still per sample
    ("hf gpt2 attention mask 2 stages x dp2", (4,), dict(stages=2, microbatches=4, schedule="1f1b"),
     dict(model="gpt2", layers=2, layout=autopar.Layout(dp=2), masked=True)),
    ("hf llama attention mask 2 stages x tp2", (4,), dict(stages=2, microbatches=2, schedule="gpipe"),
     dict(model="hf-llama", layers=2, layout=autopar.Layout(tp=2), masked=True)),
    # the 4-D float mask travels between stages without a gradient, and as a view: zero bubble's split
    # backward detaches every stage output in place, which a view refuses
    ("hf gpt2 attention mask zero bubble 4 stages", (4,), dict(stages=4, microbatches=4, schedule="zero-bubble"),
     dict(model="gpt2", layers=4, masked=True)),
    ("hf llama attention mask zero bubble 2 stages x tp2", (4,), dict(stages=2, microbatches=2, schedule="zero-bubble"),
     dict(model="hf-llama", layers=2, layout=autopar.Layout(tp=2), masked=True)),
    ("hf gpt2 attention mask interleaved x dp2", (4,), dict(stages=2, virtual_stages=2, microbatches=2),
     dict(model="gpt2", layers=4, layout=autopar.Layout(dp=2), masked=True)),
    ("hf llama attention mask interleaved 4 ranks", (4,), dict(stages=4, virtual_stages=2, microbatches=4),
     dict(model="hf-llama", layers=8, masked=True)),
    # the last stage runs the loss alone (its logits dropped) under recomputation too
    ("hf gpt2 recompute 2 stages x dp2", (4,), dict(stages=2, microbatches=2, schedule="1f1b", recompute=True),
     dict(model="gpt2", layers=2, layout=autopar.Layout(dp=2))),
    # nn.MultiheadAttention merges (time, batch) rows inside: kept apart (ir/rewrites.py), so microbatches split it
    ("vit 2 stages x dp2", (4,), dict(stages=2, microbatches=2, schedule="1f1b"), dict(model="vit", layers=2,
                                                                                    layout=autopar.Layout(dp=2))),
]


def train_next_to(pm, ref, inputs, steps: int) -> tuple[float, float]:
    """``steps`` AdamW steps of ``pm`` (``train_step``) and of the one-process ``ref``: the worst
    loss error and the trained state's error."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    loss_err = 0.0
    for step in range(steps):
        x = fresh_inputs(inputs, step)
        loss, want = pm.train_step(*x), ref(*x)
        want.backward()
        loss_err = max(loss_err, rel(loss, want))
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    state_err = max(rel(v, ref.state_dict()[k]) for k, v in pm.full_state_dict().items())
    return loss_err, state_err


def default_case():
    """``parallelize`` with no ``pipeline=`` searches stages (the default is "auto"): on 4 ranks of
    the cpu-gloo preset it may cut the small GPT of 8 layers into stages (where that is predicted
    faster by more than nothing: the preset's spread is 0); it trains exactly through train_step,
    and through the plain loop."""
    def go():
        warnings.simplefilter("ignore")
        net, inputs = models.build("gpt", layers=8)
        ref = copy.deepcopy(net)
        pm = autopar.parallelize(net, autopar.Mesh((4,)), inputs, profile=False)
        loss_err, state_err = train_next_to(pm, ref, inputs, STEPS)
        plain = plain_loop(pm, ref, inputs, None)
        return {"tag": "default plan", "stages": len(pm.plan.summary()["pipeline"]["stages"]),
                "microbatches": pm.plan.summary()["pipeline"]["microbatches"], "loss_err": loss_err,
                "state_err": state_err, "plain": plain, "decided": pm.plan.solver.get("decided")}

    return run_case("default plan", go)


def plain_loop(pm, ref, inputs, kwargs_fn) -> dict:
    """The loop a user writes, on ``pm`` next to ``ref``: a forward, a scaled loss's backward,
    torch's clipping and an AdamW step (twice); a smaller batch; two halves accumulated under
    ``no_sync()``; ``eval()`` without gradients; then ``train_step`` on a batch the plain call ran
    just before (the same loss). The worst errors: loss, gradient (against the model's largest),
    clipped norm, the trained state's."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    call = (lambda m, x: m(**kwargs_fn(x))) if kwargs_fn else (lambda m, x: m(*x))  # noqa: E731
    err = {"loss": 0.0, "grad": 0.0, "norm": 0.0}

    def grads():
        scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
        for fqn, g in pm.full_grads().items():
            r = ref.get_parameter(fqn).grad
            err["grad"] = max(err["grad"], 0.0 if g is None and r is None else (g - r).abs().max().item() / scale)

    def step():
        err["norm"] = max(err["norm"], rel(torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.5),
                                           torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        for o in (opt, ropt):
            o.step()
            o.zero_grad()

    batches = [fresh_inputs(inputs, k) for k in range(2)] + [tuple(t[: max(1, t.shape[0] // 2)] for t in inputs)]
    for x in batches:
        got, want = _loss(call(pm, x)), _loss(call(ref, x))
        (got * 0.5).backward()
        (want * 0.5).backward()
        err["loss"] = max(err["loss"], rel(got, want))
        grads()
        step()
    halves = [tuple(t[: t.shape[0] // 2] for t in inputs), tuple(t[t.shape[0] // 2:] for t in inputs)]
    with pm.no_sync():
        _loss(call(pm, halves[0])).backward()
    _loss(call(pm, halves[1])).backward()
    for x in halves:
        _loss(call(ref, x)).backward()
    grads()
    step()
    pm.eval()
    ref.eval()
    with torch.no_grad():
        err["loss"] = max(err["loss"], rel(_loss(call(pm, inputs)), _loss(call(ref, inputs))))
    pm.train()
    ref.train()
    called = _loss(call(pm, inputs)).detach()
    stepped = pm.train_step(**kwargs_fn(inputs)) if kwargs_fn else pm.train_step(*inputs)
    opt.zero_grad()
    state = max(rel(v, ref.state_dict()[k]) for k, v in pm.full_state_dict().items())
    return {**err, "state": state, "call_vs_step": rel(called, stepped), "programs": len(pm._ap.pipeline.calls)}


def plain_case(tag, mesh_shape, pipeline, *, model="gpt", layers=4, layout=None, masked=False):
    """A pipelined plan in the plain training loop (``plain_loop``)."""
    def go():
        warnings.simplefilter("ignore")
        if model in ("gpt", "llama"):
            net, inputs = models.build(model, layers=layers, batch=8)
            kwargs_fn = None
        else:
            net = _hf(model, layers)
            g = torch.Generator().manual_seed(0)
            inputs = tuple(torch.randint(0, HF_VOCAB, (8, 16), generator=g) for _ in range(2))

            def kwargs_fn(x):
                kwargs = {"input_ids": x[0], "labels": x[1]}
                return _masked(kwargs) if masked else kwargs
        ref = copy.deepcopy(net)
        kw = {"example_kwargs": kwargs_fn(inputs)} if kwargs_fn else {}
        pm = autopar.parallelize(net, autopar.Mesh(mesh_shape), () if kwargs_fn else inputs, pipeline=pipeline,
                                 force=layout, profile=False, **kw)
        return {"tag": tag, **plain_loop(pm, ref, inputs, kwargs_fn), "stages": len(pm.plan.pipeline.stages)}

    return run_case(tag, go)


PLAIN_CASES = [
    ("plain gpt 2 stages x dp2 1f1b", (4,), dict(stages=2, microbatches=2, schedule="1f1b"),
     dict(layout=autopar.Layout(dp=2))),
    ("plain gpt 4 stages gpipe recompute", (4,), dict(stages=4, microbatches=4, schedule="gpipe", recompute=True), {}),
    ("plain llama interleaved 4 ranks", (4,), dict(stages=4, virtual_stages=2, microbatches=4),
     dict(model="llama", layers=8)),
    ("plain llama 2 stages x tp2 selective recompute", (4,), dict(stages=2, microbatches=2, schedule="1f1b",
                                                                  recompute="selective"),
     dict(model="llama", layout=autopar.Layout(tp=2))),
    ("plain hf gpt2 zero bubble, tied across stages, masked", (4,), dict(stages=2, microbatches=2, schedule="zero-bubble"),
     dict(model="gpt2", layers=2, layout=autopar.Layout(dp=2), masked=True)),
]


def saved_plan_meta_case(path):
    """A pipelined plan saved to a file by rank 0, run by every rank on a meta-device GPT: each stage
    materializes only its own layers, yet the values are those of initializing the whole model (the
    random stream runs through every module), and it trains like that model."""
    def go():
        import torch.distributed as dist

        warnings.simplefilter("ignore")
        model, meta_inputs = models.build("gpt", layers=4, device="meta")
        if dist.get_rank() == 0:
            autopar.plan(model, autopar.Mesh((4,)), meta_inputs, pipeline=autopar.Pipeline(stages=2, microbatches=2),
                         force=autopar.Layout(dp=2)).save(path)
        dist.barrier()
        torch.manual_seed(7)
        pm = autopar.parallelize(model, autopar.Mesh((4,)), meta_inputs, plan=path, device="cpu")
        torch.manual_seed(7)
        real, inputs = models.build("gpt", layers=4)
        with torch.no_grad():  # Module.apply visits children first, as materialization does
            real.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        init_err = max(rel(v, real.state_dict()[k]) for k, v in pm.full_state_dict().items())
        loss_err, state_err = train_next_to(pm, real, inputs, 2)
        return {"tag": "saved plan, meta model", "init_err": init_err, "loss_err": loss_err, "state_err": state_err,
                "stages": len(pm.plan.pipeline.stages), "still_meta": all(p.is_meta for p in model.parameters())}

    return run_case("saved plan, meta model", go)


def viewed_stage_case():
    """A stage whose intra-op plan runs on another view of its devices than the mesh's rows (the
    search's ``narrower_views``: a (2, 2) block planned as (4,)): its process groups follow the
    stage's own shape, and it trains as one process does."""
    def go():
        import dataclasses

        from autopar.solver.microbatches import microbatch_inputs

        warnings.simplefilter("ignore")
        net, inputs = models.build("gpt", layers=4)
        mesh = autopar.Mesh((2, 2))
        plan = autopar.plan(net, mesh, inputs, pipeline=autopar.Pipeline(stages=1, microbatches=2))
        micro, _ = microbatch_inputs(inputs, None, 2)
        viewed = autopar.plan(net, autopar.Mesh((4,)), micro, pipeline=False, force=autopar.Layout(tp=4), microbatches=2)
        stage = dataclasses.replace(plan.pipeline.stages[0], plan=viewed, mesh_shape=(4,))
        plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, stages=[stage]))
        ref = copy.deepcopy(net)
        pm = autopar.parallelize(net, mesh, inputs, plan=plan)
        loss_err, state_err = train_next_to(pm, ref, inputs, 2)
        shapes = [s["mesh_shape"] for s in pm.plan.summary()["pipeline"]["stages"]]
        return {"tag": "stage on a view of its devices", "loss_err": loss_err, "state_err": state_err, "shapes": shapes}

    return run_case("stage on a view of its devices", go)


def _rank_main(rank, world, path):
    out = [pipeline_case(tag, shape, autopar.Pipeline(**pipe), **kw) for tag, shape, pipe, kw in CASES]
    out += [plain_case(tag, shape, autopar.Pipeline(**pipe), **kw) for tag, shape, pipe, kw in PLAIN_CASES]
    out.append(errors_case())
    out.append(default_case())
    out.append(saved_plan_meta_case(path))
    out.append(viewed_stage_case())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plans") / "pipelined.json")
    per_rank = spawn(_rank_main, 4, args=(path,), timeout_s=900)
    return {r["tag"]: [per_rank[k][i] for k in range(4)] for i, r in enumerate(per_rank[0])}


@pytest.mark.parametrize("tag", [c[0] for c in CASES])
def test_pipelined_training_is_exact(results, tag):
    for r in results[tag]:
        assert "error" not in r, r.get("error")
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, r
        assert r["norm_err"] <= TOL, r
        assert r["state_err"] <= STATE_TOL and r["keys_equal"], r


def test_the_last_stage_computes_the_loss_alone(results):
    """A pipelined step reads only the loss: the last stage's program returns it alone, without the
    logits transformers' models also return; and no program of the stage gathers the logits (a call
    returns them split: runtime.outputs)."""
    for tag in ("hf gpt2 attention mask 2 stages x dp2", "hf gpt2 padded labels 2 stages x dp2"):
        seen = [c["last_stage"] for c in results[tag] if c["last_stage"]]
        assert seen, tag
        for (lowered_out, lowered_gathers), (out, gathers) in (x for per_rank in seen for x in per_rank):
            assert lowered_out >= 2 and out == 1, (tag, lowered_out, out)
            assert gathers == lowered_gathers == 0, (tag, lowered_gathers, gathers)
    # the loss-only program is cut into checkpointed layers as the full one was (exact: see above)
    assert [r["pieces"] for r in results["hf gpt2 recompute 2 stages x dp2"]] == [1, 1, 1, 1]


def test_stages_are_what_was_asked(results):
    by = {tag: rs[0] for tag, rs in results.items()}
    assert [s[0] for s in by["gpt 3+1 layers x dp2 zero2"]["stages"]] == [[0, 2], [3, 3]]
    assert [s[0] for s in by["hf llama 1+3 layers"]["stages"]] == [[0, 0], [1, 3]]
    assert [s[1] for s in by["gpt 2 stages x tp2 1f1b"]["stages"]] == [[2], [2]]
    assert [s[1] for s in by["gpt 2x2 mesh, stages over axis 0"]["stages"]] == [[1, 2], [1, 2]]
    assert len(by["gpt 4 stages 1f1b"]["stages"]) == 4
    assert all(s[2] == "full" for s in by["gpt 4 stages gpipe recompute"]["stages"])
    assert all(s[2] == "none" for s in by["gpt 4 stages 1f1b"]["stages"])
    for tag in ("gpt 2 stages x tp2 selective recompute clip", "hf llama selective recompute interleaved x dp2"):
        assert all(s[2] == "selective" for s in by[tag]["stages"]), by[tag]["stages"]
        assert all(r["pieces"] == r["selective"] == 2 for r in results[tag]), tag  # a checkpoint per layer
    assert all(r["selective"] == 0 for r in results["gpt 2 stages x tp2 recompute clip"])
    # recomputation runs each layer of a stage under its own checkpoint (as the plan prices it)
    assert [r["pieces"] for r in results["gpt 2 stages x tp2 recompute clip"]] == [2, 2, 2, 2]
    assert [r["pieces"] for r in results["gpt 4 stages gpipe recompute"]] == [1, 1, 1, 1]
    assert all(r["pieces"] == 0 for r in results["gpt 2 stages x tp2 1f1b"])
    assert by["gpt 2 stages x dp2 gpipe"]["schedule"] == "gpipe" and by["gpt 2 stages x dp2 gpipe"]["microbatches"] == 2
    # every rank runs one stage, ranks in stage order
    assert [r["stage"] for r in results["gpt 4 stages 1f1b"]] == [0, 1, 2, 3]
    assert [r["stage"] for r in results["gpt 2 stages x tp2 1f1b"]] == [0, 0, 1, 1]
    # interleaved 1F1B: stage s on the block of ranks s mod blocks, several stages per rank
    assert [r["rank_stages"] for r in results["gpt interleaved 2 ranks x 2 stages x dp2"]] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert [r["rank_stages"] for r in results["llama interleaved 4 ranks x 2 stages recompute"]] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert by["llama interleaved 4 ranks x 2 stages recompute"]["virtual"] == 2
    assert [r["pieces"] for r in results["llama interleaved 4 ranks x 2 stages recompute"]] == [2, 2, 2, 2]


def test_zero_bubble_splits_the_backward(results):
    """Under zero bubble the first stage runs whole backwards (torch defers each as the weight task),
    every later stage only split ones: no tap fires there, and each microbatch's weight half
    reaches the reducer in one hand-off. (A stage of one rank synchronises nothing: no taps.)"""
    for tag in ("gpt zero bubble 4 stages", "llama zero bubble 2 stages x tp2 clip"):
        m = next(c[2]["microbatches"] for c in CASES if c[0] == tag)
        for r in results[tag]:
            assert r["schedule"] == "zero-bubble", r
            if r["stage"] == 0:
                assert r["weight_halves"] == 0, r
            else:
                assert r["taps"] == 0 and r["weight_halves"] == STEPS * m, r
    # with tensor parallelism the first stage's whole backward does reach its taps
    assert all(r["taps"] > 0 for r in results["llama zero bubble 2 stages x tp2 clip"] if r["stage"] == 0)
    for r in results["gpt 2 stages x tp2 1f1b"]:  # 1F1B: whole backwards everywhere
        assert r["taps"] > 0 and r["weight_halves"] == 0, r


def test_gradient_sync_starts_inside_the_last_backward(results):
    """Where a rank runs one stage under GPipe or 1F1B, gradients synchronise once per step from
    the last microbatch's backward, each bucket launched before that backward ends (overlapped, as
    DDP under torch's schedules) and waited for after the schedule (so that the stage sends its
    input gradient first: the previous stage's last backward waits for it); under interleaved and
    zero-bubble schedules, after the schedule. A rank with no taps (a stage of one device)
    synchronises nothing."""
    for tag, _, pipe, _ in CASES:
        one_stage_per_rank = pipe.get("schedule") in ("gpipe", "1f1b") and not pipe.get("virtual_stages")
        for r in results[tag]:
            if one_stage_per_rank and r["taps"]:
                assert r["in_backward_syncs"] == STEPS and r["launched_in_backward"] >= STEPS, (tag, r)
            elif not one_stage_per_rank:
                assert r["in_backward_syncs"] == 0, (tag, r)
    assert all(r["launched_in_backward"] > 0 and r["left_in_flight"] >= STEPS for r in results["gpt 2 stages x dp2 gpipe"])


def test_tied_gradients_sum_as_the_stages_store_them(results):
    # stored alike (ZeRO-2 chunks on dp2 sub-meshes of one shape, or whole on both): each rank's part
    # with its peer's, under 1F1B and zero bubble; the whole-tensor path (forced) is exact too (pipeline_case)
    assert all(r["tied_alike"] == [True] for r in results["hf gpt2 2 stages x dp2 zero2 (tied across stages)"])
    assert all(r["tied_alike"] == [True] for r in results["hf gpt2 zero bubble (tied across stages)"])
    assert all(r["tied_alike"] == [False] for r in results["hf gpt2 zero bubble (tied across stages, summed whole)"])


def test_pipelined_module_errors(results):
    for r in results["errors"]:
        assert "error" not in r, r.get("error")
        assert "shape" in r["shape"] and "microbatches" in r["shape"], r
        assert "adds a mean over counted targets" in r["uneven"] and "Pipeline(microbatches=1)" in r["uneven"], r


def test_the_default_plan_trains_exactly_in_both_loops(results):
    for r in results["default plan"]:
        assert "error" not in r, r.get("error")
        assert r["loss_err"] <= TOL and r["state_err"] <= STATE_TOL, r
        _assert_plain(r["plain"])


def _assert_plain(r: dict) -> None:
    assert r["loss"] <= TOL and r["grad"] <= TOL and r["norm"] <= TOL, r
    assert r["state"] <= STATE_TOL, r
    assert r["call_vs_step"] <= TOL, r  # the plain call and train_step agree on the same batch


@pytest.mark.parametrize("tag", [c[0] for c in PLAIN_CASES])
def test_pipelined_plans_train_in_the_plain_loop(results, tag):
    """Forward in the call, backward when the (scaled) loss goes back, clipping, accumulation under
    no_sync, a smaller batch, eval: all exact; stages built for other modes and shapes on first use."""
    for r in results[tag]:
        assert "error" not in r, r.get("error")
        _assert_plain(r)
        assert r["programs"] >= 2  # calls in eval mode are told apart (on stages of their own where the graph differs)


def test_a_saved_pipelined_plan_runs_a_meta_model_exactly(results):
    for r in results["saved plan, meta model"]:
        assert "error" not in r, r.get("error")
        assert r["stages"] == 2 and r["still_meta"]
        assert r["init_err"] == 0.0, r
        assert r["loss_err"] <= TOL and r["state_err"] <= STATE_TOL, r


def test_weight_groups_are_made_disjoint():
    """torch's input half can leave a weight in two groups (a weight whose branches meet the input
    path at several nodes); the weight half merges such groups, keeps one saved gradient per
    intermediate, and drops groups no gradient reached."""
    from autopar.runtime.pipeline import _disjoint

    w1, w2, w3, x1, x2, x3 = (object() for _ in range(6))
    g1, g2 = ("g1",), ("g2",)
    groups = [{"params": {w1}, "intermediates": [x1], "grads": [g1]},
              {"params": {w1, w2}, "intermediates": [x1, x2], "grads": [g1, g2]},
              {"params": {w3}, "intermediates": [x3]}]  # never reached: no "grads"
    out = _disjoint(groups)
    assert len(out) == 1
    nodes, saved, inters = out[0]
    assert set(nodes) == {w1, w2} and len(nodes) == 2
    assert inters == [x1, x2] and saved == [g1, g2]


def test_a_stage_runs_on_a_view_of_its_devices(results):
    for r in results["stage on a view of its devices"]:
        assert "error" not in r, r.get("error")
        assert r["shapes"] == [[4]], r
        assert r["loss_err"] <= TOL and r["state_err"] <= STATE_TOL, r

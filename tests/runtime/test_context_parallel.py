"""Context parallelism: whole models with ring attention (``Layout(cp=...)``: the sequence of
attention split over the cp axis, ``codegen/ring_attention.py``), trained 2 AdamW steps next to
the single-process model at sequence length 1024 on 2 and 4 gloo ranks: forward, loss, every
gradient and the trained state within 1e-5 (``parallel_harness``). Ring alone, ring x data
parallel (and ZeRO-2), ring x tensor parallel, ring inside pipeline stages; the built-in LLaMA (grouped-query
attention), and transformers' LLaMA and Qwen2 (grouped-query), causal and left-padded,
and Mistral with a sliding window shorter than the sequence (their 4-D masks, rows split with the
queries); minGPT's attention written out by hand (fused into causal SDPA at trace time). And the
all-to-all form: the sequence split everywhere but attention, which splits its heads."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.runtime.launch import spawn
from autopar.runtime.process_groups import MeshGroups

from parallel_harness import ADAM_EPS, TOL, TRAINED_STATE_TOL, compare, fresh_inputs, model_case, rel, run_case, summary

SEQ = 1024
LLAMA = dict(layers=2, width=64, heads=4, kv_heads=2, hidden=128, seq=SEQ, batch=2, vocab=256)


HF_VOCAB = 128


def hf_model(arch: str):
    """A small transformers causal LM with grouped-query attention (sdpa), positions for SEQ."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if arch == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=256, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def hf_case(tag, arch, mesh, groups, padded: bool, layout):
    def go():
        model = hf_model(arch)
        g = torch.Generator().manual_seed(0)
        ids, labels = (torch.randint(0, HF_VOCAB, (2, SEQ), generator=g) for _ in range(2))
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, :100] = 0  # the second sequence left-padded by 100 tokens

        def kwargs(x):  # unpadded: called as pretraining calls it, without a mask (a causal mask is built)
            return {"input_ids": x[0], "labels": x[1], "use_cache": False} | ({"attention_mask": mask} if padded else {})

        return summary(tag, compare(model, (ids, labels), mesh, groups, kwargs_fn=kwargs, force=layout, steps=2))

    return run_case(tag, go)


def mingpt_case(tag, mesh, groups, layout):
    """minGPT's attention written out (q @ k^T, masked_fill from a tril buffer, softmax, @ v):
    traced into causal SDPA (``ir/attention.py``), so the ring runs it balanced."""
    def go():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import models_zoo

        model, inputs = models_zoo.mingpt(block_size=SEQ, batch=2, n_layer=1)
        return summary(tag, compare(model, inputs, mesh, groups, force=layout, steps=2))

    return run_case(tag, go)


def all_to_all_case(tag, mesh, groups, **build):
    """The all-to-all form (DeepSpeed-Ulysses): every op that has the sequence dim splits it over
    the mesh, attention splits its heads instead; all-to-alls swap the two around attention."""
    def go():
        from autopar import models
        from autopar.ir import trace

        model, inputs = models.build("llama", **(LLAMA | build))
        graph = trace(model, inputs)

        def split_sequence(shape):
            def pred(s):
                out = s.output[0] if isinstance(s.output, tuple) else s.output
                return all(bool(out.dim_axes[d]) == (n == SEQ) for d, n in enumerate(shape))
            return pred

        force = {}
        for n in graph.nodes.values():
            if n.target == "aten.scaled_dot_product_attention.default":
                force[n.name] = "heads"
            elif n.op == "call_function" and SEQ in (getattr(n.meta, "shape", None) or ()):
                force[n.name] = split_sequence(tuple(n.meta.shape))
        res = compare(model, inputs, mesh, groups, force=force, steps=2)
        steps = [st.kind for e in res["plan"].edges for st in e.steps]
        return summary(tag, res) | {"all_to_alls": steps.count("all_to_all")}

    return run_case(tag, go)


def rank_2(rank, world):
    mesh = autopar.Mesh((2,))
    groups = MeshGroups(mesh)
    cp2 = autopar.Layout(cp=2)
    return [model_case("llama cp2", "llama", mesh, groups, LLAMA, force=cp2, steps=2),
            hf_case("hf llama cp2", "llama", mesh, groups, False, cp2),
            hf_case("hf qwen2 cp2 padded", "qwen2", mesh, groups, True, cp2),
            hf_case("hf mistral cp2 sliding window", "mistral", mesh, groups, False, cp2),
            mingpt_case("mingpt cp2", mesh, groups, cp2),
            all_to_all_case("llama all-to-all sp2", mesh, groups)]


def pipeline_case(tag):
    """Ring inside pipeline stages: 2 stages of 2 ranks, each context parallel 2 (1F1B, 2
    microbatches), trained with ``train_step`` next to one process."""
    def go():
        import copy

        from autopar import models

        model, inputs = models.build("llama", **LLAMA)
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, autopar.Mesh((4,)), inputs, force=autopar.Layout(cp=2), profile=False,
                                 pipeline=autopar.Pipeline(stages=2, microbatches=2, schedule="1f1b"))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
        worst = 0.0
        for step in range(2):
            x = fresh_inputs(inputs, step)
            loss, want = pm.train_step(*x), ref(*x)
            want.backward()
            worst = max(worst, rel(loss, want))
            worst = max([worst] + [rel(g, ref.get_parameter(fqn).grad) for fqn, g in pm.full_grads().items()])
            opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
        full = pm.full_state_dict()
        state = max(rel(full[k], v) for k, v in ref.state_dict().items())
        stages = pm.plan.stage_plans()
        families = {n.family for st in stages for n in st.nodes.values()}
        return {"tag": tag, "worst": worst, "state_err": state, "bad_grads": {}, "families": families,
                "stages": len(stages)}

    return run_case(tag, go)


def rank_4(rank, world):
    mesh4, groups4 = autopar.Mesh((4,)), MeshGroups(autopar.Mesh((4,)))
    out = [model_case("llama cp4", "llama", mesh4, groups4, LLAMA, force=autopar.Layout(cp=4), steps=2)]
    mesh = autopar.Mesh((2, 2))
    groups = MeshGroups(mesh)
    out.append(model_case("llama dp2 x cp2", "llama", mesh, groups, LLAMA, force=autopar.Layout(dp=2, cp=2), steps=2))
    out.append(model_case("llama dp2 zero2 x cp2", "llama", mesh, groups, LLAMA, force=autopar.Layout(dp=2, cp=2, zero=2),
                          steps=2))
    out.append(model_case("llama cp2 x tp2", "llama", mesh, groups, LLAMA, force=autopar.Layout(cp=2, tp=2), steps=2))
    out.append(hf_case("hf llama cp4 padded", "llama", autopar.Mesh((4,)), MeshGroups(autopar.Mesh((4,))), True,
                       autopar.Layout(cp=4)))
    out.append(pipeline_case("llama pp2 x cp2"))
    # 4-way heads need 4 key/value heads (grouped-query attention splits its key/value heads)
    out.append(all_to_all_case("llama all-to-all sp4", mesh4, groups4, kv_heads=4))
    return out


@pytest.fixture(scope="module")
def results():
    return [r for res in (spawn(rank_2, 2, timeout_s=600), spawn(rank_4, 4, timeout_s=600)) for rank in res for r in rank]


def test_ring_attention_trains_whole_models_exactly(results):
    assert len({r["tag"] for r in results}) == 13
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["worst"] <= TOL, (r["tag"], r["worst"], r["bad_grads"])
        assert r["state_err"] <= TRAINED_STATE_TOL, (r["tag"], r["state_err"])


def test_the_all_to_all_form_ran_heads_split_attention(results):
    for r in (r for r in results if "all-to-all" in r["tag"]):  # each rank's
        assert "heads" in r["families"] and not any("ring" in f for f in r["families"]), r["families"]
        assert r["all_to_alls"] >= 2 * LLAMA["layers"], r["all_to_alls"]  # into and out of each attention


def test_each_case_ran_ring_attention(results):
    for r in (r for r in results if "all-to-all" not in r["tag"]):
        ring = [f for f in r["families"] if {"ring", "ring(causal)"} & set(f.split("+"))]
        assert ring, (r["tag"], r["families"])
        # causal masks run balanced without a mask tensor: is_causal, transformers' mask built
        # without padding, minGPT's tril buffer; padding and sliding windows run their masks
        masked = "padded" in r["tag"] or "sliding" in r["tag"]
        assert all(("ring(causal)" in f.split("+")) != masked for f in ring), (r["tag"], ring)
        if "dp2" in r["tag"]:
            assert any(f.startswith("dp+") for f in ring), (r["tag"], ring)
        if "zero2" in r["tag"]:  # gradients summed over dp and cp, split over dp
            others = {k: fam for k, (_, fam) in r["storage"].items() if fam != "buffer" and not fam.endswith("zero2")}
            assert not others, others
        if "tp2" in r["tag"]:
            assert any("heads" in f for f in ring), (r["tag"], ring)
        if "pp2" in r["tag"]:
            assert r["stages"] == 2, r

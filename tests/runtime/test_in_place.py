"""Writes into tensors made inside the model, on real gloo groups: transformers T5 and BART (whose
decoder inputs are the labels shifted right with ``new_zeros``, a slice assignment and
``masked_fill_``) and a hand-written model with every common kind of in-place write
(``tests/models_zoo.in_place``), under data, tensor and 2-D layouts and the planner's own choice:
forward, loss, every gradient and three AdamW steps against one process.

A plan that read a written tensor in another layout than it is held in wrote into a collective's
copy, and T5 under data parallelism lost its decoder inputs (loss 6.20054 against 6.20577). The
node-by-node comparison (``pmodel.compare_nodes``) finds such a node; here it runs on a fixed plan
(every node within 1e-5, the writes checked) and on the same program with one op changed (it
names that op). Planner-side checks without ranks: tests/solver/test_in_place_plans.py."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar.runtime.launch import spawn
from autopar.runtime.process_groups import MeshGroups
from parallel_harness import TOL, TRAINED_STATE_TOL, compare, run_case, summary

pytestmark = pytest.mark.multirank


def t5_model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                      use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    return tf.T5ForConditionalGeneration(cfg)


def bart_model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BartConfig(vocab_size=256, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return tf.BartForConditionalGeneration(cfg)


ENCODER_DECODERS = {"t5": t5_model, "bart": bart_model}


def seq2seq_batch():
    ids = torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    return ids, torch.roll(ids, 1, 1)


def seq2seq_case(tag, arch, mesh, groups, force, pipeline=False):
    def go():
        model = ENCODER_DECODERS[arch]()
        res = compare(model, seq2seq_batch(), mesh, None if pipeline else groups, force=force, pipeline=pipeline,
                      kwargs_fn=lambda x: {"input_ids": x[0], "labels": x[1]})
        out = summary(tag, res)
        out["n_params"] = len(list(model.parameters()))
        return out

    return run_case(tag, go)


def zoo_in_place_case(tag, mesh, groups, force):
    def go():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import models_zoo

        model, inputs = models_zoo.in_place()
        res = compare(model, inputs, mesh, groups, force=force)
        out = summary(tag, res)
        out["running"] = res["state_err"]  # the buffer updated in place is part of the trained state
        return out

    return run_case(tag, go)


def compare_nodes_case(tag, mesh, groups):
    """The node-by-node comparison on T5 under data parallelism, then on the same program with its
    first rsqrt turned into a sqrt (a wrong lowering of one node)."""
    def go():
        model = t5_model()
        ids, labels = seq2seq_batch()
        pm = autopar.parallelize(model, mesh, example_kwargs={"input_ids": ids, "labels": labels},
                                 force=autopar.Layout(dp=mesh.size), pipeline=False, groups=groups)
        report = pm.compare_nodes(input_ids=ids, labels=labels)
        rows = {r.node: r for r in report.rows}
        gm = pm.graph_module
        broken = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.rsqrt.default)
        broken.target = torch.ops.aten.sqrt.default
        gm.recompile()
        wrong = pm.compare_nodes(input_ids=ids, labels=labels)
        return {"tag": tag, "first": None if report.first is None else report.first.node, "n": len(report.rows),
                "written": [n for n in rows if " -> " in n], "copy_spec": rows["copy_"].spec,
                "text": str(report).splitlines()[0], "broken": broken.name,
                "named": None if wrong.first is None else wrong.first.node, "wrong_text": str(wrong).splitlines()[0]}

    return run_case(tag, go)


def rank_4(rank, world_size):
    warnings.simplefilter("ignore")
    out = []
    mesh = autopar.Mesh((4,), cluster="cpu-gloo")
    groups = MeshGroups(mesh)
    for arch in ENCODER_DECODERS:
        out.append(seq2seq_case(f"{arch} dp4", arch, mesh, groups, autopar.Layout(dp=4)))
        out.append(seq2seq_case(f"{arch} planned (4,)", arch, mesh, groups, None))
    out.append(seq2seq_case("t5 zero3", "t5", mesh, groups, autopar.Layout(dp=4, zero=3)))
    # the decoder-input shift is per sample (a copy into a fresh tensor): T5 splits into microbatches
    out.append(seq2seq_case("t5 pipeline", "t5", mesh, groups, None,
                            pipeline=autopar.Pipeline(stages=2, microbatches=2, schedule="1f1b")))
    for name, force in (("dp4", autopar.Layout(dp=4)), ("tp4", autopar.Layout(tp=4)),
                        ("zero2", autopar.Layout(dp=4, zero=2)), ("planned", None)):
        out.append(zoo_in_place_case(f"in_place {name} (4,)", mesh, groups, force))
    out.append(compare_nodes_case("compare_nodes t5 dp4", mesh, groups))
    mesh = autopar.Mesh((2, 2), cluster="cpu-gloo")
    groups = MeshGroups(mesh)
    for arch in ENCODER_DECODERS:
        out.append(seq2seq_case(f"{arch} dp2 x tp2", arch, mesh, groups, autopar.Layout(dp=2, tp=2)))
    out.append(seq2seq_case("t5 planned (2, 2)", "t5", mesh, groups, None))
    out.append(zoo_in_place_case("in_place dp2 x tp2", mesh, groups, autopar.Layout(dp=2, tp=2)))
    out.append(zoo_in_place_case("in_place planned (2, 2)", mesh, groups, None))
    return out


@pytest.fixture(scope="module")
def four_ranks():
    results = spawn(rank_4, 4, timeout_s=900)
    by_tag: dict[str, list[dict]] = {}
    for per_rank in results:
        for case in per_rank:
            by_tag.setdefault(case["tag"], []).append(case)
    return by_tag


def _assert_exact(cases):
    for c in cases:
        assert "error" not in c, f"{c['tag']} raised:\n{c['error']}"
        assert c["worst"] <= TOL, (f"{c['tag']}: out {c['out_err']:.2e}, loss {c['loss_err']:.2e}, "
                                   f"grads {c['bad_grads']}; families {c['families']}")
        assert c["state_err"] <= TRAINED_STATE_TOL, f"{c['tag']}: trained state differs by {c['state_err']:.2e}"
        assert c["n_grads"] > 0


@pytest.mark.parametrize("arch", sorted(ENCODER_DECODERS))
@pytest.mark.parametrize("layout", ["dp4", "planned (4,)", "dp2 x tp2"])
def test_encoder_decoders_are_exact(four_ranks, arch, layout):
    cases = four_ranks[f"{arch} {layout}"]
    _assert_exact(cases)
    assert cases[0]["n_grads"] == cases[0]["n_params"]
    if layout.startswith("dp"):  # the batch really is split (the decoder-input shift too)
        assert cases[0]["families"].get("dp", 0) > 0 or cases[0]["families"].get("dp+1d-col", 0) > 0


def test_t5_under_zero3_and_planned_on_2x2(four_ranks):
    _assert_exact(four_ranks["t5 zero3"])
    _assert_exact(four_ranks["t5 planned (2, 2)"])


def test_t5_pipelines_exactly_in_the_plain_loop(four_ranks):
    _assert_exact(four_ranks["t5 pipeline"])


@pytest.mark.parametrize("layout", ["dp4 (4,)", "tp4 (4,)", "zero2 (4,)", "planned (4,)", "dp2 x tp2", "planned (2, 2)"])
def test_in_place_writes_are_exact(four_ranks, layout):
    cases = four_ranks[f"in_place {layout}"]
    _assert_exact(cases)
    if layout.startswith("dp"):
        assert cases[0]["families"].get("pointwise", 0) > 0  # the in-place writes ran split


def test_compare_nodes_names_the_first_wrong_node(four_ranks):
    for c in four_ranks["compare_nodes t5 dp4"]:
        assert "error" not in c, c.get("error")
        assert c["first"] is None, c["text"]
        assert c["n"] > 300
        assert {"copy_ -> new_zeros", "fill_ -> new_zeros", "masked_fill_ -> new_zeros"} <= set(c["written"])
        assert c["copy_spec"].startswith("[S0")  # the shift ran on each rank's own samples
        assert c["named"] == c["broken"], c["wrong_text"]
